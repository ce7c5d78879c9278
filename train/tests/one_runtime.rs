//! One agent runtime: for the same steps (ambiguous tasks with ASK and SAY turns in the history, element
//! lists, one or two screenshots), askgui-eval's in-process agent, the trainer's periodic-eval agent and
//! askgui-serve build identical prompt ids and answer with identical actions; and the prompt of every
//! training sample is, token for token, the runtime's prompt for the same step.
//!
//! The models are the tiny random Qwen2.5-VL and Qwen3-VL fixtures, so their answers are noise; noise that
//! must be the same noise everywhere. Qwen3-VL runs in its native relative 0-1000 frame (nothing sets
//! another); `runtime/tests/constrained.rs` steers an answer to show its points come back in screen pixels. The steps are written here from the protocol (the task, then each earlier action,
//! with the annotated step asked and answered), not taken from any of the code under test.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use askgui_data::agent_api::StepOptions;
use askgui_data::synth::{synth, SynthArgs};
use askgui_data::{
    read_episodes, Action, ActionLanguage, FrameKind, LoadedEpisode, PromptConfig, PromptFlags, TaskMode, Turn,
};
use askgui_eval::agent::{Agent, Prediction, StepInput};
use askgui_eval::backends::inprocess::runtime_step;
use askgui_eval::backends::{EndpointAgent, EndpointConfig, InProcessAgent};
use askgui_model::{LoadOptions, Qwen2Vl};
use askgui_serve::backend::StepJob;
use askgui_serve::config::Config;
use askgui_serve::model_backend::{ModelBackend, ModelBackendConfig};
use askgui_train::agent_eval::lend;
use askgui_train::data::{load_dataset, DataOptions, PreparedSample};
use candle_core::{DType, Device};

/// The pixel bound the steps are shown at (small screens keep the test fast).
const MAX_PIXELS: usize = 12544;
const MAX_TOKENS: usize = 16;

/// A family's fixture and the frame it runs in when no flag or card names one.
#[derive(Clone, Copy)]
struct Family {
    fixture: &'static str,
    frame: FrameKind,
}

const FAMILIES: [Family; 2] = [
    Family { fixture: "tiny-qwen2_5_vl", frame: FrameKind::Resized },
    Family { fixture: "tiny-qwen3_vl", frame: FrameKind::Relative1000 },
];

fn fixture(f: Family) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures").join(f.fixture)
}

/// Two synthetic episodes, every task ambiguous (so each has an ASK/SAY step), with element lists.
fn episodes(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("askgui-train-one-runtime-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    synth(&SynthArgs {
        out: dir.clone(),
        episodes: 2,
        seed: 11,
        width: 224,
        height: 400,
        split: "1:0:0".into(),
        ambiguous_fraction: 1.0,
        slot_colors: false,
        grid: 0,
        icons: false,
    })
    .expect("synth");
    dir.join("train.jsonl")
}

fn loaded(path: &Path) -> Vec<LoadedEpisode> {
    let base = path.parent().unwrap().to_path_buf();
    let lines = read_episodes(path).unwrap();
    lines.into_iter().map(|(line, e)| LoadedEpisode { episode: e.unwrap(), base: base.clone(), line }).collect()
}

/// Every step an agent is asked in an episode, in the order training builds its samples: each step
/// with the ambiguous task and the earlier actions; the annotated step once as it is (the agent should
/// ask) and once more after its question and the user's answer.
fn steps(ep: &LoadedEpisode) -> Vec<StepInput> {
    let e = &ep.episode;
    let task = e.ambiguous_task.clone().expect("an ambiguous task");
    let mut history = Vec::new();
    let mut out = Vec::new();
    for (i, s) in e.steps.iter().enumerate() {
        let input = |history: &Vec<Turn>| StepInput {
            episode_id: e.id.clone(),
            step: i,
            task: task.clone(),
            history: history.clone(),
            screenshots: (0..=i).map(|j| ep.image_path(j)).collect(),
            elements: s.elements.clone(),
            screen: e.screen,
            platform: e.platform,
        };
        out.push(input(&history));
        if let Some(ask) = &s.ask {
            history.push(Turn::Agent { action: ask.action() });
            history.push(Turn::Say { text: ask.answer.clone() });
            out.push(input(&history));
        }
        history.push(Turn::Agent { action: s.action.clone() });
    }
    out
}

fn options() -> StepOptions {
    StepOptions { max_tokens: Some(MAX_TOKENS), ..StepOptions::default() }
}

/// The prompt the trainer builds: its data options resolve the family's frame as `--frame` unset does.
fn prompt(f: Family, history_images: usize) -> PromptConfig {
    PromptConfig { max_pixels: MAX_PIXELS, history_images, elements: true, frame: f.frame, ..PromptConfig::default() }
}

