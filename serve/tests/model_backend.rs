//! The model backend on the tiny random Qwen2.5-VL checkpoint of the model tests: the action-name
//! distribution (and so `ask_probability`) against the model's plain full-sequence forward, constrained
//! answers that always parse, `pause_threshold`, adapters (several in one batch), chat streaming,
//! continuous batching (packed jobs answer what they answer alone) and the prefix cache.

use std::path::PathBuf;
use std::sync::Arc;

use askgui_data::action::Action;
use askgui_data::action::Turn;
use askgui_data::action::ACTION_NAMES;
use askgui_data::agent_api::AgentStepResponse;
use askgui_data::agent_api::{AgentStepRequest, StepOptions};
use askgui_model::{preprocess, LoraConfig, Qwen2Vl};
use askgui_serve::backend::{
    Backend, BackendError, ChatJob, ChatMessage, ChatPart, ChatRole, FinishReason, ImageInput, Intake, Job, JobKind,
    JobOutput, StepJob,
};
use askgui_serve::model_backend::ModelBackend;
use candle_core::{DType, Device};

fn checkpoint() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/tiny-qwen2_5_vl")
}

fn screenshot(w: u32, h: u32) -> ImageInput {
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x * 7 % 256) as u8, (y * 3 % 256) as u8, 90]));
    ImageInput { image: Arc::new(img), hash: (w as u64) << 32 | h as u64 }
}

fn step_job(task: &str, options: StepOptions) -> StepJob {
    let mut request = AgentStepRequest::new(task, "unused: decoded below");
    request.options = options;
    StepJob::new(request, Some(screenshot(200, 150)))
}

fn backend(with_adapter: bool) -> anyhow::Result<ModelBackend> {
    let mut model = Qwen2Vl::load(checkpoint().to_str().unwrap(), &Device::Cpu, DType::F32)?;
    if with_adapter {
        model.add_trainable_adapter("probe", LoraConfig::new(4, 8.0, &["q_proj", "v_proj", "down_proj"]), 3)?;
        for (name, v) in model.trainable_vars("probe")? {
            if name.ends_with("lora_B") {
                v.set(&(v.ones_like()? * 0.3)?)?;
            }
        }
    }
    ModelBackend::from_model(model, "tiny")
}

const NEVER: &dyn Fn() -> bool = &|| false;

/// `ask_probability` is the model's probability of `ask"` among the 15 names after the forced
/// `{"action":"`; recomputed here from one full forward per name (no KV cache), normalised over names.
/// Tolerance 1e-4: the same f32 model through two code paths.
#[test]
fn ask_probability_is_the_models_distribution_over_action_names() -> anyhow::Result<()> {
    let mut b = backend(false)?;
    let job = step_job("Open the settings and turn on dark mode", StepOptions::default());
    let r = b.step(&job, NEVER)?;
    let p = r.ask_probability.expect("ask_probability");

    // The same prompt through the model's plain forward.
    let model = Qwen2Vl::load(checkpoint().to_str().unwrap(), &Device::Cpu, DType::F32)?;
    let tok = model.tokenizer()?;
    let img = preprocess(&job.screenshot().unwrap().image, &model.image_config)?;
    let frame_model = (img.resized.0 as u32, img.resized.1 as u32);
    assert_eq!((r.frame.model.width, r.frame.model.height), frame_model, "frame is the processed image");
    let mut frame = askgui_data::prompt::PromptConfig::default().frame_map(200, 150)?;
    frame.model = frame_model;
    let ctx = askgui_data::prompt::StepContext {
        task: &job.request.task,
        history: &[],
        screenshots: vec![PathBuf::from("s")],
        elements: None,
        frame,
        system: askgui_data::prompt::SystemPrompt::Full,
        language: askgui_data::ActionLanguage::AskguiJson,
    };
    let text = askgui_data::prompt::render_chatml(&askgui_data::prompt::step_messages(&ctx)?, true).text;
    let mut ids = tok.encode_prompt(&text, &[img.num_tokens(model.image_config.geometry.merge_size)])?;
    // Each name in the tokenisation training gives the answer's text `{"action":"<name>`, scored from
    // where the names' tokens part from the prefix's.
    let prefix = tok.encode("{\"action\":\"")?;
    let answers: Vec<Vec<u32>> =
        ACTION_NAMES.iter().map(|n| tok.encode(&format!("{{\"action\":\"{n}"))).collect::<Result<_, _>>()?;
    let common = |a: &Vec<u32>| prefix.iter().zip(a).take_while(|(x, y)| x == y).count();
    let from = answers.iter().map(common).min().unwrap();
    ids.extend(&prefix[..from]);
    let pv = img.pixel_tensor(&Device::Cpu)?;
    let mut logp = vec![];
    for answer in &answers {
        let cont = &answer[from..];
        let full: Vec<u32> = ids.iter().chain(cont).copied().collect();
        let logits = model.forward_prompt(&full, Some(&pv), &[img.grid_thw])?; // (T, V)
        let mut l = 0f64;
        for (k, &t) in cont.iter().enumerate() {
            let row: Vec<f64> = logits.get(ids.len() + k - 1)?.to_dtype(DType::F64)?.to_vec1()?;
            let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            l += row[t as usize] - m - row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        }
        logp.push(l);
    }
    let m = logp.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = logp.iter().map(|l| (l - m).exp()).sum();
    let want = (logp[ACTION_NAMES.iter().position(|&n| n == "ask").unwrap()] - m).exp() / z;
    eprintln!("ask_probability {p:.6} vs full forward {want:.6}; answer {}", r.raw);
    assert!((p - want).abs() <= 1e-4, "ask_probability {p} vs {want}");
    Ok(())
}

