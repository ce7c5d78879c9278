//! Every endpoint over real HTTP against the stub backend: the agent step, a session through ASK and
//! SAY, chat completions (plain and streamed), models, health while loading / failed / ready, metrics,
//! the API key, and the failure statuses (404, 405, 409, 413, 429, 500, 503), batching and cancellation.

mod common;

use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use askgui_serve::stub::{StubBackend, StubLog};
use common::*;
use serde_json::{json, Value};

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < Duration::from_secs(20), "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn the_png_crc_helper_is_right() {
    assert_eq!(crc32(b"IEND"), 0xae42_6082);
}

#[test]
fn agent_step_answers_in_screen_pixels() {
    let (server, _) = serve();
    let r = post(&server.url("/v1/agent/step"), &step_body("Open the settings", 64, 48));
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.content_type.starts_with("application/json"));
    let v = r.json();
    assert_eq!(v["action"], json!({"action": "click", "x": 32, "y": 24}));
    assert_eq!(v["frame"]["kind"], "screen");
    assert_eq!(v["frame"]["screen"], json!({"width": 64, "height": 48}));
    assert_eq!(v["usage"]["image_tokens"], 4);
    let resp: askgui_data::agent_api::AgentStepResponse = serde_json::from_value(v).unwrap();
    assert_eq!(resp.model_action, resp.action);

    // A task with a question mark makes the stub ask; the adapter is known.
    let mut body = step_body("Buy the milk?", 20, 20);
    body["adapter"] = json!(ADAPTER);
    let r = post(&server.url("/v1/agent/step"), &body);
    assert_eq!((r.status, r.json()["action"]["action"].as_str()), (200, Some("ask")), "{}", r.body);

    // An unknown adapter is the client's error, and the message lists what there is.
    body["adapter"] = json!("other-lora");
    let r = post(&server.url("/v1/agent/step"), &body);
    assert_eq!(r.status, 400);
    assert!(r.message().contains("other-lora") && r.message().contains(ADAPTER), "{}", r.body);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");

    // Elements and a screen instead of a screenshot.
    let r = post(
        &server.url("/v1/agent/step"),
        &json!({"task": "t", "observation": {"elements": [], "screen": {"width": 100, "height": 50}}}),
    );
    assert_eq!((r.status, &r.json()["action"]), (200, &json!({"action": "click", "x": 50, "y": 25})));
    server.stop();
}