/// askgui-eval's agent, loaded from the command line's flags (no `--frame`).
fn eval_agent(f: Family, history_images: usize) -> InProcessAgent {
    let flags = PromptFlags {
        max_pixels: Some(MAX_PIXELS),
        history_images: Some(history_images),
        elements: Some(true),
        ..PromptFlags::default()
    };
    let load = LoadOptions::default();
    InProcessAgent::load(&fixture(f).display().to_string(), None, &flags, options(), load).unwrap()
}

/// The agent the trainer lends its model to, with the model's processor set as the trainer sets it.
fn trainer_agent(f: Family, history_images: usize) -> InProcessAgent {
    let mut model = Qwen2Vl::load(&fixture(f).display().to_string(), &Device::Cpu, DType::F32).unwrap();
    model.image_config.max_pixels = MAX_PIXELS;
    let token_side = model.image_config.geometry.factor();
    lend(model, &PromptConfig { token_side, ..prompt(f, history_images) }, MAX_TOKENS).unwrap()
}

/// The training samples of `path` with `prompt` (and the model's processor's bounds, as the trainer sets
/// them).
fn samples(f: Family, path: &Path, prompt: PromptConfig) -> Vec<PreparedSample> {
    let mut model = Qwen2Vl::load(&fixture(f).display().to_string(), &Device::Cpu, DType::F32).unwrap();
    model.image_config.max_pixels = MAX_PIXELS;
    let (min_pixels, token_side) = (model.image_config.min_pixels, model.image_config.geometry.factor());
    let opts = DataOptions {
        prompt: PromptConfig { min_pixels, token_side, ..prompt },
        task_mode: TaskMode::Ambiguous,
        extra_task_modes: vec![],
        history_length: 0,
        max_seq_len: 1 << 20,
        skip_bad_records: false,
        ask_repeat: 1,
        say_repeat: 1,
        dialog_repeat: 1,
        region_words: false,
    };
    load_dataset(path, &opts, &model.tokenizer().unwrap(), &model.image_config).unwrap().samples
}

/// Where a sample's supervised tokens start.
fn prompt_end(s: &PreparedSample) -> usize {
    s.labels_mask.iter().position(|&m| m).unwrap()
}

/// The prompt ids of the training samples of `path`, up to each sample's first supervised token.
fn training_prompts(f: Family, path: &Path, history_images: usize) -> Vec<Vec<u32>> {
    samples(f, path, prompt(f, history_images)).iter().map(|s| s.ids[..prompt_end(s)].to_vec()).collect()
}

fn ids(agent: &InProcessAgent, input: &StepInput) -> Vec<u32> {
    let shots = agent.screenshots(input).unwrap();
    agent.runtime().prompt(&runtime_step(input, &shots)).unwrap().ids
}

fn predict(agent: &dyn Agent, input: &StepInput) -> Prediction {
    agent.predict(input).unwrap_or_else(|e| panic!("{} step {}: {e}", input.episode_id, input.step))
}

#[test]
fn eval_the_trainer_and_training_data_ask_the_same_and_eval_and_the_trainer_answer_the_same() {
    for f in FAMILIES {
        eprintln!("{}:", f.fixture);
        eval_trainer_and_data_agree(f);
    }
}

fn eval_trainer_and_data_agree(f: Family) {
    let path = episodes(&format!("two-screenshots-{}", f.fixture));
    let inputs: Vec<StepInput> = loaded(&path).iter().flat_map(steps).collect();
    assert!(inputs.iter().any(|i| i.history.iter().any(|t| matches!(t, Turn::Say { .. }))), "no SAY turn");
    // Two screenshots from the second step on.
    let (eval, trainer) = (eval_agent(f, 1), trainer_agent(f, 1));
    assert_eq!(eval.runtime().prompt_config().frame, f.frame, "eval's frame when none is given");
    let samples = training_prompts(f, &path, 1);
    assert_eq!(samples.len(), inputs.len(), "one training sample per step asked");
    for (input, sample) in inputs.iter().zip(&samples) {
        let what = format!("{} step {} ({} history turns)", input.episode_id, input.step, input.history.len());
        let e = ids(&eval, input);
        let pads = e.iter().filter(|&&t| t == eval.runtime().tokenizer().image_pad_id).count();
        assert!(pads > 0, "{what}: no image in the prompt");
        assert_eq!(e, ids(&trainer, input), "{what}: eval and the trainer's eval differ");
        assert_eq!(&e, sample, "{what}: the training sample's prompt differs from the runtime's");
        let (e, t) = (predict(&eval, input), predict(&trainer, input));
        assert!(e.same_answer(&t), "{what}: {e:?} vs {t:?}");
    }
}