/// A random model writes garbage; constrained decoding still answers an action that parses, at any
/// temperature and seed, for every kind of action.
#[test]
fn constrained_answers_always_parse() -> anyhow::Result<()> {
    let mut b = backend(false)?;
    let mut kinds = std::collections::BTreeSet::new();
    for seed in 0..12u64 {
        // Hot enough that the random model's peaked name distribution (ask ~0.98) reaches other names.
        let opts = StepOptions { temperature: Some(3.0), seed: Some(seed), max_tokens: Some(40), ..Default::default() };
        let r = b.step(&step_job("Find the cheapest flight", opts), NEVER)?;
        askgui_data::parse::parse_answer(&r.raw)?;
        r.action.check().map_err(anyhow::Error::msg)?;
        // Coordinates are constrained to the model frame, so they land on the 200x150 screen.
        if let Some((x, y)) = r.action.target().and_then(|t| t.xy()) {
            assert!((0..=200).contains(&x) && (0..=150).contains(&y), "({x}, {y}) off the screen: {}", r.raw);
        }
        kinds.insert(r.action.name());
        // The template's keys are always written (one token per character with this byte-level
        // tokenizer: up to about 50); the free digits and string contents stop at max_tokens.
        assert!(r.usage.completion_tokens <= 40 + 50, "{} completion tokens: {}", r.usage.completion_tokens, r.raw);
    }
    eprintln!("action kinds seen: {kinds:?}");
    assert!(kinds.len() >= 3, "sampling should reach several action kinds, saw {kinds:?}");
    Ok(())
}

/// Even a budget of one token gives a parsing answer: the template's keys and one token of each value
/// are always written.
#[test]
fn tiny_budgets_still_parse() -> anyhow::Result<()> {
    let mut b = backend(false)?;
    for (max_tokens, pause) in [(1, Some(0.0)), (2, Some(0.0)), (1, Some(1.0)), (3, None)] {
        let opts = StepOptions { max_tokens: Some(max_tokens), pause_threshold: pause, ..Default::default() };
        let r = b.step(&step_job("Buy milk", opts), NEVER)?;
        askgui_data::parse::parse_answer(&r.raw)?;
        r.action.check().map_err(anyhow::Error::msg)?;
    }
    Ok(())
}

