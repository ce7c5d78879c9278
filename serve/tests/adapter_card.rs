//! The server takes its prompt settings from the askgui.json of the adapters it loads: the card's
//! max_pixels decides the frame the model sees and its system prompt the prompt's length; a flag with
//! another value wins with a warning; adapters whose cards disagree are refused, every disagreement named,
//! unless flags decide.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use askgui_data::adapter_card::CardPause;
use askgui_data::agent_api::{AgentStepRequest, AgentStepResponse, StepOptions};
use askgui_data::{ActionLanguage, AdapterCard, FrameKind, PromptConfig, SystemPrompt};
use askgui_serve::backend::{ImageInput, StepJob};
use askgui_serve::model_backend::{ModelBackend, ModelBackendConfig};
use clap::Parser;

const TINY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../model/tests/fixtures/tiny-qwen2_5_vl");
const PEFT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../model/tests/fixtures/lora/tiny-qwen2_5_vl-peft");

/// The PEFT fixture adapter in a folder of its own with a card of `max_pixels` and `system`.
fn adapter(name: &str, max_pixels: usize, system: SystemPrompt) -> PathBuf {
    adapter_with(name, PromptConfig { max_pixels, system_prompt: system, ..Default::default() })
}

/// The PEFT fixture adapter in a folder of its own with a card of `prompt`.
fn adapter_with(name: &str, prompt: PromptConfig) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("askgui-serve-card-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(Path::new(PEFT).join(f), dir.join(f)).unwrap();
    }
    AdapterCard::new(&prompt, 0).write(&dir).unwrap();
    dir
}

fn config(argv: &[&str], adapters: &[(&str, &Path)]) -> ModelBackendConfig {
    let cfg = askgui_serve::config::Cli::try_parse_from(["askgui-serve", "--model", TINY].iter().chain(argv)).unwrap();
    let mut b = ModelBackendConfig::from(&cfg.serve);
    b.adapters = adapters.iter().map(|(n, d)| (n.to_string(), d.to_path_buf())).collect();
    b
}

/// Loads the backend (capturing its warnings) and answers one step on a 400x300 screenshot.
fn step(cfg: &ModelBackendConfig) -> (anyhow::Result<AgentStepResponse>, String) {
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let r = tracing::subscriber::with_default(subscriber, || -> anyhow::Result<AgentStepResponse> {
        let mut b = ModelBackend::load(cfg)?;
        let img = image::RgbImage::from_fn(400, 300, |x, y| image::Rgb([(x % 256) as u8, (y % 256) as u8, 90]));
        let mut request = AgentStepRequest::new("Open the settings", "unused");
        request.options = StepOptions { max_tokens: Some(8), ..Default::default() };
        let job = StepJob::new(request, Some(ImageInput { image: Arc::new(img), hash: 7 }));
        Ok(b.step(&job, &|| false)?)
    });
    let logged = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
    (r, logged)
}

fn area(r: &AgentStepResponse) -> u32 {
    r.frame.model.width * r.frame.model.height
}

fn text_tokens(r: &AgentStepResponse) -> usize {
    r.usage.prompt_tokens - r.usage.image_tokens
}

#[test]
fn the_adapters_card_sets_the_frame_and_the_system_prompt() {
    let plain = step(&config(&[], &[("a", Path::new(PEFT))])).0.unwrap();
    assert!(area(&plain) > 12_544, "the checkpoint's processor keeps 400x300: {:?}", plain.frame.model);

    let small = adapter("small", 12_544, SystemPrompt::Compact);
    let (carded, logged) = step(&config(&[], &[("a", &small)]));
    let carded = carded.unwrap();
    assert!(area(&carded) <= 12_544, "the card's max_pixels: {:?}", carded.frame.model);
    assert!(text_tokens(&carded) < text_tokens(&plain), "the compact system prompt is shorter");
    assert!(logged.is_empty(), "{logged}");

    // An explicit flag wins, with a warning naming the setting and both values.
    let (flagged, logged) = step(&config(&["--system-prompt", "full", "--max-pixels", "1003520"], &[("a", &small)]));
    let flagged = flagged.unwrap();
    assert_eq!((area(&flagged), text_tokens(&flagged)), (area(&plain), text_tokens(&plain)));
    assert!(logged.contains("--max-pixels 1003520") && logged.contains("max-pixels = 12544"), "{logged}");
    assert!(logged.contains("--system-prompt full") && logged.contains("system-prompt = compact"), "{logged}");
}

#[test]
fn adapters_trained_differently_need_a_flag_to_share_a_server() {
    let small = adapter("two-small", 12_544, SystemPrompt::Compact);
    let large = adapter("two-large", 57_344, SystemPrompt::Compact);
    let (r, _) = step(&config(&[], &[("s", &small), ("l", &large)]));
    let e = format!("{:#}", r.unwrap_err());
    assert!(e.contains("adapter `s`") && e.contains("adapter `l`") && e.contains("--max-pixels"), "{e}");
    let (r, logged) = step(&config(&["--max-pixels", "57344"], &[("s", &small), ("l", &large)]));
    assert!(area(&r.unwrap()) <= 57_344);
    assert!(logged.contains("--max-pixels 57344") && logged.contains("max-pixels = 12544"), "{logged}");
}

