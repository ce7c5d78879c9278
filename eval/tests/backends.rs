//! The backends end to end: the in-process model on the tiny random checkpoint of askgui-model's
//! fixtures, and the OpenAI-compatible backend against a mock server on 127.0.0.1 (the request it sends,
//! the conversion of the answer to screen pixels, retries on 5xx, no retry on 401).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use askgui_data::prompt::system_prompt;
use askgui_data::{Action, FrameKind, FrameMap, Platform, PromptConfig, ResizeBounds, Screen, Target, Turn};
use askgui_eval::agent::{Agent, AgentError, StepInput};
use askgui_eval::backends::{from_args, OpenAiAgent, OpenAiConfig};
use common::{args, screenshot};
use serde_json::{json, Value};

fn step(screenshots: Vec<PathBuf>, w: u32, h: u32, history: Vec<Turn>) -> StepInput {
    StepInput {
        episode_id: "e1".into(),
        step: history.len(),
        task: "Buy oat milk".into(),
        history,
        screenshots,
        elements: None,
        screen: Screen { width: w, height: h },
        platform: Platform::Android,
    }
}

// ---------------------------------------------------------------------------------------------------
// In-process.

const TINY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../model/tests/fixtures/tiny-qwen2_5_vl");

#[test]
fn in_process_random_model_answers_deterministically_with_the_servers_decoding() {
    let agent = from_args(&args(&["--model", TINY, "--max-new-tokens", "12", "--history-images", "1"])).unwrap();
    assert!(agent.name().contains("tiny-qwen2_5_vl"), "{}", agent.name());
    let shot = screenshot("backends-inprocess", 64, 48);
    let history = vec![Turn::Agent { action: Action::Click(Target::point(10, 20)) }];
    let input = step(vec![shot.clone()], 64, 48, history);
    // Constrained by default, as askgui-serve: even a random model's answer parses.
    let a = agent.predict(&input).unwrap();
    let action = a.action.clone().unwrap_or_else(|| panic!("a constrained answer parses: {:?}", a.raw));
    action.check().unwrap_or_else(|e| panic!("{e}: {action:?}"));
    let b = agent.predict(&input).unwrap();
    // The second answer reuses the first prompt's cached prefix: the same answer, its probability equal up
    // to float reassociation.
    assert!(a.same_answer(&b), "greedy decoding is deterministic: {a:?} vs {b:?}");
    // Two screenshots (history image + current) go through the same path.
    let two = step(vec![screenshot("backends-inprocess-earlier", 48, 64), shot.clone()], 64, 48, vec![]);
    assert!(agent.predict(&two).unwrap().action.is_some());
    // A missing screenshot is an input error, not a panic.
    let e = agent.predict(&step(vec![PathBuf::from("/nonexistent/shot.png")], 64, 48, vec![])).unwrap_err();
    assert!(matches!(e, AgentError::Input(_)), "{e}");
    // The server's options: `ask` at any probability >= 0, so always; free arguments after the forced
    // prefix and the scored name.
    let always = from_args(&args(&["--model", TINY, "--max-new-tokens", "12", "--pause-threshold", "0"])).unwrap();
    let p = always.predict(&input).unwrap();
    assert!(matches!(p.action, Some(Action::Ask(_))), "{p:?}");
    let free = from_args(&args(&["--model", TINY, "--max-new-tokens", "12", "--constrain", "false"])).unwrap();
    let p = free.predict(&input).unwrap();
    assert!(p.raw.starts_with("{\"action\":\""), "{p:?}");
    assert_eq!(p.action.is_some(), p.parse_error.is_none(), "{p:?}");
}