#[test]
fn pause_threshold_decides_the_ask() -> anyhow::Result<()> {
    let mut b = backend(false)?;
    let always = StepOptions { pause_threshold: Some(0.0), ..Default::default() };
    let r = b.step(&step_job("Buy milk", always), NEVER)?;
    assert_eq!(r.action.name(), "ask", "{}", r.raw);
    let never = StepOptions { pause_threshold: Some(1.0), ..Default::default() };
    let r = b.step(&step_job("Buy milk", never), NEVER)?;
    assert!(r.ask_probability.unwrap() < 1.0);
    assert_ne!(r.action.name(), "ask", "{}", r.raw);
    Ok(())
}

/// An adapter changes the answer distribution; the base model is back when no adapter is asked for.
#[test]
fn adapters_are_chosen_per_job() -> anyhow::Result<()> {
    let mut b = backend(true)?;
    assert_eq!(askgui_serve::backend::Backend::info(&b).adapters, ["probe"]);
    let mut run = |adapter: Option<&str>| -> anyhow::Result<_> {
        let (job, rx) =
            Job::new(JobKind::Step(step_job("Call mum", StepOptions::default())), adapter.map(String::from));
        askgui_serve::backend::Backend::run(&mut b, vec![job]);
        match rx.blocking_recv()?? {
            askgui_serve::backend::JobOutput::Step(r) => Ok(r),
            other => panic!("not a step answer: {other:?}"),
        }
    };
    let base = run(None)?;
    let adapted = run(Some("probe"))?;
    eprintln!("ask_probability base {:?}, adapter {:?}", base.ask_probability, adapted.ask_probability);
    assert_ne!(base.ask_probability, adapted.ask_probability);
    let again = run(None)?;
    match run(Some("nope")) {
        Err(e) => assert!(e.to_string().contains("unknown adapter `nope`; this server has: probe"), "{e}"),
        Ok(r) => panic!("an unknown adapter answered {r:?}"),
    }
    // The second base job reuses the first one's prompt from the prefix cache, so it runs a different
    // (shorter) prefill: equal up to float reassociation.
    let (a, b) = (base.ask_probability.unwrap(), again.ask_probability.unwrap());
    assert!((a - b).abs() <= 1e-6, "the base model after an adapter job: {a} vs {b}");
    Ok(())
}

/// A backend with two adapters, each with B non-zero: `text` on decoder linears, `vision` on the vision
/// tower's attention alone (`qkv`, `proj`), so that only vision-tower LoRA can move its answers.
fn backend_two_adapters() -> anyhow::Result<ModelBackend> {
    let mut model = Qwen2Vl::load(checkpoint().to_str().unwrap(), &Device::Cpu, DType::F32)?;
    model.add_trainable_adapter("text", LoraConfig::new(4, 8.0, &["q_proj", "v_proj", "down_proj"]), 3)?;
    model.add_trainable_adapter("vision", LoraConfig::new(4, 8.0, &["qkv", "proj"]), 5)?;
    for (adapter, b) in [("text", 0.3), ("vision", 1.0)] {
        for (name, v) in model.trainable_vars(adapter)? {
            if name.ends_with("lora_B") {
                v.set(&(v.ones_like()? * b)?)?;
            }
        }
    }
    Ok(ModelBackend::from_model(model, "tiny")?.with_prefix_cache(0))
}