#[test]
fn a_session_asks_takes_the_answer_and_goes_on() {
    let (server, _) = serve();
    let r = post(&server.url("/v1/sessions"), &json!({"task": "Buy the milk?", "options": {"max_tokens": 32}}));
    assert_eq!(r.status, 201, "{}", r.body);
    let id = r.json()["id"].as_str().unwrap().to_string();
    assert!(id.len() == 32 && id.chars().all(|c| c.is_ascii_hexdigit()), "{id}");
    assert_eq!(r.json()["expires_in"], 1800);
    let session = server.url(&format!("/v1/sessions/{id}"));
    let obs = json!({"observation": {"screenshot": data_url(&png(40, 30))}});

    // Step 1: the agent asks.
    let r = post(&format!("{session}/step"), &obs);
    assert_eq!((r.status, r.json()["action"]["action"].as_str()), (200, Some("ask")), "{}", r.body);
    let v = get(&session).json();
    assert_eq!((v["waiting_for_answer"].as_bool(), v["history"].as_array().map(Vec::len)), (Some(true), Some(1)));
    assert_eq!((v["task"].as_str(), v["id"].as_str()), (Some("Buy the milk?"), Some(id.as_str())));
    assert!(v["created"].as_u64().unwrap() > 1_700_000_000 && v["expires_in"].as_u64().unwrap() <= 1800);

    // The user answers; the agent goes on with the answer in its history.
    let r = post(&format!("{session}/say"), &json!({"text": "Oat milk, please."}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["history"][1], json!({"turn": "say", "text": "Oat milk, please."}));
    let r = post(&format!("{session}/step"), &obs);
    assert_eq!(r.json()["action"], json!({"action": "click", "x": 20, "y": 15}), "{}", r.body);
    let v = get(&session).json();
    assert_eq!((v["waiting_for_answer"].as_bool(), v["history"].as_array().map(Vec::len)), (Some(false), Some(3)));

    // Nothing to answer now; an empty answer; then delete.
    assert_eq!(post(&format!("{session}/say"), &json!({"text": "what?"})).status, 409);
    assert_eq!(post(&format!("{session}/say"), &json!({"text": " "})).status, 400);
    assert_eq!(send("DELETE", &session, None, None).status, 204);
    for r in [get(&session), post(&format!("{session}/step"), &obs), send("DELETE", &session, None, None)] {
        assert_eq!(r.status, 404, "{}", r.body);
        assert!(r.message().contains("no session"), "{}", r.body);
    }
    // Bad creations.
    assert_eq!(post(&server.url("/v1/sessions"), &json!({"task": ""})).status, 400);
    assert_eq!(post(&server.url("/v1/sessions"), &json!({"task": "t", "adapter": "nope"})).status, 400);
    assert_eq!(post(&server.url("/v1/sessions"), &json!({"task": "t", "adapter": ADAPTER})).status, 201);
    server.stop();
}

#[test]
fn agent_step_answers_in_the_frame_the_request_asks_for() {
    let (server, _) = serve();
    let url = server.url("/v1/agent/step");
    // The stub clicks the centre of a 64x48 screen: (32, 24). Pixel centres scale: (v + 0.5) * to / from
    // - 0.5, rounded. Relative 0..1000: x = 32.5 * 15.625 - 0.5 = 507.3 -> 507, y = 24.5 * 20.833 - 0.5
    // = 509.9 -> 510.
    let mut body = step_body("Open the settings", 64, 48);
    body["options"] = json!({"coordinates": {"frame": "relative1000"}});
    let v = post(&url, &body).json();
    assert_eq!(v["action"], json!({"action": "click", "x": 507, "y": 510}), "{v}");
    assert_eq!(v["screen_action"], json!({"action": "click", "x": 32, "y": 24}));
    assert_eq!(v["coordinates"], json!({"frame": "relative1000"}));
    // A declared grounding size of 1920x1080: x = 32.5 * 30 - 0.5 = 974.5 -> 975, y = 24.5 * 22.5 - 0.5
    // = 550.75 -> 551.
    body["options"] = json!({"coordinates": {"frame": "grounding", "width": 1920, "height": 1080}});
    let v = post(&url, &body).json();
    assert_eq!(v["action"], json!({"action": "click", "x": 975, "y": 551}), "{v}");
    // Screen pixels, asked for or not, answer as before: no second action.
    body["options"] = json!({"coordinates": {"frame": "screen"}});
    let v = post(&url, &body).json();
    assert_eq!((&v["action"], v.get("screen_action")), (&json!({"action": "click", "x": 32, "y": 24}), None));
    // A grounding size that cannot be is the client's error, named.
    body["options"] = json!({"coordinates": {"frame": "grounding", "width": 0, "height": 1080}});
    let r = post(&url, &body);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.message().contains("options.coordinates"), "{}", r.body);
    server.stop();
}

