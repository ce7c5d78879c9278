//! The real-data sequence of docs/real-data.md at toy scale, in one test: convert the AndroidControl
//! TFRecord fixture, ambiguate it through askgui-serve's OpenAI endpoint, validate, train a LoRA for two
//! steps and evaluate the adapter Dual-Stream, each stage reading what the one before wrote.
//!
//! The model is the tiny random Qwen2.5-VL fixture, served as `askgui-serve --model FIXTURE` would serve
//! it: its rewrites are junk, which `ambiguate` must count by stage and reason and write the episodes
//! unchanged, so the rest of the sequence still has data to run on. The numbers say nothing about
//! quality; the test checks that each stage hands over what the next needs and that the Dual-Stream
//! report is a report of those episodes.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use askgui_data::agent_api::StepOptions;
use askgui_data::ambiguate::{ambiguate, AmbiguateArgs};
use askgui_data::convert::convert_android_control;
use askgui_data::episode::load_episodes;
use askgui_data::validate::validate_file;
use askgui_data::PromptFlags;
use askgui_eval::agent::Agent;
use askgui_eval::backends::InProcessAgent;
use askgui_eval::matching::MatchConfig;
use askgui_eval::metrics::NoContentScorer;
use askgui_eval::modes::Mode;
use askgui_eval::runner::{load, run_eval, EvalConfig, RunOptions};
use askgui_model::LoadOptions;
use askgui_serve::config::Config;
use askgui_serve::model_backend::{ModelBackend, ModelBackendConfig};
use askgui_train::cli::from_args;
use askgui_train::{RunControl, TrainConfig};
use serde_json::Value;

const MAX_PIXELS: usize = 12544;
/// The reasons `ambiguate` counts junk under (see `askgui_data::ambiguate::Junk`).
const JUNK_KINDS: [&str; 7] = [
    "no JSON object",
    "invalid JSON",
    "wrong shape",
    "missing instruction",
    "no such step",
    "missing field",
    "task unchanged",
];

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/tiny-qwen2_5_vl")
}