/// Several adapters in one batch: four jobs on the same screenshot (two of the vision adapter, one of
/// the text adapter, one of the base model) started together share their forwards, and each answers what
/// it answers alone. The screenshot is encoded once per adapter (its features are cached by hash and
/// adapter), and the vision adapter really changes the answer: vision-tower LoRA works in a mixed batch. Tolerance 1e-5 on `ask_probability`, as
/// for packing: a mixed batch changes GEMM row counts only (`askgui-model`'s `tests/multi_adapter.rs`
/// bounds the logits).
#[test]
fn jobs_of_different_adapters_share_forwards_and_answer_as_alone() -> anyhow::Result<()> {
    let adapters = [Some("vision"), Some("text"), None, Some("vision")];
    let jobs = || {
        adapters
            .iter()
            .enumerate()
            .map(|(i, a)| {
                let opts = StepOptions { max_tokens: Some(16), seed: Some(i as u64), ..Default::default() };
                Job::new(JobKind::Step(step_job("Call mum", opts)), a.map(String::from))
            })
            .collect::<Vec<_>>()
    };
    let mut alone = Vec::new();
    for (job, rx) in jobs() {
        Backend::run(&mut backend_two_adapters()?, vec![job]);
        alone.push(step_of(rx.blocking_recv()?));
    }
    let probs: Vec<f64> = alone.iter().map(|r| r.ask_probability.unwrap()).collect();
    eprintln!("ask_probability alone: {probs:?}");
    // Ten times the tolerance below at least (seen: 2e-3).
    assert!((probs[0] - probs[2]).abs() > 1e-4, "vision-tower LoRA must change the answer: {probs:?}");
    let mut b = backend_two_adapters()?;
    let (first, rxs): (Vec<Job>, Vec<_>) = jobs().into_iter().unzip();
    let mut intake = Recorder { later: vec![], batches: vec![], vision: vec![] };
    b.run_continuous(first, &mut intake);
    for (i, rx) in rxs.into_iter().enumerate() {
        let r = step_of(rx.blocking_recv()?);
        let (p, q) = (r.ask_probability.unwrap(), probs[i]);
        assert!((p - q).abs() <= 1e-5, "job {i} ({:?}): ask_probability {p} together vs {q} alone", adapters[i]);
        assert_eq!(r.raw, alone[i].raw, "job {i}: the same answer");
    }
    eprintln!("sequences per forward: {:?}; images per vision forward: {:?}", intake.batches, intake.vision);
    assert!(intake.batches.contains(&4), "the four jobs should share forwards: {:?}", intake.batches);
    assert_eq!(intake.vision.iter().sum::<usize>(), 3, "once per adapter: {:?}", intake.vision);
    Ok(())
}

/// Records what the backend took and packed, and hands it more jobs while it runs.
struct Recorder {
    later: Vec<Job>,
    batches: Vec<usize>,
    vision: Vec<usize>,
}

impl Intake for Recorder {
    fn take(&mut self, max: usize) -> Vec<Job> {
        let n = self.later.len().min(max);
        self.later.drain(..n).collect()
    }
    fn record_batch(&mut self, sequences: usize) {
        self.batches.push(sequences);
    }
    fn record_vision_batch(&mut self, images: usize) {
        self.vision.push(images);
    }
    fn max_batch(&self) -> usize {
        16
    }
}

fn step_of(out: Result<JobOutput, BackendError>) -> AgentStepResponse {
    match out {
        Ok(JobOutput::Step(r)) => *r,
        other => panic!("not a step answer: {other:?}"),
    }
}

/// Continuous batching: eight jobs (two tasks, base and adapter, two temperatures) started together and
/// four more handed in while they run answer exactly what each answers alone, and the forwards really
/// pack several sequences. Tolerance 1e-5 on `ask_probability`: packing changes GEMM row counts only.
#[test]
fn packed_jobs_answer_what_they_answer_alone() -> anyhow::Result<()> {
    let mut b = backend(true)?.with_prefix_cache(0);
    let kinds: Vec<(String, Option<String>, StepOptions)> = (0..12)
        .map(|i| {
            let task = if i % 2 == 0 { "Call mum" } else { "Find the cheapest flight to Oslo" };
            let adapter = (i % 3 == 0).then(|| "probe".to_string());
            let opts = StepOptions {
                temperature: Some([0.0, 1.0][i % 2]),
                seed: Some(i as u64),
                max_tokens: Some(24),
                ..Default::default()
            };
            (task.to_string(), adapter, opts)
        })
        .collect();
    let jobs =
        || kinds.iter().map(|(t, a, o)| Job::new(JobKind::Step(step_job(t, o.clone())), a.clone())).collect::<Vec<_>>();
    let mut alone = Vec::new();
    for (job, rx) in jobs() {
        Backend::run(&mut b, vec![job]);
        alone.push(step_of(rx.blocking_recv()?));
    }
    let (mut first, rxs): (Vec<Job>, Vec<_>) = jobs().into_iter().unzip();
    let later = first.split_off(8);
    let mut intake = Recorder { later, batches: vec![], vision: vec![] };
    b.run_continuous(first, &mut intake);
    for (i, rx) in rxs.into_iter().enumerate() {
        let r = step_of(rx.blocking_recv()?);
        let (p, q) = (r.ask_probability.unwrap(), alone[i].ask_probability.unwrap());
        assert!((p - q).abs() <= 1e-5, "job {i}: ask_probability {p} packed vs {q} alone");
        assert_eq!(r.raw, alone[i].raw, "job {i}: the same answer");
    }
    let most = intake.batches.iter().max().copied().unwrap_or(0);
    eprintln!("{} forwards, most sequences in one: {most}", intake.batches.len());
    assert!(most >= 8, "forwards should pack the live jobs together: {:?}", intake.batches);
    Ok(())
}