#[test]
fn a_session_remembers_the_users_answers_and_statements_across_tasks() {
    let (server, log) = serve();
    let r = post(&server.url("/v1/sessions"), &json!({"task": "Buy the milk?", "remember": ["I am vegan."]}));
    assert_eq!(r.status, 201, "{}", r.body);
    let session = server.url(&format!("/v1/sessions/{}", r.json()["id"].as_str().unwrap()));
    let obs = json!({"observation": {"screenshot": data_url(&png(40, 30))}});
    // Task 1: the agent asks, the user answers, the agent acts.
    assert_eq!(post(&format!("{session}/step"), &obs).json()["action"]["action"], "ask");
    assert_eq!(post(&format!("{session}/say"), &json!({"text": "Oat milk, please."})).status, 200);
    assert_eq!(post(&format!("{session}/step"), &obs).json()["action"]["action"], "click");

    // Task 2 in the same session: the statements (first, each on its own) and the answered question are
    // kept, the actions are not.
    let r = post(&format!("{session}/tasks"), &json!({"task": "Order a coffee", "remember": ["Deliver after 6 pm."]}));
    assert_eq!(r.status, 200, "{}", r.body);
    let say = |t: &str| json!({"turn": "say", "text": t});
    let ask = json!({"turn": "agent", "action": {"action": "ask", "question": "Which one do you mean?", "kind": "specification"}});
    let memory = json!([say("I am vegan."), say("Deliver after 6 pm."), ask, say("Oat milk, please.")]);
    let v = get(&session).json();
    assert_eq!((&v["memory"], &v["history"], &v["task"]), (&memory, &json!([]), &json!("Order a coffee")));
    assert_eq!(post(&format!("{session}/step"), &obs).status, 200);

    // What the model was asked in task 2: its prompt (the training prompt of that request) holds them.
    let req = log.step_requests().pop().expect("a step");
    assert_eq!(req.task, "Order a coffee");
    let frame = askgui_data::FrameMap::new(askgui_data::FrameKind::Screen, 40, 30, Default::default()).unwrap();
    let ctx = askgui_data::prompt::StepContext {
        task: &req.task,
        history: &req.history,
        screenshots: vec!["shot".into()],
        elements: None,
        frame,
        system: askgui_data::SystemPrompt::Full,
        language: askgui_data::ActionLanguage::AskguiJson,
    };
    let prompt = askgui_data::render_chatml(&askgui_data::step_messages(&ctx).unwrap(), true).text;
    for line in
        ["SAY: I am vegan.", "ASK: Which one do you mean?", "SAY: Oat milk, please.", "SAY: Deliver after 6 pm."]
    {
        assert!(prompt.contains(line), "{line} not in task 2's prompt:\n{prompt}");
    }
    // Bad next tasks.
    let r = post(&format!("{session}/tasks"), &json!({"task": "x", "remember": [" "]}));
    assert!(r.status == 400 && r.message().contains("remember[0]"), "{}", r.body);
    assert_eq!(post(&format!("{session}/tasks"), &json!({"task": " "})).status, 400);
    assert_eq!(post(&server.url("/v1/sessions/0123/tasks"), &json!({"task": "x"})).status, 404);
    server.stop();
}

/// The user leaves the agent's question unanswered and goes on with a statement to remember: the model of
/// the next task must not read that statement as the answer, so the question is not carried over.
#[test]
fn an_unanswered_ask_stays_out_of_the_next_tasks_memory() {
    let (server, log) = serve();
    let r = post(&server.url("/v1/sessions"), &json!({"task": "Buy the milk?"}));
    let session = server.url(&format!("/v1/sessions/{}", r.json()["id"].as_str().unwrap()));
    let obs = json!({"observation": {"screenshot": data_url(&png(40, 30))}});
    assert_eq!(post(&format!("{session}/step"), &obs).json()["action"]["action"], "ask");
    let r = post(&format!("{session}/tasks"), &json!({"task": "Order a coffee", "remember": ["I am vegan."]}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["memory"], json!([{"turn": "say", "text": "I am vegan."}]));
    assert_eq!(post(&format!("{session}/step"), &obs).status, 200);
    let req = log.step_requests().pop().expect("a step");
    assert_eq!(req.history, [askgui_data::Turn::Say { text: "I am vegan.".into() }], "what the model was given");
    server.stop();
}

#[test]
fn sessions_are_capped_and_steps_on_one_session_do_not_overlap() {
    let mut cfg = config();
    cfg.max_sessions = 2;
    let (server, log) = serve_with(cfg);
    let create = |task: &str| post(&server.url("/v1/sessions"), &json!({"task": task}));
    let id = create("STUB_BLOCK").json()["id"].as_str().unwrap().to_string();
    assert_eq!(create("second").status, 201);
    let r = create("third");
    assert_eq!((r.status, r.retry_after.as_deref()), (429, Some("1")), "{}", r.body);

    let step = server.url(&format!("/v1/sessions/{id}/step"));
    let obs = json!({"observation": {"screenshot": data_url(&png(8, 8))}});
    let (s, o) = (step.clone(), obs.clone());
    let first = std::thread::spawn(move || post(&s, &o));
    wait_until("the first step holds the backend", || log.is_blocked());
    let r = post(&step, &obs);
    assert_eq!(r.status, 409, "{}", r.body);
    assert!(r.message().contains("in progress"));
    log.release();
    assert_eq!(first.join().unwrap().status, 200);
    assert_eq!(post(&step, &obs).status, 200, "the session is free again");
    server.stop();
}

#[test]
fn an_idle_session_expires() {
    let mut cfg = config();
    cfg.session_ttl = 1;
    let (server, _) = serve_with(cfg);
    let r = post(&server.url("/v1/sessions"), &json!({"task": "t"}));
    assert_eq!(r.json()["expires_in"], 1);
    let session = server.url(&format!("/v1/sessions/{}", r.json()["id"].as_str().unwrap()));
    assert_eq!(get(&session).status, 200);
    std::thread::sleep(Duration::from_millis(1300));
    assert_eq!(get(&session).status, 404);
    assert_eq!(get(&server.url("/health")).json()["live_sessions"], 0);
    server.stop();
}

fn sse_events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| e.strip_prefix("data: ").unwrap_or_else(|| panic!("not an SSE data line: {e:?}")).to_string())
        .collect()
}