/// askgui-serve's backend as `askgui-serve --model FIXTURE --max-pixels 12544 --history-images 1` loads it.
fn server_config(f: Family) -> Config {
    let mut cfg = Config::for_model(fixture(f).display().to_string());
    cfg.port = 0;
    cfg.max_pixels = Some(MAX_PIXELS);
    cfg.history_images = Some(1);
    cfg
}

#[test]
fn the_server_asks_and_answers_as_eval_and_the_trainer_do() {
    for f in FAMILIES {
        eprintln!("{}:", f.fixture);
        server_agrees(f);
    }
}

fn server_agrees(f: Family) {
    let path = episodes(&format!("server-{}", f.fixture));
    let inputs: Vec<StepInput> = loaded(&path).iter().flat_map(steps).collect();
    // Two screenshots from the second step on: the request carries the earlier ones.
    let (eval, trainer) = (eval_agent(f, 1), trainer_agent(f, 1));
    let samples = training_prompts(f, &path, 1);
    let cfg = server_config(f);
    let backend = ModelBackend::load(&ModelBackendConfig::from(&cfg)).unwrap();
    let mb = ModelBackendConfig::from(&cfg);
    let factory = Box::new(move || {
        let b: Box<dyn askgui_serve::backend::Backend> = Box::new(ModelBackend::load(&mb)?);
        Ok(b)
    });
    let server = askgui_serve::start(cfg.clone(), factory).expect("the server starts");
    let t0 = Instant::now();
    while ureq::get(&server.url("/health")).call().is_err() {
        assert!(t0.elapsed() < Duration::from_secs(120), "the model did not load");
        std::thread::sleep(Duration::from_millis(100));
    }
    let client = EndpointAgent::new(EndpointConfig {
        base: server.url("").trim_end_matches('/').to_string(),
        adapter: None,
        timeout_s: 60.0,
        retries: 0,
        backoff_ms: 10,
        options: options(),
        elements: true,
        history_images: None,
    })
    .unwrap();
    for (input, sample) in inputs.iter().zip(&samples) {
        let what = format!("{} step {} ({} history turns)", input.episode_id, input.step, input.history.len());
        // The request eval sends, decoded as the server's route decodes it.
        let request = client.request(input).unwrap();
        let decode = |bytes: Vec<u8>| askgui_serve::images::decode(&bytes, cfg.max_image_pixels, "screenshot").unwrap();
        let mut shots: Vec<_> =
            request.observation.earlier_screenshot_bytes(1).unwrap().into_iter().map(decode).collect();
        shots.push(decode(request.observation.screenshot_bytes().unwrap().expect("a screenshot")));
        assert_eq!(shots.len(), input.step.min(1) + 1, "{what}: the screenshots the request carries");
        let job = StepJob { request, screenshots: shots };
        let served = backend.runtime().prompt(&askgui_serve::model_backend::runtime_step(&job)).unwrap().ids;
        assert_eq!(served, ids(&eval, input), "{what}: the server and eval differ");
        assert_eq!(served, ids(&trainer, input), "{what}: the server and the trainer's eval differ");
        assert_eq!(&served, sample, "{what}: the server and the training sample differ");
        // The same answers; the server's prefix cache may move ask_probability in its last bits.
        let (answer, e, t) = (predict(&client, input), predict(&eval, input), predict(&trainer, input));
        assert!(answer.same_answer(&e), "{what}: the server and eval answer differently: {answer:?} vs {e:?}");
        assert!(answer.same_answer(&t), "{what}: the server and the trainer's eval differ: {answer:?} vs {t:?}");
    }
    server.stop();
}

/// The prompt settings askgui-train resolves for `--action-language L --max-pixels 12544`: the
/// language's own frame, and no element list (these languages point at pixels only).
fn language_prompt(language: ActionLanguage) -> PromptConfig {
    let frame = language.native_frame().expect("a frame of its own");
    PromptConfig { action_language: language, frame, elements: false, ..prompt(FAMILIES[0], 0) }
}

#[test]
fn in_the_agents_own_languages_training_eval_the_trainer_and_the_server_ask_the_same() {
    let path = episodes("languages");
    // The first episode's steps (its samples come first in the training data).
    let inputs: Vec<StepInput> = loaded(&path).iter().take(1).flat_map(steps).collect();
    assert!(inputs.iter().any(|i| i.history.iter().any(|t| matches!(t, Turn::Say { .. }))), "no SAY turn");
    assert!(inputs.len() >= 3, "a few steps with earlier actions");
    for language in [ActionLanguage::UiTars, ActionLanguage::ToolCall] {
        eprintln!("{language:?}:");
        language_agrees(language, &path, &inputs);
    }
}