/// Six step jobs, each with a screenshot of its own: `started` of them start together and the rest are
/// handed in while those run (their screenshots encoded beside the running forwards, their prompts run
/// whole or, with `chunk`, in chunks of that many tokens). Each answers what it answers alone (tolerance 1e-5 on `ask_probability`:
/// batching changes GEMM row counts only) and each screenshot is encoded exactly once.
fn screenshot_jobs_answer_as_alone(started: usize, max_tokens: usize, chunk: usize) -> anyhow::Result<()> {
    let sizes = [(200, 150), (160, 120), (240, 180), (120, 200), (280, 140), (200, 200)];
    let jobs = || {
        sizes
            .iter()
            .map(|&(w, h)| {
                let opts = StepOptions { max_tokens: Some(max_tokens), ..Default::default() };
                let job = StepJob { screenshots: vec![screenshot(w, h)], ..step_job("Call mum", opts) };
                Job::new(JobKind::Step(job), None)
            })
            .collect::<Vec<_>>()
    };
    let mut alone = Vec::new();
    for (job, rx) in jobs() {
        let mut b = backend(false)?.with_prefix_cache(0);
        Backend::run(&mut b, vec![job]);
        alone.push(step_of(rx.blocking_recv()?));
    }
    let mut b = backend(false)?.with_prefix_cache(0).with_prefill_chunk(chunk);
    let (mut first, rxs): (Vec<Job>, Vec<_>) = jobs().into_iter().unzip();
    let later = first.split_off(started);
    let mut intake = Recorder { later, batches: vec![], vision: vec![] };
    b.run_continuous(first, &mut intake);
    for (i, rx) in rxs.into_iter().enumerate() {
        let r = step_of(rx.blocking_recv()?);
        let (p, q) = (r.ask_probability.unwrap(), alone[i].ask_probability.unwrap());
        assert!((p - q).abs() <= 1e-5, "job {i}: ask_probability {p} batched vs {q} alone");
        assert_eq!(r.raw, alone[i].raw, "job {i}: the same answer");
    }
    // How many screenshots share a vision forward depends on when the job threads hand in their first
    // request (the owner waits a moment for them); each screenshot is encoded exactly once either way.
    eprintln!("screenshots per vision forward: {:?}", intake.vision);
    assert_eq!(intake.vision.iter().sum::<usize>(), 6, "each screenshot encoded once: {:?}", intake.vision);
    Ok(())
}

/// Batched vision: six jobs started together share vision forwards and answer what each answers alone.
#[test]
fn screenshots_of_jobs_started_together_are_encoded_together() -> anyhow::Result<()> {
    screenshot_jobs_answer_as_alone(6, 16, usize::MAX)
}

/// Jobs handed in while others run: their prompts (and vision forwards) join forwards that hold other
/// jobs' decode steps, and they answer what each answers alone.
#[test]
fn screenshots_arriving_mid_run_answer_as_alone() -> anyhow::Result<()> {
    screenshot_jobs_answer_as_alone(2, 24, usize::MAX)
}

/// As above, with the prompts of the jobs handed in mid-run prefilled in chunks of 100 tokens (held by
/// the model's owner after their screenshots were encoded beside a forward).
#[test]
fn screenshots_arriving_mid_run_answer_as_alone_in_chunks() -> anyhow::Result<()> {
    screenshot_jobs_answer_as_alone(2, 24, 100)
}