#[test]
fn chat_completions_plain_and_streamed() {
    let (server, _) = serve();
    let url = server.url("/v1/chat/completions");
    let messages = json!([
        {"role": "system", "content": "You are a GUI agent."},
        {"role": "user", "content": [
            {"type": "text", "text": "one two three"},
            {"type": "image_url", "image_url": {"url": data_url(&png(16, 16)), "detail": "high"}}
        ]}
    ]);
    let r = post(&url, &json!({"model": MODEL, "messages": messages, "temperature": 0, "future_field": [1]}));
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.message().starts_with("unknown field `future_field`; the known fields of the request are: model,"));
    let r = post(&url, &json!({"model": MODEL, "messages": messages, "temperature": 0, "user": "u-7", "seed": 3}));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!((v["object"].as_str(), v["model"].as_str()), (Some("chat.completion"), Some(MODEL)));
    assert_eq!(v["choices"][0]["message"], json!({"role": "assistant", "content": "echo: one two three"}));
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let u = &v["usage"];
    assert_eq!(u["completion_tokens"], 4);
    assert_eq!(u["total_tokens"].as_u64(), Some(u["prompt_tokens"].as_u64().unwrap() + 4));

    // An adapter by name, a token cap, stop strings.
    let r = post(&url, &json!({"model": ADAPTER, "messages": messages, "max_completion_tokens": 2}));
    assert_eq!(r.json()["choices"][0]["message"]["content"], "echo: one");
    assert_eq!(r.json()["choices"][0]["finish_reason"], "length");
    let r = post(&url, &json!({"model": MODEL, "messages": [{"role": "user", "content": "a b c"}], "stop": [" b"]}));
    assert_eq!(r.json()["choices"][0]["message"]["content"], "echo: a", "{}", r.body);

    // Streamed: a role chunk, content pieces that add up to the answer, a finish chunk, usage, [DONE].
    let body = json!({"model": MODEL, "messages": messages, "stream": true, "stream_options": {"include_usage": true}});
    let r = post(&url, &body);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.content_type.starts_with("text/event-stream"), "{}", r.content_type);
    let events = sse_events(&r.body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{events:?}");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk" && c["id"] == chunks[0]["id"]));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect::<Vec<_>>().concat();
    assert_eq!(text, "echo: one two three");
    assert!(chunks.iter().filter(|c| c["choices"][0]["delta"]["content"].is_string()).count() >= 4);
    let finish: Vec<&Value> = chunks.iter().filter(|c| !c["choices"][0]["finish_reason"].is_null()).collect();
    assert_eq!(finish.len(), 1);
    assert_eq!(finish[0]["choices"][0]["finish_reason"], "stop");
    let usage = chunks.last().unwrap();
    assert_eq!((usage["choices"].as_array().map(Vec::len), &usage["usage"]["completion_tokens"]), (Some(0), &json!(4)));

    // A prompt over the context is a 400 even when streaming: nothing was sent yet.
    let over = json!({"model": MODEL, "stream": true, "messages": [{"role": "user", "content": "STUB_OVERFLOW"}]});
    let r = post(&url, &over);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.message().contains("context"), "{}", r.body);

    // Refusals.
    let r = post(&url, &json!({"model": "gpt-4o", "messages": messages}));
    assert_eq!((r.status, r.json()["error"]["code"].as_str()), (404, Some("model_not_found")), "{}", r.body);
    let remote = json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]);
    let r = post(&url, &json!({"model": MODEL, "messages": remote}));
    assert_eq!(r.status, 400);
    assert!(r.message().contains("data URL"), "{}", r.body);
    let gif = json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/gif;base64,R0lG"}}]}]);
    assert_eq!(post(&url, &json!({"model": MODEL, "messages": gif})).status, 400);
    assert_eq!(post(&url, &json!({"model": MODEL, "messages": messages, "n": 2})).status, 400);
    assert_eq!(post(&url, &json!({"model": MODEL, "messages": []})).status, 400);
    assert_eq!(post(&url, &json!({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]})).status, 400);
    assert_eq!(post(&url, &json!({"model": MODEL, "messages": messages, "temperature": 3})).status, 400);
    assert_eq!(post(&url, &json!({"model": MODEL, "messages": messages, "max_tokens": 100000})).status, 400);
    server.stop();
}

