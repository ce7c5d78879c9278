//! The real server with the model backend on the tiny random Qwen2.5-VL checkpoint of the model tests and
//! the PEFT adapter of its gradient fixtures, over real HTTP on a loopback port: the agent step, a session
//! with an ASK and a SAY, adapters, chat completions (plain and streamed), and the official OpenAI
//! Python client when `ASKGUI_OPENAI_PYTHON` names a Python that has `openai` (`.ci/run` sets it up).

use std::io::{BufRead, BufReader, Cursor};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use askgui_data::convert::base64_encode;
use askgui_serve::config::{AdapterArg, Config};
use askgui_serve::model_backend::{ModelBackend, ModelBackendConfig};
use askgui_serve::server::{start, ServerHandle};
use serde_json::{json, Value};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures")
}

fn png(w: u32, h: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x * 5 % 256) as u8, (y * 9 % 256) as u8, 40]));
    let mut out = Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).expect("PNG encoding");
    out.into_inner()
}

fn server() -> ServerHandle {
    let ckpt = fixtures().join("tiny-qwen2_5_vl").display().to_string();
    let adapter = format!("grad={}", fixtures().join("lora/grad/adapter").display());
    let mut cfg = Config::for_model(ckpt.clone());
    cfg.port = 0;
    cfg.adapters = vec![adapter.parse::<AdapterArg>().expect("adapter flag")];
    let backend_cfg = ModelBackendConfig::from(&cfg);
    let factory = Box::new(move || {
        let b: Box<dyn askgui_serve::backend::Backend> = Box::new(ModelBackend::load(&backend_cfg)?);
        Ok(b)
    });
    let handle = start(cfg, factory).expect("server starts");
    let t0 = Instant::now();
    while ureq::get(&handle.url("/health")).call().is_err() {
        assert!(t0.elapsed() < Duration::from_secs(120), "the model did not load in 120 s");
        std::thread::sleep(Duration::from_millis(100));
    }
    handle
}

fn post(h: &ServerHandle, path: &str, body: Value) -> (u16, Value) {
    match ureq::post(&h.url(path)).send_json(body) {
        Ok(r) => (r.status(), r.into_json().unwrap_or(Value::Null)),
        Err(ureq::Error::Status(code, r)) => (code, r.into_json().unwrap_or(Value::Null)),
        Err(e) => panic!("{path}: {e}"),
    }
}

fn step_body(task: &str, opts: Value) -> Value {
    json!({"task": task, "observation": {"screenshot": base64_encode(&png(200, 150))}, "options": opts})
}