/// Chunked prefill: with chunks of 100 tokens, three jobs' prompts (about 900 tokens each) run over
/// several forwards and answer what they answer in one; tolerance as above (chunking changes GEMM row
/// counts; each chunk's queries attend to the cache of the chunks before them).
#[test]
fn chunked_prefill_answers_as_the_whole_prompt() -> anyhow::Result<()> {
    let tasks = ["Call mum", "Find the cheapest flight to Oslo", "Open the settings and turn on dark mode"];
    let run = |chunk: usize| -> anyhow::Result<(Vec<AgentStepResponse>, usize)> {
        let mut b = backend(false)?.with_prefix_cache(0).with_prefill_chunk(chunk);
        let (jobs, rxs): (Vec<Job>, Vec<_>) = tasks
            .iter()
            .map(|t| {
                Job::new(JobKind::Step(step_job(t, StepOptions { max_tokens: Some(16), ..Default::default() })), None)
            })
            .unzip();
        let mut intake = Recorder { later: vec![], batches: vec![], vision: vec![] };
        b.run_continuous(jobs, &mut intake);
        let answers = rxs.into_iter().map(|rx| Ok(step_of(rx.blocking_recv()?))).collect::<anyhow::Result<_>>()?;
        Ok((answers, intake.batches.len()))
    };
    let (whole, whole_forwards) = run(usize::MAX)?;
    let (chunked, chunked_forwards) = run(100)?;
    let prompt = whole[0].usage.prompt_tokens;
    eprintln!("{prompt}-token prompts: {whole_forwards} forwards whole, {chunked_forwards} in chunks of 100");
    assert!(prompt > 300, "the prompts must be long enough to chunk: {prompt}");
    for (i, (c, w)) in chunked.iter().zip(&whole).enumerate() {
        let (p, q) = (c.ask_probability.unwrap(), w.ask_probability.unwrap());
        assert!((p - q).abs() <= 1e-5, "job {i}: ask_probability {p} chunked vs {q} whole");
        assert_eq!(c.raw, w.raw, "job {i}: the same answer");
    }
    assert!(chunked_forwards >= whole_forwards + prompt / 100 - 1, "{chunked_forwards} vs {whole_forwards}");
    Ok(())
}

/// The prefix cache: a repeated prompt prefills one token, the step after an ask reuses the system
/// prompt and the task (the dialogue comes before the screenshot, so the screenshot is prefilled again),
/// another screenshot is not mistaken for the same one, and the answers equal those without the cache.
#[test]
fn prompt_prefixes_are_reused_only_where_they_match() -> anyhow::Result<()> {
    let mut b = backend(false)?;
    let mut cold = backend(false)?.with_prefix_cache(0);
    let opts = StepOptions { max_tokens: Some(16), ..Default::default() };
    let first = b.step(&step_job("Buy milk", opts.clone()), NEVER)?;
    assert_eq!(first.usage.cached_tokens, 0);
    let again = b.step(&step_job("Buy milk", opts.clone()), NEVER)?;
    let forced = 4; // the forced `{"action":"` tokens: in the cached sequence, counted as completion tokens
    let prompt = again.usage.prompt_tokens + forced;
    assert!(again.usage.cached_tokens + 8 >= prompt, "a repeat reuses all but the end: {:?}", again.usage);
    let want = cold.step(&step_job("Buy milk", opts.clone()), NEVER)?;
    assert!((again.ask_probability.unwrap() - want.ask_probability.unwrap()).abs() <= 1e-6);
    assert_eq!(want.usage.cached_tokens, 0, "no reuse with the cache off");

    // After an ask: the same system prompt and task, then the question and the answer, then the screenshot.
    let mut after = step_job("Buy milk", opts.clone());
    after.request.history = vec![
        Turn::Agent {
            action: Action::Ask(askgui_data::action::Ask {
                question: "Which brand?".into(),
                options: vec![],
                kind: None,
            }),
        },
        Turn::Say { text: "Any".into() },
    ];
    let r = b.step(&after, NEVER)?;
    eprintln!("after an ask: {:?}", r.usage);
    let fresh = r.usage.prompt_tokens + forced - r.usage.cached_tokens;
    assert!(
        r.usage.cached_tokens > 0 && fresh > r.usage.image_tokens,
        "the task is reused, not the screen: {:?}",
        r.usage
    );
    let want = cold.step(&after, NEVER)?;
    assert!((r.ask_probability.unwrap() - want.ask_probability.unwrap()).abs() <= 1e-6);

    // Same words, another screenshot of the same size: reuse stops before the image.
    let mut other = step_job("Buy milk", opts.clone());
    let shot = other.screenshots.last_mut().unwrap();
    shot.hash ^= 1;
    shot.image = Arc::new(image::RgbImage::from_pixel(200, 150, image::Rgb([200, 10, 10])));
    let r = b.step(&other, NEVER)?;
    assert!(r.usage.cached_tokens < r.usage.prompt_tokens - r.usage.image_tokens, "{:?}", r.usage);
    let want = cold.step(&other, NEVER)?;
    assert!((r.ask_probability.unwrap() - want.ask_probability.unwrap()).abs() <= 1e-6);
    Ok(())
}

