//! `askgui-data ambiguate`: the Navi-plus ambiguity pipeline, through any OpenAI-compatible chat endpoint.
//!
//! Navi-plus (arXiv 2503.24180) makes a GUI trajectory teach asking: it finds a step that carries a
//! detail of the task only the user knows, removes that detail from the task, and writes the question
//! the agent should ask at that step and the user's answer. Per episode, in three text-only requests (Navi-plus
//! showed step 1 the screenshot; we send no image, so any chat model will do):
//! 1. steps without an `instruction` get a low-level one, written from the task, the action JSON and the
//!    step index (one request for all of an episode's missing steps, so the model sees the neighbours);
//! 2. the model lists the informative steps (`{"informative": [indices]}`); `done`, `wait`, `ask` and
//!    `answer` steps are never informative;
//! 3. one informative step is picked (seeded by `--seed` and the episode id, so a resumed run picks the
//!    same one) and the model writes `{"ambiguous_task", "question", "answer"}`.
//!
//! The output episode gets the instructions, `informative` flags on every step, `ambiguous_task` and
//! that step's `ask`; an episode without an informative step is written with its instructions and flags
//! but no ambiguous task, and counted. Any previous `ask`s and ambiguous task are replaced.
//!
//! Requests are `POST {base_url}/chat/completions` with `temperature: 0`; the answer is
//! `choices[0].message.content`, from which the first JSON object with the expected key is taken
//! (code fences and prose around it are fine). An unusable answer is re-asked with the reason appended
//! to the conversation; transport errors, timeouts, 429 and 5xx are retried with exponential backoff; any
//! other 4xx is final and its body is shown. `--retries N` means N retries after the first attempt.
//!
//! An episode whose answers are still unusable after the retries (a weak model's junk: no JSON, the wrong
//! fields, the task unchanged) does not stop the run: it is written unchanged (no instructions, flags or
//! ask added) and counted in [`AmbiguateReport::rejected`] by stage and reason. An endpoint that is not
//! reachable, refuses the request or does not answer with chat completions stops the run with an error.
//!
//! The output is resumable: episodes already in it (by id) are skipped, each episode is appended and
//! flushed as soon as it is done, and a last line cut off by an interruption is dropped and redone.
//! Screenshot paths are rewritten relative to the output's folder when it differs from the input's.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use rand::{rngs::StdRng, Rng, SeedableRng};
use serde_json::{json, Value};
use thiserror::Error;
use tracing::{debug, info, warn};

use crate::action::Action;
use crate::episode::{load_episodes, Episode, EpisodeError, StepAsk};

#[derive(clap::Args, Debug, Clone)]
pub struct AmbiguateArgs {
    /// Input episode JSONL
    #[arg(long)]
    pub input: PathBuf,
    /// Output episode JSONL; resumable: episodes already in it (by id) are skipped
    #[arg(long)]
    pub out: PathBuf,
    /// Base URL of the OpenAI-compatible API (vLLM, llama.cpp server, OpenAI, ...)
    #[arg(long, env = "ASKGUI_LLM_BASE_URL", default_value = "http://localhost:8000/v1")]
    pub base_url: String,
    /// Model name sent with each request
    #[arg(long, env = "ASKGUI_LLM_MODEL")]
    pub model: String,
    /// Name of the environment variable holding the API key (unset: no Authorization header)
    #[arg(long, default_value = "OPENAI_API_KEY")]
    pub api_key_env: String,
    /// Retries after the first attempt, for HTTP errors, timeouts and unusable answers
    #[arg(long, default_value_t = 3)]
    pub retries: u32,
    /// Timeout of one request, in seconds
    #[arg(long, default_value_t = 60.0)]
    pub timeout_s: f64,
    /// Seed of the choice of the informative step that is made ambiguous
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Process at most this many new episodes, then stop (run again to continue)
    #[arg(long)]
    pub limit: Option<usize>,
    /// Delay before the first retry of a failed request, in milliseconds; doubles on each retry
    #[arg(long, default_value_t = 1000)]
    pub backoff_ms: u64,
}