/// The server's backend as `askgui-serve --action-language L` loads it (no element list unless told to),
/// and an askgui-serve client that sends each step's element list.
fn language_server(language: ActionLanguage) -> (Config, ModelBackend, EndpointAgent) {
    let mut cfg = server_config(FAMILIES[0]);
    cfg.action_language = Some(language);
    cfg.history_images = Some(0);
    let backend = ModelBackend::load(&ModelBackendConfig::from(&cfg)).unwrap();
    let endpoint = EndpointConfig {
        base: "http://127.0.0.1:9".into(),
        adapter: None,
        timeout_s: 60.0,
        retries: 0,
        backoff_ms: 10,
        options: options(),
        elements: true,
        history_images: Some(0),
    };
    (cfg, backend, EndpointAgent::new(endpoint).unwrap())
}

fn language_agrees(language: ActionLanguage, path: &Path, inputs: &[StepInput]) {
    let f = FAMILIES[0];
    // askgui-eval with the card's language and no --frame: the language's frame applies.
    let flags = PromptFlags {
        max_pixels: Some(MAX_PIXELS),
        history_images: Some(0),
        elements: Some(false),
        action_language: Some(language),
        ..PromptFlags::default()
    };
    let eval =
        InProcessAgent::load(&fixture(f).display().to_string(), None, &flags, options(), Default::default()).unwrap();
    assert_eq!(Some(eval.runtime().prompt_config().frame), language.native_frame());
    let mut model = Qwen2Vl::load(&fixture(f).display().to_string(), &Device::Cpu, DType::F32).unwrap();
    model.image_config.max_pixels = MAX_PIXELS;
    let token_side = model.image_config.geometry.factor();
    let trainer = lend(model, &PromptConfig { token_side, ..language_prompt(language) }, MAX_TOKENS).unwrap();
    let samples = samples(f, path, language_prompt(language));
    let (cfg, mut backend, client) = language_server(language);
    let text = |ids: &[u32]| eval.runtime().tokenizer().decode(ids, false).unwrap();
    let lead = language.answer_prefix();
    for (input, sample) in inputs.iter().zip(&samples) {
        let what =
            format!("{language:?} {} step {} ({} history turns)", input.episode_id, input.step, input.history.len());
        let e = ids(&eval, input);
        assert_eq!(e, ids(&trainer, input), "{what}: eval and the trainer's eval differ");
        let cut = prompt_end(sample);
        assert_eq!(e, sample.ids[..cut], "{what}: the training sample's prompt differs from the runtime's");
        let request = client.request(input).unwrap();
        let bytes = request.observation.screenshot_bytes().unwrap().expect("a screenshot");
        let shot = askgui_serve::images::decode(&bytes, cfg.max_image_pixels, "screenshot").unwrap();
        let job = StepJob::new(request, Some(shot));
        let served = backend.runtime().prompt(&askgui_serve::model_backend::runtime_step(&job)).unwrap().ids;
        assert_eq!(served, e, "{what}: the server and eval differ");
        // The prompt is the language's: its ASK in the action space, earlier actions written in it.
        let prompt = text(&e);
        assert!(
            prompt.contains(language.ask_name()) && !prompt.contains(ActionLanguage::AskguiJson.answer_prefix()),
            "{what}: {prompt}"
        );
        let acted =
            input.history.iter().any(|t| matches!(t, Turn::Agent { action } if !matches!(action, Action::Ask(_))));
        assert_eq!(prompt.contains(&format!("History:\n1. {lead}")), acted, "{what}: {prompt}");
        // The target is the language's text, which its parser reads.
        let target = text(&sample.ids[cut..]);
        let target = target.split(askgui_data::prompt::IM_END).next().unwrap();
        assert!(target.starts_with(lead), "{what}: {target}");
        language.parse(target).unwrap_or_else(|e| panic!("{what}: {target}: {e}"));
        let (a, t) = (predict(&eval, input), predict(&trainer, input));
        assert!(a.same_answer(&t), "{what}: {a:?} vs {t:?}");
        // The server answers the same text, and the same action in screen pixels.
        let s = backend.step(&job, &|| false).unwrap_or_else(|e| panic!("{what}: the server: {e}"));
        assert_eq!(
            (s.raw.as_str(), Some(&s.action)),
            (a.raw.as_str(), a.action.as_ref()),
            "{what}: the server answers otherwise"
        );
        assert!(a.raw.starts_with(lead), "{what}: the answer is the language's text: {}", a.raw);
        assert!(a.parse_error.is_none(), "{what}: the constrained answer parses: {a:?}");
    }
}