#[test]
fn chat_streams_the_final_text_and_honours_limits() -> anyhow::Result<()> {
    let mut b = backend(false)?;
    let job = ChatJob {
        messages: vec![ChatMessage {
            role: ChatRole::User,
            parts: vec![ChatPart::Image(screenshot(120, 90)), ChatPart::Text("What is on the screen?".into())],
        }],
        max_tokens: 12,
        temperature: 0.8,
        top_p: 0.9,
        seed: Some(5),
        stop: vec![],
    };
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let out = b.chat(&job, Some(&tx), NEVER)?;
    drop(tx);
    let mut pieces = vec![];
    while let Ok(p) = rx.try_recv() {
        pieces.push(p);
    }
    assert_eq!(pieces.concat(), out.text, "streamed pieces {pieces:?}");
    assert!(out.completion_tokens <= 12);
    if out.finish_reason == FinishReason::Length {
        assert_eq!(out.completion_tokens, 12);
    }
    // A stop string ends the text before it.
    if let Some(c) = out.text.chars().nth(2) {
        let stopped = b.chat(&ChatJob { stop: vec![c.to_string()], ..job.clone() }, None, NEVER)?;
        assert!(!stopped.text.contains(c), "{:?} still holds the stop string {c:?}", stopped.text);
        assert_eq!(stopped.finish_reason, FinishReason::Stop);
    }
    // Cancelled before it starts.
    let cancelled = b.chat(&job, None, &|| true);
    assert!(matches!(cancelled, Err(askgui_serve::backend::BackendError::Cancelled)));
    Ok(())
}

/// A prompt longer than the context is refused with the sizes, before any compute.
#[test]
fn over_long_prompts_are_refused() -> anyhow::Result<()> {
    let mut b = backend(false)?;
    let opts = StepOptions { max_tokens: Some(40_000), ..Default::default() };
    match b.step(&step_job("Buy milk", opts), NEVER) {
        Err(askgui_serve::backend::BackendError::ContextOverflow { tokens, limit }) => {
            assert!(tokens > limit && limit == 32768)
        }
        other => panic!("expected a context overflow, got {other:?}"),
    }
    Ok(())
}

/// `--dtype bf16` on the CPU: a bf16 model answers a step that parses, and its `ask_probability` follows
/// the f32 model's. Tolerance 0.05: bf16 moves the tiny model's logits by about 2e-2 (8 significant
/// bits), and a probability over the 15 names moves by at most that much times p(1 - p) <= 1/4 per logit.
#[test]
fn a_bf16_model_serves_on_the_cpu() -> anyhow::Result<()> {
    let job = step_job("Open the settings and turn on dark mode", StepOptions::default());
    let want = backend(false)?.step(&job, NEVER)?.ask_probability.expect("ask_probability");
    let model = Qwen2Vl::load(checkpoint().to_str().unwrap(), &Device::Cpu, DType::BF16)?;
    let r = ModelBackend::from_model(model, "tiny-bf16")?.step(&job, NEVER)?;
    let got = r.ask_probability.expect("ask_probability");
    eprintln!("ask_probability f32 {want:.5}, bf16 {got:.5}; bf16 action {:?}", r.action);
    assert!((got - want).abs() < 0.05, "bf16 {got} against f32 {want}");
    Ok(())
}