/// What a run did. `done` counts the episodes written by this run, `no_informative_step` those of them
/// written without an ambiguous task, `rejected` those written unchanged because the endpoint's answers
/// were unusable after every retry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AmbiguateReport {
    pub done: usize,
    pub skipped_existing: usize,
    pub no_informative_step: usize,
    /// Episodes written unchanged, by `"<stage>: <reason>"` ([`Stage::key`] and [`Junk::kind`], e.g.
    /// `"instructions: no JSON object"`).
    pub rejected: BTreeMap<String, usize>,
}

impl AmbiguateReport {
    /// How many episodes were written unchanged for unusable answers.
    pub fn rejected_total(&self) -> usize {
        self.rejected.values().sum()
    }
}

/// The request of the pipeline that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Instructions,
    Informative,
    Ask,
}

impl Stage {
    /// The stage's short name in [`AmbiguateReport::rejected`].
    pub fn key(self) -> &'static str {
        match self {
            Stage::Instructions => "instructions",
            Stage::Informative => "informative",
            Stage::Ask => "ask",
        }
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Stage::Instructions => "stage 1 (step instructions)",
            Stage::Informative => "stage 2 (informative steps)",
            Stage::Ask => "stage 3 (ambiguous task, question and answer)",
        })
    }
}

#[derive(Debug, Error)]
pub enum AmbiguateError {
    #[error("reading the input episodes: {0}")]
    Input(#[from] EpisodeError),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}:{line}: {reason}: the output is not episode JSONL; fix or remove that line to resume")]
    BadOutput { path: PathBuf, line: usize, reason: String },
    #[error("--timeout-s {0} is not a positive number of seconds")]
    BadTimeout(f64),
    #[error(
        "episode {episode}, {stage}: {url} answered HTTP {status}, which retrying will not fix (check --base-url, \
         --model {model:?} and the key in ${key_env}); its body: {body}"
    )]
    Rejected { episode: String, stage: Stage, url: String, model: String, key_env: String, status: u16, body: String },
    #[error("episode {episode}, {stage}: no answer from {url} after {attempts} attempts; the last error: {last}")]
    Unreachable { episode: String, stage: Stage, url: String, attempts: u32, last: String },
    /// Unusable answers after every retry: [`ambiguate`] counts it and writes the episode unchanged.
    #[error(
        "episode {episode}, {stage}: no usable answer after {attempts} attempts ({reason}); \
         the endpoint answered: {snippet:?}"
    )]
    BadAnswer { episode: String, stage: Stage, attempts: u32, kind: &'static str, reason: String, snippet: String },
    #[error(
        "episode {episode}, {stage}: {url} did not answer with a chat completion after {attempts} attempts \
         ({reason}; is --base-url an OpenAI-compatible API?); its body: {snippet:?}"
    )]
    NotChatCompletion { episode: String, stage: Stage, url: String, attempts: u32, reason: String, snippet: String },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> AmbiguateError + '_ {
    move |source| AmbiguateError::Io { path: path.to_path_buf(), source }
}

fn snippet(s: &str, n: usize) -> String {
    let s = s.trim();
    match s.char_indices().nth(n) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

// ---------------------------------------------------------------------------------------------------
// Lenient JSON answers.

/// Why an answer cannot be used: `kind`, a fixed phrase to count answers by, and `detail`, which says
/// what exactly is wrong (it is shown to the model when it is asked again).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Junk {
    pub kind: &'static str,
    pub detail: String,
}

impl fmt::Display for Junk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.detail)
    }
}

fn junk(kind: &'static str, detail: impl Into<String>) -> Junk {
    Junk { kind, detail: detail.into() }
}