fn android_control() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../datasets/tests/fixtures/android_control/android_control-00000-of-00001")
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("askgui-train-real-data-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `askgui-serve --model FIXTURE --max-pixels 12544 --max-tokens 16` on a free port, loaded.
fn serve() -> askgui_serve::ServerHandle {
    let mut cfg = Config::for_model(fixture().display().to_string());
    cfg.port = 0;
    cfg.max_pixels = Some(MAX_PIXELS);
    cfg.max_tokens = 16;
    let mb = ModelBackendConfig::from(&cfg);
    let factory = Box::new(move || {
        let b: Box<dyn askgui_serve::backend::Backend> = Box::new(ModelBackend::load(&mb)?);
        Ok(b)
    });
    let server = askgui_serve::start(cfg, factory).expect("the server starts");
    let t0 = Instant::now();
    while ureq::get(&server.url("/health")).call().is_err() {
        assert!(t0.elapsed() < Duration::from_secs(120), "the model did not load");
        std::thread::sleep(Duration::from_millis(100));
    }
    server
}

/// `askgui-train --model FIXTURE --data DATA --output-dir OUT` with toy settings.
fn train_config(data: &Path, out: &Path) -> TrainConfig {
    let mut argv: Vec<String> = ["askgui-train", "--model"].map(String::from).to_vec();
    argv.push(fixture().display().to_string());
    for (k, v) in [("--data", data), ("--output-dir", out)] {
        argv.extend([k.to_string(), v.display().to_string()]);
    }
    argv.extend(
        "--max-pixels 12544 --progress false --max-steps 2 --batch-size 1 --grad-accum 1 --lora-rank 4"
            .split_whitespace()
            .map(String::from),
    );
    from_args(argv).unwrap().0
}

fn ratio_or_null(v: &Value) -> bool {
    v.is_null() || v.as_f64().is_some_and(|x| (0.0..=1.0).contains(&x))
}

#[test]
fn convert_ambiguate_validate_train_and_evaluate_dual_stream() {
    let t0 = Instant::now();
    let dir = scratch("e2e");

    // 1. convert: `askgui-data convert android-control --input FILE --out DIR`.
    let converted = dir.join("converted");
    let c = convert_android_control(&android_control(), &converted).unwrap();
    assert_eq!((c.episodes, c.steps), (3, 15));
    let episodes = converted.join("episodes.jsonl");

    // 2. ambiguate through askgui-serve's /v1/chat/completions, model named as the server names it.
    let server = serve();
    let ambiguous = dir.join("ambiguous/episodes.jsonl");
    let args = AmbiguateArgs {
        input: episodes.clone(),
        out: ambiguous.clone(),
        base_url: server.url("/v1"),
        model: fixture().display().to_string(),
        api_key_env: "ASKGUI_TEST_KEY_UNSET_REAL_DATA".into(),
        retries: 1,
        timeout_s: 60.0,
        seed: 0,
        limit: None,
        backoff_ms: 10,
    };
    let report = ambiguate(&args).expect("junk answers are counted, not an error");
    eprintln!("ambiguate: {report:?} ({:.1} s)", t0.elapsed().as_secs_f64());
    assert_eq!((report.done, report.skipped_existing), (3, 0));
    assert!(report.rejected_total() > 0, "the tiny random model wrote a usable rewrite: {report:?}");
    for (key, n) in &report.rejected {
        let (stage, kind) = key.split_once(": ").unwrap_or_else(|| panic!("{key}"));
        assert!(["instructions", "informative", "ask"].contains(&stage) && JUNK_KINDS.contains(&kind), "{key}");
        assert!(*n > 0, "{key}");
    }
    let out: Vec<_> = load_episodes(&ambiguous).unwrap().into_iter().map(|l| l.episode).collect();
    assert_eq!(out.len(), 3, "every episode is written, rewritten or not");
    let rewritten = out.iter().filter(|e| e.is_ambiguous()).count();
    assert_eq!(rewritten + report.no_informative_step + report.rejected_total(), 3, "{report:?}");
    // Run again: everything is there, nothing is asked.
    assert_eq!(ambiguate(&args).unwrap().skipped_existing, 3);
    drop(server);

    // 3. validate: `askgui-data validate FILE`, screenshots opened.
    let v = validate_file(&ambiguous, true).unwrap();
    let problems: Vec<String> = v.problems.iter().map(|p| p.to_string()).collect();
    assert!(problems.is_empty(), "{}", problems.join("\n"));

    // 4. train: two LoRA steps on the ambiguated file.
    let run = dir.join("run");
    let s = askgui_train::train(&train_config(&ambiguous, &run), &RunControl::default()).unwrap();
    assert_eq!(s.steps.len(), 2);
    assert!(s.steps.iter().all(|l| l.loss.is_finite()), "{:?}", s.steps);
    let adapter = s.last_checkpoint.expect("an adapter checkpoint");
    assert!(adapter.join("adapter_model.safetensors").is_file(), "{}", adapter.display());
    eprintln!("trained ({:.1} s)", t0.elapsed().as_secs_f64());

    // 5. evaluate: `askgui-eval run --episodes FILE --model FIXTURE --adapter CKPT --modes dual`; the
    // prompt settings come from the adapter's askgui.json.
    let steps = StepOptions { max_tokens: Some(12), ..StepOptions::default() };
    let model = fixture().display().to_string();
    let agent = InProcessAgent::load(&model, Some(&adapter), &PromptFlags::default(), steps, LoadOptions::default())
        .expect("the model with the trained adapter loads");
    assert_eq!(agent.identity().prompt.max_pixels, Some(MAX_PIXELS), "the adapter's card is read");
    let cfg = EvalConfig {
        episodes: ambiguous.clone(),
        out: dir.join("eval"),
        modes: vec![Mode::Dual],
        matching: MatchConfig::default(),
        run: RunOptions { concurrency: 1, progress: false },
    };
    let eps = load(&cfg).unwrap();
    let report = run_eval(&agent, &eps, &cfg, &NoContentScorer("no text scorer in this test".into())).unwrap();
    assert_eq!(report.modes.len(), 1);
    let dual = &report.modes[0];
    assert_eq!((dual.mode, dual.episodes, dual.empty_episodes, dual.steps), (Mode::Dual, 3, 0, 15));
    assert!(dual.correct_steps <= dual.steps);

    // The written report: the Dual-Stream row with its ratios.
    let json: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("eval/report.json")).unwrap()).unwrap();
    let row = &json["modes"][0];
    assert_eq!((row["mode"].as_str(), row["episodes"].as_u64()), (Some("dual"), Some(3)));
    for k in ["ssr", "sr", "ssr_before", "ssr_after", "ssr_pooled", "ssr_before_pooled", "ssr_after_pooled"] {
        assert!(row.get(k).is_some_and(ratio_or_null), "{k}: {}", row[k]);
    }
    assert!(row["ssr"].is_number() && row["sr"].is_number(), "{row}");
    eprintln!("dual: ssr {} sr {} ({:.1} s in all)", row["ssr"], row["sr"], t0.elapsed().as_secs_f64());
    let _ = std::fs::remove_dir_all(&dir);
}