/// `--quantize int8` through the command line: the backend loads int8 linears and answers close to f32
/// (the model test `int8.rs` bounds the logits; here the served `ask_probability`, within 0.05 as bf16's).
#[test]
fn an_int8_model_serves_on_the_cpu() -> anyhow::Result<()> {
    let job = step_job("Open the settings and turn on dark mode", StepOptions::default());
    let want = backend(false)?.step(&job, NEVER)?.ask_probability.expect("ask_probability");
    let tiny = checkpoint();
    let argv = ["askgui-serve", "--model", tiny.to_str().unwrap(), "--device", "cpu", "--quantize", "int8"];
    let cli = <askgui_serve::config::Cli as clap::Parser>::try_parse_from(argv)?;
    let cfg = askgui_serve::model_backend::ModelBackendConfig::from(&cli.serve);
    let r = ModelBackend::load(&cfg)?.step(&job, NEVER)?;
    let got = r.ask_probability.expect("ask_probability");
    eprintln!("ask_probability f32 {want:.5}, int8 {got:.5}; int8 action {:?}", r.action);
    assert!((got - want).abs() < 0.05, "int8 {got} against f32 {want}");
    Ok(())
}

/// The KV block pool (`--kv-cache-mb`) with room for one job: of six jobs started together, the first
/// admitted runs and the others are refused as busy (503 over HTTP) instead of overrunning the pool; a job
/// alone afterwards is answered; and with the prefix cache off no block is left once jobs are done, a
/// cancelled job's included. One step of the tiny model holds about 74 blocks of 8 KiB (a ~1,150-token
/// prompt and its answer in two layers; the action-name forks write none); admission asks for 78, so 100
/// fit one job, not two.
#[test]
fn a_full_kv_cache_refuses_jobs_and_the_backend_recovers() -> anyhow::Result<()> {
    let one_job = 100.0 * 8192.0 / (1u64 << 20) as f64;
    let mut b = backend(false)?.with_prefix_cache(0).with_kv_cache_mb(one_job);
    let pool = b.runtime().kv_pool().clone();
    assert_eq!(pool.capacity(), 100);
    let opts = StepOptions { max_tokens: Some(16), ..Default::default() };
    let (jobs, rxs): (Vec<Job>, Vec<_>) =
        (0..6).map(|_| Job::new(JobKind::Step(step_job("Call mum", opts.clone())), None)).unzip();
    let mut intake = Recorder { later: vec![], batches: vec![], vision: vec![] };
    b.run_continuous(jobs, &mut intake);
    let (mut answered, mut busy) = (0, 0);
    for rx in rxs {
        match rx.blocking_recv()? {
            Ok(JobOutput::Step(_)) => answered += 1,
            Err(BackendError::Busy(m)) => {
                assert!(m.contains("KV cache is full"), "{m}");
                busy += 1;
            }
            other => panic!("neither an answer nor busy: {other:?}"),
        }
    }
    eprintln!("{answered} answered, {busy} busy");
    assert!(answered >= 1 && busy >= 1, "{answered} answered, {busy} busy");
    assert_eq!(pool.blocks_in_use(), 0, "every block back once the jobs are done");
    b.step(&step_job("Call mum", opts.clone()), NEVER)?;
    assert_eq!(pool.blocks_in_use(), 0);
    let cancelled = b.step(&step_job("Call mum", opts), &|| true);
    assert!(matches!(cancelled, Err(BackendError::Cancelled)), "{cancelled:?}");
    assert_eq!(pool.blocks_in_use(), 0, "a cancelled job's blocks go back");
    Ok(())
}