#[test]
fn agent_step_session_adapters_and_chat_over_http() {
    let h = server();

    // Stateless step: an action in screen pixels, its model-frame twin, the frame and an ask probability.
    let (code, r) = post(&h, "/v1/agent/step", step_body("Open the settings", json!({})));
    assert_eq!(code, 200, "{r}");
    let p = r["ask_probability"].as_f64().expect("ask_probability");
    assert!((0.0..=1.0).contains(&p), "{p}");
    assert_eq!(r["frame"]["screen"], json!({"width": 200, "height": 150}));
    askgui_data::parse::parse_answer(r["raw"].as_str().unwrap()).expect("the answer parses");

    // The adapter changes the model's answer distribution; an unknown one is a 4xx naming the known ones.
    let mut with = step_body("Open the settings", json!({}));
    with["adapter"] = json!("grad");
    let (code, ra) = post(&h, "/v1/agent/step", with.clone());
    assert_eq!(code, 200, "{ra}");
    assert_ne!(ra["ask_probability"], r["ask_probability"], "the adapter made no difference");
    with["adapter"] = json!("nope");
    let (code, e) = post(&h, "/v1/agent/step", with);
    assert!((400..500).contains(&code) && e.to_string().contains("grad"), "{code} {e}");

    // A session: ask (pause threshold 0), the user's answer, then an action (threshold 1).
    let (code, s) = post(&h, "/v1/sessions", json!({"task": "Buy milk", "options": {"pause_threshold": 0.0}}));
    assert_eq!(code, 201, "{s}");
    let id = s["id"].as_str().unwrap().to_string();
    let obs = json!({"observation": {"screenshot": base64_encode(&png(200, 150))}});
    let (code, a) = post(&h, &format!("/v1/sessions/{id}/step"), obs.clone());
    assert_eq!((code, a["action"]["action"].as_str()), (200, Some("ask")), "{a}");
    let (code, _) = post(&h, &format!("/v1/sessions/{id}/say"), json!({"text": "Oat milk, one litre."}));
    assert!((200..300).contains(&code), "say answered {code}");
    let got: Value = ureq::get(&h.url(&format!("/v1/sessions/{id}"))).call().unwrap().into_json().unwrap();
    let turns = got["history"].as_array().expect("history");
    assert_eq!(turns.len(), 2, "{got}");
    assert_eq!(turns[1], json!({"turn": "say", "text": "Oat milk, one litre."}));
    // The step after the answer reuses the session's prefix up to the dialogue, which comes before the
    // screenshot, so the screenshot is prefilled again.
    let (code, b) = post(&h, &format!("/v1/sessions/{id}/step"), obs.clone());
    assert_eq!(code, 200, "{b}");
    let u = &b["usage"];
    let (cached, image, prompt) = (
        u["cached_tokens"].as_u64().unwrap(),
        u["image_tokens"].as_u64().unwrap(),
        u["prompt_tokens"].as_u64().unwrap(),
    );
    assert!(
        cached > 0 && image > 0 && prompt.saturating_sub(cached) >= image,
        "the task is reused, not the screen: {u}"
    );
    assert_eq!(ureq::delete(&h.url(&format!("/v1/sessions/{id}"))).call().unwrap().status(), 204);
    let (code, _) = post(&h, &format!("/v1/sessions/{id}/step"), obs);
    assert_eq!(code, 404);

    // Chat completions: plain, then streamed (greedy, so the same text).
    let msg = json!([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", base64_encode(&png(64, 48)))}},
        {"type": "text", "text": "Describe the screen."}]}]);
    let (code, c) =
        post(&h, "/v1/chat/completions", json!({"model": "grad", "messages": msg, "max_tokens": 6, "temperature": 0}));
    assert_eq!(code, 200, "{c}");
    let text = c["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(c["usage"]["completion_tokens"].as_u64().unwrap() <= 6);
    let r = ureq::post(&h.url("/v1/chat/completions"))
        .send_json(json!({"model": "grad", "messages": msg, "max_tokens": 6, "temperature": 0, "stream": true}))
        .unwrap();
    let mut streamed = String::new();
    let mut done = false;
    for line in BufReader::new(r.into_reader()).lines() {
        let line = line.unwrap();
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            done = true;
            break;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        if let Some(t) = chunk["choices"][0]["delta"]["content"].as_str() {
            streamed.push_str(t);
        }
    }
    assert!(done, "no [DONE]");
    assert_eq!(streamed, text);

    // The official OpenAI Python client.
    match std::env::var("ASKGUI_OPENAI_PYTHON") {
        Err(_) => eprintln!("SKIPPED the OpenAI client check: set ASKGUI_OPENAI_PYTHON to a Python with `openai`"),
        Ok(py) => {
            let dir = std::env::temp_dir().join(format!("askgui-openai-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let img = dir.join("screen.png");
            std::fs::write(&img, png(96, 64)).unwrap();
            let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
            let out = std::process::Command::new(py)
                .arg(script)
                .arg(h.url("/v1"))
                .arg("grad")
                .arg(&img)
                .output()
                .expect("running the OpenAI client script");
            let _ = std::fs::remove_dir_all(&dir);
            eprintln!("{}", String::from_utf8_lossy(&out.stdout));
            assert!(out.status.success(), "OpenAI client failed: {}", String::from_utf8_lossy(&out.stderr));
        }
    }
    h.stop();
}
