//! `askgui-eval --endpoint` against the real askgui-serve (not a stand-in): the server runs the model
//! backend on the tiny random Qwen2.5-VL checkpoint of the model tests, with the PEFT adapter of its
//! gradient fixtures, on a loopback port. The random model's answers are noise, but every one must come
//! back as a parsed action in screen pixels, with and without the adapter, with a history holding an
//! ASK and a SAY and with an element list.

mod common;

use askgui_data::agent_api::StepOptions;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use askgui_data::{Action, Ask, Element, Platform, Screen, Target, Turn};
use askgui_eval::agent::{Agent, StepInput};
use askgui_eval::backends::{EndpointAgent, EndpointConfig};
use askgui_serve::config::{AdapterArg, Config};
use askgui_serve::model_backend::{ModelBackend, ModelBackendConfig};
use common::screenshot;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures")
}

#[test]
fn endpoint_backend_gets_actions_from_the_real_server() {
    let ckpt = fixtures().join("tiny-qwen2_5_vl").display().to_string();
    let mut cfg = Config::for_model(ckpt.clone());
    cfg.port = 0;
    let grad = format!("grad={}", fixtures().join("lora/grad/adapter").display());
    cfg.adapters = vec![grad.parse::<AdapterArg>().unwrap()];
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
    let base = server.url("");
    let input = StepInput {
        episode_id: "e1".into(),
        step: 2,
        task: "Buy oat milk".into(),
        history: vec![
            Turn::Agent { action: Action::Click(Target::point(100, 60)) },
            Turn::Agent { action: Action::Ask(Ask { question: "Which size?".into(), options: vec![], kind: None }) },
            Turn::Say { text: "The 1 litre one.".into() },
        ],
        screenshots: vec![screenshot("against-server", 240, 180)],
        elements: Some(vec![Element {
            id: "e3".into(),
            role: "button".into(),
            text: "Search".into(),
            bbox: [10, 20, 200, 60],
        }]),
        screen: Screen { width: 240, height: 180 },
        platform: Platform::Android,
    };
    for adapter in [None, Some("grad".to_string())] {
        let agent = EndpointAgent::new(EndpointConfig {
            base: base.trim_end_matches('/').to_string(),
            adapter: adapter.clone(),
            timeout_s: 60.0,
            retries: 0,
            backoff_ms: 10,
            options: StepOptions { max_tokens: Some(24), ..StepOptions::default() },
            elements: true,
            history_images: None,
        })
        .expect("endpoint config");
        let p = agent.predict(&input).unwrap_or_else(|e| panic!("adapter {adapter:?}: {e}"));
        let action = p.action.unwrap_or_else(|| panic!("adapter {adapter:?}: no action in {:?}", p.raw));
        action.check().unwrap_or_else(|e| panic!("{e}: {action:?}"));
        if let Some((x, y)) = action.target().and_then(|t| t.xy()) {
            // Constrained to the model frame, so on the 240x180 screen (the edge pixel may round up to 240).
            assert!((0..=240).contains(&x) && (0..=180).contains(&y), "({x}, {y}) is not on the 240x180 screen");
        }
        eprintln!("adapter {adapter:?}: {}", p.raw);
    }
    server.stop();
}