#[test]
fn models_lists_the_base_model_and_the_adapters() {
    let (server, _) = serve();
    let v = get(&server.url("/v1/models")).json();
    assert_eq!(v["object"], "list");
    let ids: Vec<&str> = v["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, [MODEL, ADAPTER]);
    assert!(v["data"].as_array().unwrap().iter().all(|m| m["object"] == "model" && m["owned_by"] == "askgui"));
    server.stop();
}

#[test]
fn health_says_loading_until_the_backend_is_built() {
    let (release, wait) = mpsc::channel::<()>();
    let factory: askgui_serve::BackendFactory = Box::new(move || {
        let _ = wait.recv();
        Ok(Box::new(StubBackend::new(MODEL, &[ADAPTER])) as _)
    });
    let server = askgui_serve::start(config(), factory).unwrap();
    let r = get(&server.url("/health"));
    assert_eq!((r.status, r.json()["status"].as_str()), (503, Some("loading")), "{}", r.body);
    for r in [
        post(&server.url("/v1/agent/step"), &step_body("t", 8, 8)),
        post(
            &server.url("/v1/chat/completions"),
            &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
        ),
        get(&server.url("/v1/models")),
    ] {
        assert_eq!((r.status, r.retry_after.as_deref()), (503, Some("1")), "{}", r.body);
        assert!(r.message().contains("loading"), "{}", r.body);
    }
    release.send(()).unwrap();
    wait_ready(&server);
    let v = get(&server.url("/health")).json();
    // The stub claims no pause levels: an empty map.
    let ok = json!({"status": "ok", "model": MODEL, "adapters": [ADAPTER], "pause_thresholds": {}, "history_images": 0,
                    "queue_depth": 0, "live_sessions": 0});
    assert_eq!(v, ok);
    server.stop();
}

#[test]
fn a_failed_load_is_reported_by_health_and_every_inference() {
    let factory: askgui_serve::BackendFactory = Box::new(|| Err("no config.json in /models/x".into()));
    let server = askgui_serve::start(config(), factory).unwrap();
    wait_until("the load fails", || get(&server.url("/health")).json()["status"] == "failed");
    let r = get(&server.url("/health"));
    assert_eq!(r.status, 503);
    assert!(r.json()["error"].as_str().unwrap().contains("no config.json"), "{}", r.body);
    let r = post(&server.url("/v1/agent/step"), &step_body("t", 8, 8));
    assert_eq!(r.status, 503);
    assert!(r.message().contains("no config.json"), "{}", r.body);

    let panicking: askgui_serve::BackendFactory = Box::new(|| panic!("weights corrupted"));
    let server = askgui_serve::start(config(), panicking).unwrap();
    wait_until("the load fails", || get(&server.url("/health")).json()["status"] == "failed");
    assert!(get(&server.url("/health")).json()["error"].as_str().unwrap().contains("weights corrupted"));
}

#[test]
fn metrics_count_by_route_pattern() {
    let (server, _) = serve();
    let id = post(&server.url("/v1/sessions"), &json!({"task": "t"})).json()["id"].as_str().unwrap().to_string();
    let obs = json!({"observation": {"screenshot": data_url(&png(8, 8))}});
    assert_eq!(post(&server.url(&format!("/v1/sessions/{id}/step")), &obs).status, 200);
    assert_eq!(get(&server.url(&format!("/v1/sessions/{id}"))).status, 200);
    assert_eq!(get(&server.url("/no/such/route")).status, 404);
    post(
        &server.url("/v1/chat/completions"),
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "a b"}]}),
    );
    let r = get(&server.url("/metrics"));
    assert_eq!(r.status, 200);
    assert!(r.content_type.starts_with("text/plain"), "{}", r.content_type);
    let m = r.body;
    for line in [
        "askgui_requests_total{route=\"/v1/sessions\",status=\"201\"} 1",
        "askgui_requests_total{route=\"/v1/sessions/{id}/step\",status=\"200\"} 1",
        "askgui_requests_total{route=\"/v1/sessions/{id}\",status=\"200\"} 1",
        "askgui_requests_total{route=\"unmatched\",status=\"404\"} 1",
        "askgui_request_duration_seconds_bucket{route=\"/v1/sessions/{id}/step\",le=\"+Inf\"} 1",
        "askgui_request_duration_seconds_count{route=\"/v1/chat/completions\"} 1",
        "askgui_batch_size_count 2",
        "askgui_queue_depth 0",
        "askgui_live_sessions 1",
        "askgui_tokens_total{kind=\"completion\"} 4",
        "# TYPE askgui_request_duration_seconds histogram",
    ] {
        assert!(m.lines().any(|l| l == line), "no `{line}` in:\n{m}");
    }
    assert!(!m.contains(&id) && !m.contains("no/such"), "raw paths leaked into labels:\n{m}");
    server.stop();
}