/// The first JSON object of the answer that has `key`.
pub fn json_with_key(answer: &str, key: &str) -> Result<Value, Junk> {
    let mut bad = None;
    for raw in crate::parse::json_object_spans(answer).into_iter().map(|r| &answer[r]) {
        match serde_json::from_str::<Value>(raw) {
            Ok(v) if v.get(key).is_some() => return Ok(v),
            Ok(_) => {}
            Err(e) => {
                bad.get_or_insert(format!("invalid JSON ({e})"));
            }
        }
    }
    Err(match bad {
        None => junk("no JSON object", format!("no JSON object with a `{key}` field")),
        Some(b) => junk("invalid JSON", format!("no JSON object with `{key}`: {b}")),
    })
}

fn index_of(v: &Value) -> Option<usize> {
    match v {
        Value::Number(n) => n.as_u64().map(|i| i as usize),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

/// Stage 1: `{"instructions": {"3": "..."}}` or `[{"step": 3, "instruction": "..."}]` or a list aligned
/// with `missing`.
fn parse_instructions(answer: &str, missing: &[usize]) -> Result<HashMap<usize, String>, Junk> {
    let v = json_with_key(answer, "instructions")?;
    let mut got = HashMap::new();
    match &v["instructions"] {
        Value::Object(m) => {
            for (k, t) in m {
                if let (Some(i), Some(t)) = (index_of(&Value::String(k.clone())), t.as_str()) {
                    got.insert(i, t.trim().to_string());
                }
            }
        }
        Value::Array(items) if items.iter().all(Value::is_string) && items.len() == missing.len() => {
            for (i, t) in missing.iter().zip(items) {
                got.insert(*i, t.as_str().unwrap_or_default().trim().to_string());
            }
        }
        Value::Array(items) => {
            for it in items {
                let i = it.get("step").or_else(|| it.get("index")).and_then(index_of);
                if let (Some(i), Some(t)) = (i, it.get("instruction").and_then(Value::as_str)) {
                    got.insert(i, t.trim().to_string());
                }
            }
        }
        other => {
            return Err(junk(
                "wrong shape",
                format!("`instructions` is {}, not an object of step -> instruction", snippet(&other.to_string(), 40)),
            ))
        }
    }
    got.retain(|i, t| missing.contains(i) && !t.is_empty());
    match missing.iter().find(|i| !got.contains_key(i)) {
        Some(i) => Err(junk("missing instruction", format!("no instruction for step {i}"))),
        None => Ok(got),
    }
}

/// Stage 2: `{"informative": [indices]}` or a list of one boolean per step.
fn parse_informative(answer: &str, steps: usize) -> Result<Vec<usize>, Junk> {
    let v = json_with_key(answer, "informative")?;
    let Some(items) = v["informative"].as_array() else {
        return Err(junk("wrong shape", "`informative` is not a list of step indices"));
    };
    let mut out = vec![];
    if !items.is_empty() && items.iter().all(Value::is_boolean) {
        if items.len() != steps {
            return Err(junk("wrong shape", format!("{} booleans for {steps} steps", items.len())));
        }
        out.extend(items.iter().enumerate().filter(|(_, b)| b.as_bool() == Some(true)).map(|(i, _)| i));
    } else {
        for it in items {
            match index_of(it) {
                Some(i) if i < steps => out.push(i),
                Some(i) => {
                    let detail = format!("step {i} does not exist (the episode has {steps} steps, 0..{steps})");
                    return Err(junk("no such step", detail));
                }
                None => return Err(junk("wrong shape", format!("{it} is not a step index"))),
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// Stage 3: the ambiguous task (which must differ from the task), the question and the answer.
fn parse_ask(answer: &str, task: &str) -> Result<(String, String, String), Junk> {
    let v = json_with_key(answer, "ambiguous_task")?;
    let field = |k: &str| match v.get(k).and_then(Value::as_str).map(str::trim) {
        Some(s) if !s.is_empty() => Ok(s.to_string()),
        _ => Err(junk("missing field", format!("missing or empty `{k}`"))),
    };
    let (amb, q, a) = (field("ambiguous_task")?, field("question")?, field("answer")?);
    if amb.to_lowercase() == task.trim().to_lowercase() {
        return Err(junk(
            "task unchanged",
            "`ambiguous_task` is the task unchanged: the step's detail must be left out",
        ));
    }
    Ok((amb, q, a))
}

// ---------------------------------------------------------------------------------------------------
// Prompts (text only).

const SYSTEM: &str = "You annotate recorded GUI-agent trajectories: a user's task and the actions taken on the \
    screen to do it. The annotations train an agent that asks the user a follow-up question when the task leaves out a \
    detail only the user knows. Answer with one JSON object in the requested format and nothing else.";

fn describe_steps(ep: &Episode) -> String {
    let mut s = String::new();
    for (i, st) in ep.steps.iter().enumerate() {
        s.push_str(&format!("{i}: {}", st.action.render()));
        if let (Some(id), Some(els)) = (st.action.target().and_then(|t| t.element.as_ref()), &st.elements) {
            if let Some(e) = els.iter().find(|e| &e.id == id) {
                s.push_str(&format!(" on <{} {:?}>", if e.role.is_empty() { "element" } else { &e.role }, e.text));
            }
        }
        if let Some(t) = st.instruction.as_deref().filter(|t| !t.trim().is_empty()) {
            s.push_str(&format!(" | instruction: {t:?}"));
        }
        s.push('\n');
    }
    s
}

fn header(ep: &Episode) -> String {
    let platform =
        serde_json::to_value(ep.platform).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default();
    let (w, h, task, steps) = (ep.screen.width, ep.screen.height, &ep.task, describe_steps(ep));
    format!(
        "Platform: {platform}, screen {w}x{h} pixels.\nTask: {task:?}\n\
         Steps (index: action JSON, then the instruction where known):\n{steps}"
    )
}

fn prompt_instructions(ep: &Episode, missing: &[usize]) -> String {
    let list: Vec<String> = missing.iter().map(|i| i.to_string()).collect();
    format!(
        "{}\nWrite a short low-level instruction, in the imperative, for each of the steps {}: what the step does \
         toward the task (\"Tap the search bar\", \"Type 'oat milk'\", \"Select the 5 pm slot\"). Coordinates alone do \
         not say what was clicked: infer the target from the task and the neighbouring steps where you can, otherwise \
         describe the action plainly.\n\
         Answer with JSON: {{\"instructions\": {{\"<step index>\": \"<instruction>\"}}}}",
        header(ep),
        list.join(", ")
    )
}

fn prompt_informative(ep: &Episode) -> String {
    format!(
        "{}\nWhich steps are informative? A step is informative when it carries a detail of the task that only the \
         user knows and the agent could not work out from the screen: a choice among comparable items (which product, \
         size, flavour, contact), a date or time, a recipient, an amount, a text to type. Navigation (opening an app, \
         going back, scrolling, tapping a search bar, confirming) is not informative.\n\
         Answer with JSON: {{\"informative\": [<step indices>]}} (an empty list when none is).",
        header(ep)
    )
}

fn prompt_ask(ep: &Episode, step: usize) -> String {
    let s = &ep.steps[step];
    format!(
        "{}\nStep {step} is informative: {}{}.\nRewrite the task with the detail that step {step} uses left out, so \
         that an agent would have to ask the user for it at that step; keep every other detail. Then write the \
         follow-up question the agent should ask at that step, and the user's short answer, which gives the left-out \
         detail.\nExample: task \"Order a large oat latte for pickup\", step \"Tap Oat milk\" -> \
         {{\"ambiguous_task\": \"Order a large latte for pickup\", \"question\": \"Which milk would you like in your \
         latte?\", \"answer\": \"Oat milk, please.\"}}\n\
         Answer with JSON: {{\"ambiguous_task\": \"...\", \"question\": \"...\", \"answer\": \"...\"}}",
        header(ep),
        s.action.render(),
        s.instruction.as_deref().map(|t| format!(" ({t:?})")).unwrap_or_default()
    )
}

// ---------------------------------------------------------------------------------------------------
// The endpoint.

enum Failure {
    /// Worth retrying: transport error, timeout, 429, 5xx.
    Transient(String),
    /// A 4xx other than 429.
    Rejected(u16, String),
    /// A 200 whose content cannot be used (answer, reason).
    Unusable(String, Junk),
    /// A 200 that is not a chat completion (body, reason).
    Malformed(String, String),
}

struct Client {
    agent: ureq::Agent,
    url: String,
    model: String,
    key: Option<String>,
    key_env: String,
    retries: u32,
    backoff: Duration,
}

impl Client {
    fn new(args: &AmbiguateArgs) -> Result<Self, AmbiguateError> {
        if !(args.timeout_s.is_finite() && args.timeout_s > 0.0) {
            return Err(AmbiguateError::BadTimeout(args.timeout_s));
        }
        let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs_f64(args.timeout_s)).build();
        let key = std::env::var(&args.api_key_env).ok().filter(|k| !k.trim().is_empty());
        Ok(Self {
            agent,
            url: format!("{}/chat/completions", args.base_url.trim_end_matches('/')),
            model: args.model.clone(),
            key,
            key_env: args.api_key_env.clone(),
            retries: args.retries,
            backoff: Duration::from_millis(args.backoff_ms),
        })
    }

    /// One request; the answer's text content.
    fn send(&self, messages: &[Value]) -> Result<String, Failure> {
        let body = json!({"model": self.model, "messages": messages, "temperature": 0});
        let mut req = self.agent.post(&self.url);
        if let Some(k) = &self.key {
            req = req.set("Authorization", &format!("Bearer {k}"));
        }
        let resp = match req.send_json(body) {
            Ok(r) => r,
            Err(ureq::Error::Status(code, r)) => {
                let body = snippet(&r.into_string().unwrap_or_default(), 500);
                return Err(if code == 429 || code >= 500 {
                    Failure::Transient(format!("HTTP {code}: {body}"))
                } else {
                    Failure::Rejected(code, body)
                });
            }
            Err(e) => return Err(Failure::Transient(e.to_string())),
        };
        let text = resp.into_string().map_err(|e| Failure::Transient(format!("reading the response: {e}")))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| Failure::Malformed(text.clone(), format!("the response is not JSON ({e})")))?;
        match v.pointer("/choices/0/message/content").and_then(Value::as_str) {
            Some(c) => Ok(c.to_string()),
            None => Err(Failure::Malformed(text, "the response has no `choices[0].message.content`".into())),
        }
    }

    /// Asks until `parse` accepts the answer, re-asking with the reason and backing off on HTTP errors.
    fn ask<T>(
        &self,
        episode: &str,
        stage: Stage,
        prompt: String,
        parse: impl Fn(&str) -> Result<T, Junk>,
    ) -> Result<T, AmbiguateError> {
        let mut messages =
            vec![json!({"role": "system", "content": SYSTEM}), json!({"role": "user", "content": prompt})];
        let attempts = self.retries + 1;
        let mut last = Failure::Transient("no attempt made".into());
        for attempt in 0..attempts {
            let failure = match self.send(&messages) {
                Ok(answer) => match parse(&answer) {
                    Ok(t) => return Ok(t),
                    Err(reason) => Failure::Unusable(answer, reason),
                },
                Err(f) => f,
            };
            match &failure {
                Failure::Rejected(status, body) => {
                    return Err(AmbiguateError::Rejected {
                        episode: episode.into(),
                        stage,
                        url: self.url.clone(),
                        model: self.model.clone(),
                        key_env: self.key_env.clone(),
                        status: *status,
                        body: body.clone(),
                    })
                }
                Failure::Unusable(answer, reason) => {
                    warn!("episode {episode}, {stage}: attempt {}: unusable answer ({reason})", attempt + 1);
                    // Show the model its answer and what is wrong with it; drop an earlier correction.
                    messages.truncate(2);
                    messages.push(json!({"role": "assistant", "content": answer}));
                    messages.push(json!({"role": "user", "content": format!(
                        "That answer cannot be used: {reason}. \
                         Answer again with only the JSON object in the requested format."
                    )}));
                }
                Failure::Malformed(_, reason) => warn!("episode {episode}, {stage}: attempt {}: {reason}", attempt + 1),
                Failure::Transient(e) => {
                    warn!("episode {episode}, {stage}: attempt {}: {e}", attempt + 1);
                    if attempt + 1 < attempts {
                        let wait = self.backoff.saturating_mul(1 << attempt.min(16)).min(Duration::from_secs(60));
                        std::thread::sleep(wait);
                    }
                }
            }
            last = failure;
        }
        Err(match last {
            Failure::Unusable(answer, reason) => AmbiguateError::BadAnswer {
                episode: episode.into(),
                stage,
                attempts,
                kind: reason.kind,
                reason: reason.detail,
                snippet: snippet(&answer, 300),
            },
            Failure::Malformed(body, reason) => AmbiguateError::NotChatCompletion {
                episode: episode.into(),
                stage,
                url: self.url.clone(),
                attempts,
                reason,
                snippet: snippet(&body, 300),
            },
            Failure::Transient(e) | Failure::Rejected(_, e) => {
                AmbiguateError::Unreachable { episode: episode.into(), stage, url: self.url.clone(), attempts, last: e }
            }
        })
    }
}

// ---------------------------------------------------------------------------------------------------
// The pipeline.

/// FNV-1a: a hash of the episode id that is the same on every machine and Rust version.
fn stable_hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// Runs the three stages on one episode; true when it was made ambiguous.
fn ambiguate_episode(client: &Client, ep: &mut Episode, seed: u64) -> Result<bool, AmbiguateError> {
    let id = ep.id.clone();
    let missing: Vec<usize> = (0..ep.steps.len())
        .filter(|&i| ep.steps[i].instruction.as_deref().is_none_or(|t| t.trim().is_empty()))
        .collect();
    if !missing.is_empty() {
        let got = client
            .ask(&id, Stage::Instructions, prompt_instructions(ep, &missing), |a| parse_instructions(a, &missing))?;
        for (i, t) in got {
            ep.steps[i].instruction = Some(t);
        }
    }
    let n = ep.steps.len();
    let marked = client.ask(&id, Stage::Informative, prompt_informative(ep), |a| parse_informative(a, n))?;
    let eligible =
        |a: &Action| !matches!(a, Action::Done { .. } | Action::Wait { .. } | Action::Ask(_) | Action::Answer { .. });
    let informative: Vec<usize> = marked.into_iter().filter(|&i| eligible(&ep.steps[i].action)).collect();
    for (i, s) in ep.steps.iter_mut().enumerate() {
        s.informative = Some(informative.contains(&i));
        s.ask = None;
    }
    ep.ambiguous_task = None;
    if informative.is_empty() {
        return Ok(false);
    }
    let mut rng = StdRng::seed_from_u64(seed ^ stable_hash(&id));
    let step = informative[rng.random_range(0..informative.len())];
    let task = ep.task.clone();
    let (amb, question, answer) = client.ask(&id, Stage::Ask, prompt_ask(ep, step), |a| parse_ask(a, &task))?;
    ep.ambiguous_task = Some(amb);
    ep.steps[step].ask = Some(StepAsk { question, answer, options: vec![], kind: None });
    Ok(true)
}

/// Ids of the episodes already in the output; a last line cut off by an interruption is removed.
fn existing_ids(path: &Path) -> Result<HashSet<String>, AmbiguateError> {
    let mut text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HashSet::new()),
        Err(e) => return Err(io_err(path)(e)),
    };
    if !text.is_empty() && !text.ends_with('\n') {
        let keep = text.rfind('\n').map_or(0, |i| i + 1);
        warn!("{}: dropping an incomplete last line (an interrupted run); that episode is redone", path.display());
        let f = OpenOptions::new().write(true).open(path).map_err(io_err(path))?;
        f.set_len(keep as u64).map_err(io_err(path))?;
        text.truncate(keep);
    }
    let mut ids = HashSet::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let bad = |reason: String| AmbiguateError::BadOutput { path: path.into(), line: i + 1, reason };
        let v: Value = serde_json::from_str(line).map_err(|e| bad(format!("bad JSON: {e}")))?;
        let id = v.get("id").and_then(Value::as_str).ok_or_else(|| bad("no string `id`".into()))?;
        ids.insert(id.to_string());
    }
    Ok(ids)
}

/// `to`'s path relative to the folder `from` (both absolute and canonical).
fn relative(to: &Path, from: &Path) -> PathBuf {
    let (t, f): (Vec<Component>, Vec<Component>) = (to.components().collect(), from.components().collect());
    let common = t.iter().zip(&f).take_while(|(a, b)| a == b).count();
    let mut out = PathBuf::new();
    for _ in common..f.len() {
        out.push("..");
    }
    for c in &t[common..] {
        out.push(c.as_os_str());
    }
    out
}

pub fn ambiguate(args: &AmbiguateArgs) -> Result<AmbiguateReport, AmbiguateError> {
    let client = Client::new(args)?;
    let episodes = load_episodes(&args.input)?;
    let out_dir = args.out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    fs::create_dir_all(out_dir).map_err(io_err(out_dir))?;
    let existing = existing_ids(&args.out)?;
    // Screenshot paths are relative to the episode file: re-root them when the output lives elsewhere.
    let in_dir = args.input.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let (in_abs, out_abs) =
        (fs::canonicalize(in_dir).map_err(io_err(in_dir))?, fs::canonicalize(out_dir).map_err(io_err(out_dir))?);
    let rebase = (in_abs != out_abs).then(|| relative(&in_abs, &out_abs));
    info!(
        "ambiguate: {} from {} -> {} ({} already there); model {:?} at {}",
        crate::plural(episodes.len(), "episode"),
        args.input.display(),
        args.out.display(),
        existing.len(),
        args.model,
        client.url
    );
    let mut report = AmbiguateReport::default();
    let todo: Vec<_> = episodes
        .into_iter()
        .filter(|e| {
            let seen = existing.contains(&e.episode.id);
            report.skipped_existing += usize::from(seen);
            !seen
        })
        .take(args.limit.unwrap_or(usize::MAX))
        .collect();
    let mut file = OpenOptions::new().create(true).append(true).open(&args.out).map_err(io_err(&args.out))?;
    let bar = indicatif::ProgressBar::new(todo.len() as u64);
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} episodes, {elapsed_precise} (eta {eta})")
    {
        bar.set_style(style);
    }
    for loaded in todo {
        let mut ep = loaded.episode;
        if let Some(prefix) = &rebase {
            for s in &mut ep.steps {
                if !Path::new(&s.screenshot).is_absolute() {
                    s.screenshot = prefix.join(&s.screenshot).to_string_lossy().into_owned();
                }
            }
        }
        let original = ep.clone();
        match ambiguate_episode(&client, &mut ep, args.seed) {
            Ok(true) => debug!("episode {}: ambiguous task {:?}", ep.id, ep.ambiguous_task),
            Ok(false) => {
                report.no_informative_step += 1;
                info!("episode {}: no informative step; written without an ambiguous task", ep.id);
            }
            Err(e) => {
                // Junk from the model is counted; an endpoint that cannot be used stops the run.
                let AmbiguateError::BadAnswer { stage, kind, .. } = &e else { return Err(e) };
                *report.rejected.entry(format!("{}: {kind}", stage.key())).or_default() += 1;
                warn!("{e}; the episode is written unchanged");
                ep = original;
            }
        }
        let mut line = serde_json::to_string(&ep).expect("episodes serialise");
        line.push('\n');
        file.write_all(line.as_bytes()).and_then(|_| file.flush()).map_err(io_err(&args.out))?;
        report.done += 1;
        bar.inc(1);
    }
    bar.finish_and_clear();
    if !report.rejected.is_empty() {
        let reasons: Vec<String> = report.rejected.iter().map(|(k, n)| format!("{k}: {n}")).collect();
        warn!(
            "ambiguate: {} written unchanged, the endpoint's answers unusable ({}); a more capable model \
             gives usable rewrites",
            crate::plural(report.rejected_total(), "episode"),
            reasons.join(", ")
        );
    }
    info!(
        "ambiguate: {} written ({} without an informative step), {} already done",
        report.done, report.no_informative_step, report.skipped_existing
    );
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_read_leniently() {
        let a =
            "Sure! Here you go:\n```json\n{\"informative\": [2, \"0\", 2]}\n```\nStep 2 picks the flavour {really}.";
        assert_eq!(parse_informative(a, 3).unwrap(), vec![0, 2]);
        assert_eq!(parse_informative("{\"informative\": [false, true, true]}", 3).unwrap(), vec![1, 2]);
        let e = parse_informative("{\"informative\": [5]}", 3).unwrap_err();
        assert!(e.kind == "no such step" && e.detail.contains("step 5 does not exist"), "{e:?}");
        let e = parse_informative("I think step 2.", 3).unwrap_err();
        assert!(e.kind == "no JSON object" && e.detail.contains("no JSON object"), "{e:?}");
        assert_eq!(parse_informative("{\"informative\": [1,}", 3).unwrap_err().kind, "invalid JSON");
        let got =
            parse_instructions("{\"note\": \"}\"} {\"instructions\": {\"1\": \"Tap Oat\", \"3\": \" Pay \"}}", &[1, 3])
                .unwrap();
        assert_eq!((got[&1].as_str(), got[&3].as_str()), ("Tap Oat", "Pay"));
        let list = "{\"instructions\": [{\"step\": 1, \"instruction\": \"Tap Oat\"}]}";
        let e = parse_instructions(list, &[1, 3]).unwrap_err();
        assert!(e.kind == "missing instruction" && e.detail.contains("step 3"), "{e:?}");
        let e = parse_ask("{\"ambiguous_task\": \"Buy milk\", \"question\": \"Which?\"}", "Buy oat milk").unwrap_err();
        assert!(e.kind == "missing field" && e.detail.contains("`answer`"), "{e:?}");
        let e = parse_ask("{\"ambiguous_task\": \"buy milk \", \"question\": \"Q\", \"answer\": \"A\"}", "Buy milk")
            .unwrap_err();
        assert!(e.kind == "task unchanged" && e.detail.contains("unchanged"), "{e:?}");
    }

    #[test]
    fn relative_paths_between_folders() {
        assert_eq!(relative(Path::new("/a/b/data"), Path::new("/a/b/out")), PathBuf::from("../data"));
        assert_eq!(relative(Path::new("/a/b/data"), Path::new("/a/b")), PathBuf::from("data"));
        assert_eq!(relative(Path::new("/a"), Path::new("/a/x/y")), PathBuf::from("../.."));
        assert_eq!(stable_hash("ep-1"), stable_hash("ep-1"));
        assert_ne!(stable_hash("ep-1"), stable_hash("ep-2"));
    }
}
