//! The askgui-serve backend against a mock agent-API server on 127.0.0.1: the request it sends (path,
//! task, screenshot, screen, elements, history, adapter, options), the prediction it returns, retries on
//! 5xx / 429 / malformed answers / transport errors, no retry on other 4xx, and `--endpoint` on the
//! command line.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use askgui_data::agent_api::{
    AgentStepRequest, AgentStepResponse, ApiError, FrameInfo, StepOptions, Timings, Usage, ERROR_INVALID_REQUEST,
};
use askgui_data::{Action, Ask, Element, FrameKind, FrameMap, Platform, ResizeBounds, Screen, Target, Turn};
use askgui_eval::agent::{Agent, AgentError, Prediction, StepInput};
use askgui_eval::backends::{from_args, EndpointAgent, EndpointConfig};
use common::{args, screenshot};

fn history() -> Vec<Turn> {
    vec![
        Turn::Agent { action: Action::Click(Target::point(540, 220)) },
        Turn::Agent { action: Action::Ask(Ask { question: "Which size?".into(), options: vec![], kind: None }) },
        Turn::Say { text: "The 1 litre one.".into() },
    ]
}

fn step(screenshots: Vec<PathBuf>, history: Vec<Turn>) -> StepInput {
    StepInput {
        episode_id: "e1".into(),
        step: 1,
        task: "Buy oat milk".into(),
        history,
        screenshots,
        elements: Some(vec![Element {
            id: "e3".into(),
            role: "button".into(),
            text: "Search".into(),
            bbox: [40, 180, 1040, 260],
        }]),
        screen: Screen { width: 1080, height: 2400 },
        platform: Platform::Android,
    }
}

// ---------------------------------------------------------------------------------------------------
// The mock server.

/// One recorded request: the request line and headers, and the body.
type Request = (String, Vec<u8>);

/// A server that answers the scripted `(status, extra headers, body)` replies in turn (the last one from
/// then on) and records every request.
struct Mock {
    base: String,
    requests: Arc<Mutex<Vec<Request>>>,
}

impl Mock {
    fn count(&self) -> usize {
        self.requests.lock().unwrap().len()
    }
}

fn read_request(stream: &TcpStream) -> std::io::Result<Request> {
    let mut r = BufReader::new(stream);
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
        head.push_str(&line);
    }
    let length = head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case("content-length").then(|| v.trim().parse::<usize>().ok())?
    });
    let mut body = vec![0; length.unwrap_or(0)];
    r.read_exact(&mut body)?;
    Ok((head, body))
}