#[test]
fn from_args_wants_exactly_one_backend() {
    let err = |list: &[&str]| from_args(&args(list)).err().map(|e| format!("{e:#}")).unwrap_or_default();
    assert!(err(&[]).contains("--model"), "{}", err(&[]));
    let both = err(&["--model", TINY, "--openai-base", "http://127.0.0.1:1/v1", "--openai-model", "m"]);
    assert!(both.contains("not both"), "{both}");
    let adapter = err(&["--model", TINY, "--adapter", "no-such-adapter/"]);
    assert!(adapter.contains("no-such-adapter"), "{adapter}");
    let peft = concat!(env!("CARGO_MANIFEST_DIR"), "/../model/tests/fixtures/lora/tiny-qwen2_5_vl-peft");
    assert!(from_args(&args(&["--model", TINY, "--adapter", peft])).is_ok(), "the PEFT fixture adapter must load");
    // askgui-serve's NAME=DIR is taken too (the name is not needed in-process).
    let named = args(&["--model", TINY, "--adapter", &format!("ask={peft}")]);
    assert_eq!(named.adapter.as_deref(), Some(std::path::Path::new(peft)));
    let no_name = err(&["--openai-base", "http://127.0.0.1:1/v1"]);
    assert!(no_name.contains("--openai-model"), "{no_name}");
    let bad_base = err(&["--openai-base", "localhost:8000", "--openai-model", "m"]);
    assert!(bad_base.contains("http://"), "{bad_base}");
    let ok = from_args(&args(&[
        "--openai-base",
        "http://127.0.0.1:1/v1/",
        "--openai-model",
        "m",
        "--frame",
        "relative1000",
    ]));
    assert_eq!(ok.unwrap().name(), "m @ http://127.0.0.1:1/v1");
}

// ---------------------------------------------------------------------------------------------------
// OpenAI-compatible, against a mock server.

/// A server that answers the scripted `(status, body)` responses in turn (the last one from then on) and
/// records each request's headers and JSON body.
struct Mock {
    base: String,
    requests: Arc<Mutex<Vec<(String, Value)>>>,
}

fn read_request(stream: &TcpStream) -> std::io::Result<(String, Value)> {
    let mut r = BufReader::new(stream);
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
        head.push_str(&line);
    }
    let header = |name: &str| {
        head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
    };
    let mut body = Vec::new();
    if let Some(n) = header("content-length").and_then(|v| v.parse::<usize>().ok()) {
        body.resize(n, 0);
        r.read_exact(&mut body)?;
    } else if header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        loop {
            let mut size = String::new();
            r.read_line(&mut size)?;
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            let mut chunk = vec![0; n + 2];
            r.read_exact(&mut chunk)?;
            if n == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
    }
    Ok((head, serde_json::from_slice(&body).unwrap_or(Value::Null)))
}

fn mock(script: Vec<(u16, String)>) -> Mock {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}/v1", listener.local_addr().unwrap());
    let requests = Arc::new(Mutex::new(Vec::new()));
    let seen = requests.clone();
    std::thread::spawn(move || {
        for (i, stream) in listener.incoming().enumerate() {
            let Ok(mut stream) = stream else { continue };
            let Ok(req) = read_request(&stream) else { continue };
            seen.lock().unwrap().push(req);
            let (status, body) = &script[i.min(script.len() - 1)];
            let reply = format!(
                "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(reply.as_bytes());
        }
    });
    Mock { base, requests }
}