/// Every setting the cards disagree on is named in one refusal, with the flags that settle them; giving
/// those flags serves both.
#[test]
fn every_disagreement_is_named_at_once() {
    let a = adapter_with("all-a", PromptConfig { max_pixels: 12_544, ..Default::default() });
    let b = adapter_with(
        "all-b",
        PromptConfig {
            max_pixels: 57_344,
            system_prompt: SystemPrompt::Compact,
            frame: FrameKind::Relative1000,
            elements: true,
            action_language: ActionLanguage::ToolCall,
            ..Default::default()
        },
    );
    let (r, _) = step(&config(&[], &[("a", &a), ("b", &b)]));
    let e = format!("{:#}", r.unwrap_err());
    // PromptConfig::default() is full / resized / askgui / no elements; `b` differs from it in all five.
    for named in [
        "system-prompt full vs compact",
        "frame resized vs relative1000",
        "max-pixels 12544 vs 57344",
        "elements false vs true",
        "action-language askgui vs tool-call",
        "--system-prompt and --frame and --action-language and --max-pixels and --elements",
    ] {
        assert!(e.contains(named), "`{named}` is not in: {e}");
    }
    assert!(!e.contains("min-pixels"), "the cards agree on min-pixels: {e}");
    let settle = [
        "--system-prompt",
        "full",
        "--frame",
        "resized",
        "--action-language",
        "askgui",
        "--max-pixels",
        "12544",
        "--elements",
        "false",
    ];
    let (r, _) = step(&config(&settle, &[("a", &a), ("b", &b)]));
    assert!(area(&r.unwrap()) <= 12_544);
}

/// `--pause-threshold` is every request's default over the cards' calibrated levels, and `/health`'s
/// `pause_thresholds` says what each model answers with.
#[test]
fn the_pause_threshold_flag_wins_over_the_cards() {
    use askgui_serve::backend::Backend;
    let dir = adapter("pause-flag", 12_544, SystemPrompt::Full);
    let mut card = AdapterCard::read(&dir).unwrap().unwrap();
    card.pause = Some(CardPause {
        threshold: 0.25,
        target_fpr: 0.05,
        episodes: "val.jsonl".into(),
        strict_f1: None,
        fpr: None,
        bound_met: true,
    });
    card.write(&dir).unwrap();
    let carded = ModelBackend::load(&config(&[], &[("a", &dir)])).unwrap();
    let want: std::collections::BTreeMap<String, f64> = [("a".to_string(), 0.25)].into();
    assert_eq!(carded.info().pauses.by_name("m"), want, "the card's level; the base model has none");
    drop(carded);
    let flagged = ModelBackend::load(&config(&["--pause-threshold", "0.5"], &[("a", &dir)])).unwrap();
    let want: std::collections::BTreeMap<String, f64> = [("a".to_string(), 0.5), ("m".to_string(), 0.5)].into();
    assert_eq!(flagged.info().pauses.by_name("m"), want);
}

#[test]
fn no_card_keeps_the_defaults() {
    let cfg = config(&[], &[]);
    assert_eq!(cfg.prompt, askgui_data::PromptFlags::default(), "no flag given: every setting unset");
    let r = step(&cfg).0.unwrap();
    assert!(area(&r) > 12_544, "the checkpoint's processor: {:?}", r.frame.model);
}

/// A calibrated pause level in an adapter's card is the default of the requests that adapter answers (0:
/// every answer asks); a request's own `pause_threshold` wins.
#[test]
fn the_cards_pause_threshold_is_the_adapters_default_and_a_request_wins() {
    use askgui_serve::backend::{Backend, Job, JobKind, JobOutput};
    let dir = adapter("pause", 12_544, SystemPrompt::Full);
    let mut card = AdapterCard::read(&dir).unwrap().unwrap();
    card.pause = Some(CardPause {
        threshold: 0.0,
        target_fpr: 0.05,
        episodes: "val.jsonl".into(),
        strict_f1: None,
        fpr: None,
        bound_met: true,
    });
    card.write(&dir).unwrap();
    let mut b = ModelBackend::load(&config(&[], &[("a", &dir)])).unwrap();
    let mut run = |adapter: Option<&str>, pause: Option<f64>| {
        let img = image::RgbImage::from_fn(200, 150, |x, y| image::Rgb([(x % 256) as u8, (y % 256) as u8, 90]));
        let mut request = AgentStepRequest::new("Open the settings", "unused");
        request.options = StepOptions { max_tokens: Some(16), pause_threshold: pause, ..Default::default() };
        let job = StepJob::new(request, Some(ImageInput { image: Arc::new(img), hash: 9 }));
        let (job, rx) = Job::new(JobKind::Step(job), adapter.map(String::from));
        b.run(vec![job]);
        match rx.blocking_recv().unwrap().unwrap() {
            JobOutput::Step(r) => r,
            other => panic!("not a step answer: {other:?}"),
        }
    };
    let defaulted = run(Some("a"), None);
    assert_eq!(defaulted.action.name(), "ask", "threshold 0 from the card: {}", defaulted.raw);
    let own = run(Some("a"), Some(1.0));
    assert!(own.ask_probability.unwrap() < 1.0);
    assert_ne!(own.action.name(), "ask", "the request's threshold 1 wins: {}", own.raw);
}