#[test]
fn the_api_key_guards_everything_but_health_and_metrics() {
    let mut cfg = config();
    cfg.api_key = Some("s3cret-key".into());
    let (server, _) = serve_with(cfg);
    let url = server.url("/v1/agent/step");
    let body = step_body("t", 8, 8).to_string();
    for key in [None, Some("wrong"), Some("s3cret-ke"), Some("s3cret-key2")] {
        let r = send("POST", &url, Some(body.as_bytes()), key);
        assert_eq!((r.status, r.json()["error"]["type"].as_str()), (401, Some("invalid_request_error")), "{key:?}");
        assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    }
    assert_eq!(send("POST", &url, Some(body.as_bytes()), Some("s3cret-key")).status, 200);
    assert_eq!(send("GET", &server.url("/v1/models"), None, None).status, 401);
    assert_eq!(send("GET", &server.url("/v1/models"), None, Some("s3cret-key")).status, 200);
    assert_eq!(get(&server.url("/health")).status, 200);
    assert_eq!(get(&server.url("/metrics")).status, 200);
    server.stop();
}

#[test]
fn a_body_over_the_limit_is_413() {
    let mut cfg = config();
    cfg.max_body_bytes = 64 * 1024;
    let (server, _) = serve_with(cfg);
    let body = json!({"task": "x".repeat(100_000), "observation": {"screenshot": "aGk="}}).to_string();
    let r = send("POST", &server.url("/v1/agent/step"), Some(body.as_bytes()), None);
    assert_eq!(r.status, 413, "{}", r.body);
    assert!(r.message().contains("65536"), "{}", r.body);
    assert_eq!(post(&server.url("/v1/agent/step"), &step_body("t", 8, 8)).status, 200);
    server.stop();
}

#[test]
fn a_full_queue_is_429_and_waiting_jobs_are_batched() {
    let mut cfg = config();
    cfg.max_queue = 3;
    cfg.max_batch = 8;
    let (server, log) = serve_with(cfg);
    let url = server.url("/v1/agent/step");
    let (u, b) = (url.clone(), step_body("STUB_BLOCK", 8, 8));
    let blocker = std::thread::spawn(move || post(&u, &b));
    wait_until("the backend is held", || log.is_blocked());
    let waiting: Vec<_> = (0..3)
        .map(|i| {
            let (u, b) = (url.clone(), step_body(&format!("task {i}"), 8, 8));
            std::thread::spawn(move || post(&u, &b))
        })
        .collect();
    wait_until("three jobs wait", || server.state().engine.queue_depth() == 3);
    let r = post(&url, &step_body("one too many", 8, 8));
    assert_eq!((r.status, r.retry_after.as_deref()), (429, Some("1")), "{}", r.body);
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    log.release();
    assert_eq!(blocker.join().unwrap().status, 200);
    for t in waiting {
        assert_eq!(t.join().unwrap().status, 200);
    }
    // The three that waited were run as one batch.
    assert_eq!(log.batches(), [1, 3]);
    server.stop();
}