fn completion(content: &str) -> (u16, String) {
    (200, json!({"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}).to_string())
}

fn agent(base: &str, frame: FrameKind, retries: u32) -> OpenAiAgent {
    OpenAiAgent::new(OpenAiConfig {
        base: base.into(),
        model: "qwen-test".into(),
        api_key: Some("sk-test".into()),
        timeout_s: 10.0,
        retries,
        backoff_ms: 1,
        max_tokens: 64,
        prompt: PromptConfig { frame, ..Default::default() },
    })
    .unwrap()
}

#[test]
fn openai_sends_the_prompt_and_converts_the_answer_to_screen_pixels() {
    let (w, h) = (1080, 2400);
    for kind in [FrameKind::Resized, FrameKind::Relative1000] {
        let frame = FrameMap::new(kind, w, h, ResizeBounds::default()).unwrap();
        let (mx, my) = (frame.model.0 as i32 / 2, frame.model.1 as i32 / 3);
        let m = mock(vec![completion(&format!(
            "Thought: the search box.\n{{\"action\":\"click\",\"x\":{mx},\"y\":{my}}}"
        ))]);
        let shot = screenshot("backends-openai", 54, 120);
        let earlier = Action::Click(Target::point(540, 1200));
        let input = step(vec![shot], w, h, vec![Turn::Agent { action: earlier.clone() }]);
        let p = agent(&m.base, kind, 0).predict(&input).unwrap();
        let (sx, sy) = frame.to_screen(mx, my);
        assert_eq!(p.action, Some(Action::Click(Target::point(sx, sy))), "{kind:?}");
        assert!(p.parse_error.is_none() && p.raw.starts_with("Thought:"));

        let reqs = m.requests.lock().unwrap();
        assert_eq!(reqs.len(), 1);
        let (head, body) = &reqs[0];
        assert!(head.starts_with("POST /v1/chat/completions "), "{head}");
        assert!(head.to_ascii_lowercase().contains("authorization: bearer sk-test"), "{head}");
        assert_eq!(body["model"], "qwen-test");
        assert_eq!(body["temperature"], 0);
        assert_eq!(body["max_tokens"], 64);
        let msgs = body["messages"].as_array().unwrap();
        assert_eq!(msgs[0]["role"], "system");
        assert_eq!(msgs[0]["content"], system_prompt(kind));
        assert_eq!(msgs[1]["role"], "user");
        let parts = msgs[1]["content"].as_array().unwrap();
        let texts: String = parts.iter().filter_map(|p| p["text"].as_str()).collect();
        assert!(texts.contains("Task: Buy oat milk"), "{texts}");
        // The history is in the model frame.
        assert!(texts.contains(&frame.action_to_model(&earlier).render()), "{texts}");
        let images: Vec<&str> = parts.iter().filter_map(|p| p["image_url"]["url"].as_str()).collect();
        assert_eq!(images.len(), 1);
        assert!(images[0].starts_with("data:image/png;base64,iVBORw0KGgo"), "{}", &images[0][..40]);
    }
}

#[test]
fn openai_unparseable_reply_is_a_prediction_without_an_action() {
    let m = mock(vec![completion("I would tap the search box.")]);
    let input = step(vec![screenshot("backends-openai-unparsed", 40, 30)], 400, 300, vec![]);
    let p = agent(&m.base, FrameKind::Resized, 0).predict(&input).unwrap();
    assert_eq!(p.action, None);
    assert_eq!(p.raw, "I would tap the search box.");
    assert!(p.parse_error.as_deref().is_some_and(|e| e.contains("no JSON object")), "{p:?}");
}

#[test]
fn openai_retries_server_errors_and_not_rejections() {
    let input = step(vec![screenshot("backends-openai-retry", 40, 30)], 400, 300, vec![]);

    let m =
        mock(vec![(500, r#"{"error":"overloaded"}"#.into()), completion(r#"{"action":"done","status":"success"}"#)]);
    let p = agent(&m.base, FrameKind::Resized, 2).predict(&input).unwrap();
    assert_eq!(p.action, Some(Action::Done { status: askgui_data::DoneStatus::Success }));
    assert_eq!(m.requests.lock().unwrap().len(), 2, "one retry after the 500");

    let m = mock(vec![(401, r#"{"error":"bad key"}"#.into())]);
    let e = agent(&m.base, FrameKind::Resized, 2).predict(&input).unwrap_err();
    match &e {
        AgentError::Rejected { status: 401, body, .. } => assert!(body.contains("bad key"), "{e}"),
        other => panic!("expected a rejection, got {other}"),
    }
    assert_eq!(m.requests.lock().unwrap().len(), 1, "a 401 is not retried");

    let m = mock(vec![(503, "busy".into())]);
    let e = agent(&m.base, FrameKind::Resized, 1).predict(&input).unwrap_err();
    assert!(
        matches!(&e, AgentError::Transport { reason, .. } if reason.contains("503") && reason.contains("2 attempt")),
        "{e}"
    );
    assert_eq!(m.requests.lock().unwrap().len(), 2);

    // A 200 that is not a completion is retried too, then reported.
    let m = mock(vec![(200, r#"{"object":"error"}"#.into())]);
    let e = agent(&m.base, FrameKind::Resized, 0).predict(&input).unwrap_err();
    assert!(e.to_string().contains("choices[0].message.content"), "{e}");
}