type Reply = (u16, &'static str, String);

fn mock(script: Vec<Reply>) -> Mock {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}/", listener.local_addr().unwrap());
    let requests = Arc::new(Mutex::new(Vec::new()));
    let seen = requests.clone();
    std::thread::spawn(move || {
        for (i, stream) in listener.incoming().enumerate() {
            let Ok(mut stream) = stream else { continue };
            let Ok(req) = read_request(&stream) else { continue };
            seen.lock().unwrap().push(req);
            let (status, headers, body) = &script[i.min(script.len() - 1)];
            let reply = format!(
                "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n{headers}Content-Length: {}\r\n\
                 Connection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(reply.as_bytes());
        }
    });
    Mock { base, requests }
}

/// The server's answer: a click in screen pixels and the same click in the resized frame.
fn answer() -> AgentStepResponse {
    let frame = FrameMap::new(FrameKind::Resized, 1080, 2400, ResizeBounds::default()).unwrap();
    let action = Action::Click(Target::point(540, 1210));
    let model_action = frame.action_to_model(&action);
    AgentStepResponse {
        raw: format!("Thought: the 1 litre carton.\n{}", model_action.render()),
        action,
        coordinates: None,
        screen_action: None,
        model_action,
        frame: FrameInfo::from(&frame),
        ask_probability: Some(0.03),
        usage: Usage { prompt_tokens: 1500, image_tokens: 1272, completion_tokens: 20, cached_tokens: 0 },
        timings: Timings { queue_ms: 0.1, preprocess_ms: 10.0, prefill_ms: 80.0, decode_ms: 60.0 },
    }
}

fn ok() -> Reply {
    (200, "", serde_json::to_string(&answer()).unwrap())
}

fn api_error(status: u16, message: &str) -> Reply {
    (status, "", serde_json::to_string(&ApiError::new(ApiError::kind_for_status(status), message)).unwrap())
}

fn agent(base: &str, retries: u32, adapter: Option<&str>) -> EndpointAgent {
    EndpointAgent::new(EndpointConfig {
        base: base.into(),
        adapter: adapter.map(String::from),
        timeout_s: 10.0,
        retries,
        backoff_ms: 1,
        options: StepOptions { max_tokens: Some(64), temperature: Some(0.0), ..StepOptions::default() },
        elements: true,
        history_images: None,
    })
    .unwrap()
}

fn expected() -> Prediction {
    let a = answer();
    Prediction { action: Some(a.action), raw: a.raw, parse_error: None, ask_probability: a.ask_probability }
}

// ---------------------------------------------------------------------------------------------------

#[test]
fn sends_the_step_and_returns_the_servers_action() {
    let m = mock(vec![ok()]);
    let shot = screenshot("endpoint-request", 54, 120);
    let input = step(vec![screenshot("endpoint-earlier", 20, 20), shot.clone()], history());
    let agent = agent(&m.base, 0, Some("lora-a"));
    assert_eq!(agent.url(), format!("{}v1/agent/step", m.base));
    assert_eq!(agent.name(), format!("askgui-serve lora-a @ {}", m.base.trim_end_matches('/')));
    assert_eq!(agent.predict(&input).unwrap(), expected());

    let reqs = m.requests.lock().unwrap();
    assert_eq!(reqs.len(), 1);
    let (head, body) = &reqs[0];
    assert!(head.starts_with("POST /v1/agent/step HTTP/1.1\r\n"), "{head}");
    assert!(head.to_ascii_lowercase().contains("content-type: application/json"), "{head}");
    assert!(!head.to_ascii_lowercase().contains("authorization"), "{head}");
    let req: AgentStepRequest = serde_json::from_slice(body).unwrap();
    assert_eq!(req.check(), Ok(()));
    assert_eq!(req.task, "Buy oat milk");
    // The current screenshot, byte for byte, as a PNG data URL.
    let url = req.observation.screenshot.as_deref().unwrap();
    assert!(url.starts_with("data:image/png;base64,iVBORw0KGgo"), "{}", &url[..40]);
    assert_eq!(req.observation.screenshot_bytes().unwrap().unwrap(), std::fs::read(&shot).unwrap());
    assert_eq!(req.observation.screen, Some(Screen { width: 1080, height: 2400 }));
    assert_eq!(req.observation.elements, input.elements);
    // The history in screen pixels, ASK and SAY turns included.
    assert_eq!(req.history, history());
    assert_eq!(req.adapter.as_deref(), Some("lora-a"));
    assert_eq!((req.options.max_tokens, req.options.temperature), (Some(64), Some(0.0)));
}

#[test]
fn without_elements_or_adapter_they_are_left_out() {
    let m = mock(vec![ok()]);
    let agent = EndpointAgent::new(EndpointConfig {
        base: m.base.trim_end_matches('/').into(),
        adapter: None,
        timeout_s: 10.0,
        retries: 0,
        backoff_ms: 1,
        options: StepOptions { max_tokens: Some(32), ..StepOptions::default() },
        elements: false,
        history_images: None,
    })
    .unwrap();
    assert_eq!(agent.name(), format!("askgui-serve @ {}", m.base.trim_end_matches('/')));
    let input = step(vec![screenshot("endpoint-plain", 30, 40)], vec![]);
    assert_eq!(agent.predict(&input).unwrap(), expected());
    let v: serde_json::Value = serde_json::from_slice(&m.requests.lock().unwrap()[0].1).unwrap();
    let obs = v["observation"].as_object().unwrap();
    assert!(!obs.contains_key("elements") && v.get("adapter").is_none() && v.get("history").is_none(), "{v}");
}

#[test]
fn server_errors_and_rate_limits_are_retried() {
    let input = step(vec![screenshot("endpoint-retry", 30, 40)], history());

    let m = mock(vec![api_error(500, "CUDA out of memory"), ok()]);
    assert_eq!(agent(&m.base, 2, None).predict(&input).unwrap(), expected());
    assert_eq!(m.count(), 2, "one retry after the 500");

    // A 429's Retry-After is waited out even though the backoff is 1 ms.
    let limited = serde_json::to_string(&ApiError::new("rate_limit_error", "queue full")).unwrap();
    let m = mock(vec![(429, "Retry-After: 1\r\n", limited), ok()]);
    let start = Instant::now();
    assert_eq!(agent(&m.base, 1, None).predict(&input).unwrap(), expected());
    assert!(start.elapsed() >= Duration::from_millis(950), "{:?}", start.elapsed());
    assert_eq!(m.count(), 2);

    // Out of retries: a transport error naming the last failure and the server's message.
    let m = mock(vec![api_error(503, "loading weights")]);
    let e = agent(&m.base, 1, None).predict(&input).unwrap_err();
    match &e {
        AgentError::Transport { reason, .. } => {
            assert!(reason.contains("503") && reason.contains("loading weights") && reason.contains("2 attempt"), "{e}")
        }
        other => panic!("expected a transport error, got {other}"),
    }
    assert_eq!(m.count(), 2);
}

#[test]
fn a_bad_request_is_rejected_with_the_servers_message_and_not_retried() {
    let input = step(vec![screenshot("endpoint-rejected", 30, 40)], history());
    let m = mock(vec![api_error(400, "adapter `lora-x` is not loaded"), ok()]);
    let e = agent(&m.base, 3, Some("lora-x")).predict(&input).unwrap_err();
    match &e {
        AgentError::Rejected { status: 400, body, url } => {
            assert!(body.contains("adapter `lora-x` is not loaded"), "{e}");
            assert!(body.contains(ERROR_INVALID_REQUEST), "{e}");
            assert!(url.ends_with("/v1/agent/step"), "{url}");
        }
        other => panic!("expected a rejection, got {other}"),
    }
    assert_eq!(m.count(), 1, "a 400 is not retried");

    // A 404 body that is not an ApiError is reported as it is.
    let m = mock(vec![(404, "", "no such route".into())]);
    let e = agent(&m.base, 3, None).predict(&input).unwrap_err();
    assert!(matches!(&e, AgentError::Rejected { status: 404, body, .. } if body == "no such route"), "{e}");
}

#[test]
fn a_200_that_is_not_an_answer_is_retried_then_reported() {
    let input = step(vec![screenshot("endpoint-malformed", 30, 40)], vec![]);
    let m = mock(vec![(200, "", r#"{"choices": [{"message": {"content": "hi"}}]}"#.into())]);
    let e = agent(&m.base, 1, None).predict(&input).unwrap_err();
    match &e {
        AgentError::Transport { reason, .. } => {
            assert!(reason.contains("not an agent step answer") && reason.contains("choices"), "{e}")
        }
        other => panic!("expected a transport error, got {other}"),
    }
    assert_eq!(m.count(), 2);

    let m = mock(vec![(200, "", "<html>gateway</html>".into()), ok()]);
    assert_eq!(agent(&m.base, 1, None).predict(&input).unwrap(), expected());
}

#[test]
fn transport_and_input_errors() {
    // Nothing listens on a port just released.
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let input = step(vec![screenshot("endpoint-transport", 30, 40)], vec![]);
    let e = agent(&format!("http://127.0.0.1:{port}"), 1, None).predict(&input).unwrap_err();
    assert!(matches!(&e, AgentError::Transport { reason, .. } if reason.contains("2 attempt")), "{e}");

    // No screenshot, or one that cannot be read: input errors before anything is sent.
    let m = mock(vec![ok()]);
    let e = agent(&m.base, 0, None).predict(&step(vec![], vec![])).unwrap_err();
    assert!(matches!(&e, AgentError::Input(r) if r.contains("no screenshot")), "{e}");
    let e = agent(&m.base, 0, None).predict(&step(vec![PathBuf::from("/nonexistent/shot.png")], vec![])).unwrap_err();
    assert!(matches!(&e, AgentError::Input(r) if r.contains("cannot read")), "{e}");
    let text = Path::new(env!("CARGO_TARGET_TMPDIR")).join("askgui-eval-endpoint-not-an-image.png");
    std::fs::write(&text, "hello").unwrap();
    let e = agent(&m.base, 0, None).predict(&step(vec![text], vec![])).unwrap_err();
    assert!(matches!(&e, AgentError::Input(r) if r.contains("not an image")), "{e}");
    assert_eq!(m.count(), 0);
}

#[test]
fn from_args_takes_endpoint_as_the_only_backend() {
    let ok = from_args(&args(&["--endpoint", "http://127.0.0.1:1/", "--endpoint-adapter", "lora-a"])).unwrap();
    assert_eq!(ok.name(), "askgui-serve lora-a @ http://127.0.0.1:1");
    let ok = from_args(&args(&["--endpoint", "https://serve.example:8443"])).unwrap();
    assert_eq!(ok.name(), "askgui-serve @ https://serve.example:8443");

    let err = |list: &[&str]| from_args(&args(list)).err().map(|e| format!("{e:#}")).unwrap_or_default();
    let with_model = err(&["--endpoint", "http://127.0.0.1:1", "--model", "some/checkpoint"]);
    assert!(with_model.contains("only one of") && with_model.contains("--endpoint"), "{with_model}");
    let with_openai = err(&["--endpoint", "http://127.0.0.1:1", "--openai-base", "http://127.0.0.1:1/v1"]);
    assert!(with_openai.contains("only one of"), "{with_openai}");
    let stray = err(&["--openai-base", "http://127.0.0.1:1/v1", "--openai-model", "m", "--endpoint-adapter", "a"]);
    assert!(stray.contains("--endpoint-adapter is for --endpoint"), "{stray}");
    let path_adapter = err(&["--endpoint", "http://127.0.0.1:1", "--adapter", "lora/"]);
    assert!(path_adapter.contains("--endpoint-adapter"), "{path_adapter}");
    let openai_model = err(&["--endpoint", "http://127.0.0.1:1", "--openai-model", "m"]);
    assert!(openai_model.contains("--openai-model is for --openai-base"), "{openai_model}");
    let bad = err(&["--endpoint", "localhost:8080"]);
    assert!(bad.contains("http://"), "{bad}");
    let v1 = err(&["--endpoint", "http://127.0.0.1:1/v1/"]);
    assert!(v1.contains("without /v1"), "{v1}");
    let empty = err(&["--endpoint", "http://127.0.0.1:1", "--endpoint-adapter", " "]);
    assert!(empty.contains("adapter name is empty"), "{empty}");
    assert!(err(&[]).contains("--endpoint"), "{}", err(&[]));
}