#[test]
fn a_backend_panic_is_a_500_for_that_request_only() {
    let (server, _) = serve();
    let url = server.url("/v1/agent/step");
    let r = post(&url, &step_body("STUB_PANIC", 8, 8));
    assert_eq!((r.status, r.json()["error"]["type"].as_str()), (500, Some("server_error")), "{}", r.body);
    assert_eq!(post(&url, &step_body("fine", 8, 8)).status, 200);
    let r = post(&url, &step_body("STUB_FAIL", 8, 8));
    assert_eq!(r.status, 500);
    assert!(r.message().contains("told to fail"), "{}", r.body);
    let r = post(&url, &step_body("STUB_OVERFLOW", 8, 8));
    assert_eq!(r.status, 400);
    assert!(r.message().contains("context"), "{}", r.body);
    let chat = json!({"model": MODEL, "stream": true, "messages": [{"role": "user", "content": "STUB_PANIC"}]});
    assert_eq!(post(&server.url("/v1/chat/completions"), &chat).status, 500);
    assert_eq!(get(&server.url("/health")).status, 200);
    assert!(get(&server.url("/metrics")).body.contains("askgui_backend_panics_total 2"));
    server.stop();
}

#[test]
fn a_client_that_leaves_cancels_its_job() {
    let (server, log) = serve();
    let impatient = ureq::AgentBuilder::new().timeout(Duration::from_millis(300)).build();
    let body = step_body("STUB_WAIT_CANCEL", 8, 8).to_string();
    let r = try_send(&impatient, "POST", &server.url("/v1/agent/step"), Some(body.as_bytes()), None);
    assert!(r.is_err(), "the request should have timed out: {r:?}");
    wait_until("the stub sees the cancellation", || log.cancelled() == 1);

    // The same for a stream the client drops.
    let chat = json!({"model": MODEL, "stream": true, "messages": [{"role": "user", "content": "STUB_WAIT_CANCEL"}]});
    let r = try_send(&impatient, "POST", &server.url("/v1/chat/completions"), Some(chat.to_string().as_bytes()), None);
    assert!(r.is_err(), "{r:?}");
    wait_until("the stub sees the second cancellation", || log.cancelled() == 2);
    assert_eq!(post(&server.url("/v1/agent/step"), &step_body("t", 8, 8)).status, 200);
    server.stop();
}

#[test]
fn unknown_routes_and_methods_get_json_errors() {
    let (server, _) = serve();
    let r = send("PUT", &server.url("/v1/agent/step"), Some(b"{}"), None);
    assert_eq!((r.status, r.allow.as_deref()), (405, Some("POST")), "{}", r.body);
    assert!(r.message().contains("PUT"), "{}", r.body);
    let r = send("POST", &server.url("/v1/models"), Some(b"{}"), None);
    assert_eq!((r.status, r.allow.as_deref()), (405, Some("GET")));
    let r = get(&server.url("/v2/anything"));
    assert_eq!((r.status, r.json()["error"]["type"].as_str()), (404, Some("not_found_error")));
    let r = send("POST", &server.url("/v1/agent/step"), Some(b"{\"task\": 1"), None);
    assert_eq!(r.status, 400);
    assert!(r.message().contains("line 1"), "serde's position is kept: {}", r.body);
    server.stop();
}

#[test]
fn an_image_claiming_ten_gigapixels_is_refused_from_its_header() {
    let (server, _) = serve();
    let body = json!({"task": "t", "observation": {"screenshot": data_url(&png_header_claiming(100_000, 100_000))}});
    let r = post(&server.url("/v1/agent/step"), &body);
    assert_eq!(r.status, 400, "{}", r.body);
    let m = r.message();
    assert!(m.contains("100000x100000") && m.contains("16777216"), "{m}");
    server.stop();
}

#[test]
fn predict_runs_one_step_without_a_server() {
    let dir = std::env::temp_dir().join(format!("askgui-serve-predict-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let image = dir.join("shot.png");
    std::fs::write(&image, png(30, 20)).unwrap();
    let args = askgui_serve::PredictArgs {
        model: MODEL.into(),
        image: image.clone(),
        task: "Open the menu".into(),
        // A bare folder, named after itself: the stub's adapter.
        adapter: Some(dir.join(ADAPTER).display().to_string().parse().unwrap()),
        max_tokens: 16,
        stub: true,
    };
    let mut backend = StubBackend::with_log(MODEL, &[ADAPTER], Arc::new(StubLog::default()));
    let resp = askgui_serve::predict::predict(&mut backend, &args).unwrap();
    assert_eq!(serde_json::to_value(&resp.action).unwrap(), json!({"action": "click", "x": 15, "y": 10}));
    let missing = askgui_serve::PredictArgs { image: dir.join("nope.png"), ..args };
    assert!(askgui_serve::predict::predict(&mut backend, &missing).unwrap_err().to_string().contains("nope.png"));
    let _ = std::fs::remove_dir_all(dir);
}
