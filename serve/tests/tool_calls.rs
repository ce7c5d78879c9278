//! OpenAI function calling over the chat endpoint, per action language: a tool-call server asked with
//! `tools` answers `tool_calls` (plain and streamed; by the official Python client when
//! `ASKGUI_OPENAI_PYTHON` names a Python that has `openai`), and its raw text otherwise; `tools` with the
//! other languages, lists without `computer_use` and forced choices are 400s. The stub writes a known
//! action in the language, so the calls can be checked against it; the tiny random model's answers are
//! noise, so on it the test checks that the answer with tools is its answer without them, converted, and
//! that a call handed back reads as the model's own text.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use askgui_data::{Action, ActionLanguage, Target};
use askgui_serve::model_backend::{ModelBackend, ModelBackendConfig};
use askgui_serve::stub::{StubBackend, StubLog};
use askgui_serve::ServerHandle;
use common::*;
use serde_json::{json, Value};

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "computer_use", "parameters": {"type": "object"}}}])
}

/// A stub server that answers chats in `language`.
fn stub_in(language: ActionLanguage) -> ServerHandle {
    let factory: askgui_serve::BackendFactory = Box::new(move || {
        Ok(Box::new(
            StubBackend::with_log(MODEL, &[ADAPTER], std::sync::Arc::new(StubLog::default())).with_language(language),
        ) as _)
    });
    let server = askgui_serve::start(config(), factory).expect("the server starts");
    wait_ready(&server);
    server
}

fn chat(extra: Value) -> Value {
    let mut body =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Open the settings"}], "max_tokens": 64});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

/// The action of a call, through askgui's tool-call parser (the call as the model writes it).
fn call_action(name: &str, arguments: &str) -> Action {
    let text = format!("<tool_call>\n{{\"name\": {}, \"arguments\": {arguments}}}\n</tool_call>", json!(name));
    ActionLanguage::ToolCall.parse(&text).unwrap_or_else(|e| panic!("{e}: {text}")).action
}

/// A streamed answer's content, its tool calls reassembled as OpenAI's clients do (strings appended per
/// `index`, `id` / `type` / `name` given once), and its finish reason.
fn read_stream(sse: &str) -> (String, Vec<Value>, String) {
    let (mut content, mut calls, mut finish) = (String::new(), Vec::<Value>::new(), String::new());
    for data in sse.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| *d != "[DONE]") {
        let chunk: Value = serde_json::from_str(data).unwrap();
        let choice = &chunk["choices"][0];
        content += choice["delta"]["content"].as_str().unwrap_or_default();
        for d in choice["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = d["index"].as_u64().unwrap() as usize;
            if i == calls.len() {
                assert!(d["id"].as_str().is_some_and(|id| id.starts_with("call_")), "the first delta has the id: {d}");
                calls.push(json!({"id": d["id"], "name": d["function"]["name"], "arguments": ""}));
            }
            let args =
                calls[i]["arguments"].as_str().unwrap().to_string() + d["function"]["arguments"].as_str().unwrap();
            calls[i]["arguments"] = json!(args);
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (content, calls, finish)
}

#[test]
fn a_tool_call_server_answers_tool_calls_when_asked_with_tools() {
    let server = stub_in(ActionLanguage::ToolCall);
    let url = server.url("/v1/chat/completions");
    // The stub's rule: echo the text, then a click at (500, 500) in the language (no `?` in the task).
    let click = Action::Click(Target::point(500, 500));
    let raw = format!("echo: Open the settings\n{}", ActionLanguage::ToolCall.render(&click).unwrap());

    let r = post(&url, &chat(json!({"tools": tools()})));
    assert_eq!(r.status, 200, "{}", r.body);
    let choice = &r.json()["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{}", r.body);
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!((&call["type"], &call["function"]["name"]), (&json!("function"), &json!("computer_use")), "{call}");
    let arguments = call["function"]["arguments"].as_str().expect("arguments are a JSON string");
    serde_json::from_str::<Value>(arguments).expect("the arguments parse as JSON");
    assert_eq!(call_action("computer_use", arguments), click);
    assert_eq!(choice["message"]["content"], "echo: Open the settings", "the text outside the call");

    // Streamed: the same call, the content without the call's text.
    let r = post(&url, &chat(json!({"tools": tools(), "stream": true})));
    let (content, calls, finish) = read_stream(&r.body);
    assert_eq!((content.as_str(), finish.as_str()), ("echo: Open the settings", "tool_calls"), "{}", r.body);
    assert_eq!(calls.len(), 1, "{}", r.body);
    assert_eq!((&calls[0]["name"], &calls[0]["arguments"]), (&json!("computer_use"), &json!(arguments)));

    // Without tools, or with `tool_choice: none`: the language's text unchanged.
    for extra in [json!({}), json!({"tools": tools(), "tool_choice": "none"})] {
        let r = post(&url, &chat(extra.clone()));
        let choice = &r.json()["choices"][0];
        assert_eq!((&choice["message"]["content"], &choice["finish_reason"]), (&json!(raw), &json!("stop")), "{extra}");
        assert!(choice["message"].get("tool_calls").is_none(), "{}", r.body);
    }

    // A call handed back, then the tool's result: the result is the last user turn, in
    // `<tool_response>` tags (which the stub echoes word by word).
    let messages = json!([
        {"role": "user", "content": "Open the settings"},
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "clicked"},
    ]);
    let r = post(&url, &chat(json!({"messages": messages})));
    let content = r.json()["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(content.starts_with("echo: <tool_response> clicked </tool_response>\n"), "{content}");

    // The official client.
    match std::env::var("ASKGUI_OPENAI_PYTHON") {
        Err(_) => eprintln!("SKIPPED the OpenAI client check: set ASKGUI_OPENAI_PYTHON to a Python with `openai`"),
        Ok(py) => {
            let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/openai_tool_calls.py");
            let out = std::process::Command::new(py).arg(script).arg(server.url("/v1")).arg(MODEL).output().unwrap();
            assert!(out.status.success(), "the OpenAI client failed: {}", String::from_utf8_lossy(&out.stderr));
            let got: Value = serde_json::from_slice(&out.stdout).expect("one JSON line");
            for way in ["plain", "streamed"] {
                let c = &got[way]["calls"];
                assert_eq!(c.as_array().map(Vec::len), Some(1), "{way}: {got}");
                assert_eq!(c[0]["name"], "computer_use", "{way}: {got}");
                assert_eq!(call_action("computer_use", c[0]["arguments"].as_str().unwrap()), click, "{way}");
                assert_eq!(got[way]["content"], "echo: Open the settings", "{way}: {got}");
            }
            assert_eq!(got["plain"]["calls"][0]["arguments"], got["streamed"]["calls"][0]["arguments"]);
        }
    }
    server.stop();
}

#[test]
fn tools_are_refused_where_the_model_cannot_call_them() {
    let at = |server: &ServerHandle, body: Value| post(&server.url("/v1/chat/completions"), &body);
    let json_server = stub_in(ActionLanguage::AskguiJson);
    let ui_tars = stub_in(ActionLanguage::UiTars);
    let tool_call = stub_in(ActionLanguage::ToolCall);
    let browser = json!([{"type": "function", "function": {"name": "browser"}}]);
    let handed_back = json!([{"role": "user", "content": "x"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "computer_use", "arguments": "{}"}}]}]);
    let cases = [
        (&json_server, json!({"tools": tools()}), vec!["tools:", "(askgui)", "leave `tools` out"]),
        (&ui_tars, json!({"tools": tools()}), vec!["tools:", "(ui-tars)", "leave `tools` out"]),
        (&ui_tars, json!({"messages": handed_back}), vec!["messages[1].tool_calls:", "ui-tars"]),
        (&ui_tars, json!({"messages": [{"role": "tool", "content": "x"}]}), vec!["messages[0].role:", "`tool`"]),
        (&tool_call, json!({"tools": browser}), vec!["tools:", "`computer_use`", "\"browser\""]),
        (&tool_call, json!({"tools": tools(), "tool_choice": "required"}), vec!["tool_choice:", "`auto`"]),
        (
            &tool_call,
            json!({"tools": tools(), "tool_choice": {"type": "function", "function": {"name": "computer_use"}}}),
            vec!["tool_choice:", "cannot force"],
        ),
        (&tool_call, json!({"functions": [{"name": "computer_use"}]}), vec!["functions:", "`tools`"]),
        (&tool_call, json!({"response_format": {"type": "json_object"}}), vec!["response_format:", "(tool-call)"]),
    ];
    for (server, extra, words) in cases {
        let r = at(server, chat(extra.clone()));
        assert_eq!(r.status, 400, "{extra}: {}", r.body);
        let m = r.message();
        assert!(words.iter().all(|w| m.contains(w)), "{extra}: {m}");
    }
    // UI-TARS: the content is the language's own text, for its front end to parse.
    let r = at(&ui_tars, chat(json!({})));
    let click = ActionLanguage::UiTars.render(&Action::Click(Target::point(500, 500))).unwrap();
    assert_eq!(r.json()["choices"][0]["message"]["content"], format!("echo: Open the settings\n{click}"));
    for s in [json_server, ui_tars, tool_call] {
        s.stop();
    }
}

/// The tiny random Qwen2.5-VL checkpoint, by the id `/v1/models` lists (`--model` as given).
fn tiny_model() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/tiny-qwen2_5_vl").display().to_string()
}

/// The tiny checkpoint served in the tool-call language.
fn model_server() -> ServerHandle {
    let mut cfg = askgui_serve::Config::for_model(tiny_model());
    cfg.port = 0;
    cfg.action_language = Some(ActionLanguage::ToolCall);
    let backend_cfg = ModelBackendConfig::from(&cfg);
    let factory: askgui_serve::BackendFactory = Box::new(move || Ok(Box::new(ModelBackend::load(&backend_cfg)?) as _));
    let server = askgui_serve::start(cfg, factory).expect("the server starts");
    let t0 = Instant::now();
    while get(&server.url("/health")).status != 200 {
        assert!(t0.elapsed() < Duration::from_secs(120), "the model did not load in 120 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    server
}

#[test]
fn the_model_answers_tools_as_its_text_converted_and_reads_a_call_handed_back() {
    let server = model_server();
    let url = server.url("/v1/chat/completions");
    let model = tiny_model();
    let ask = |extra: Value| {
        let mut body = chat(extra);
        body["model"] = json!(model);
        body["max_tokens"] = json!(12);
        let r = post(&url, &body);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    // Greedy: the same prompt gives the same text with tools and without.
    let plain = ask(json!({}));
    let raw = plain["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let with = ask(json!({"tools": tools()}));
    let choice = &with["choices"][0];
    match ActionLanguage::ToolCall.parse(&raw) {
        Ok(parsed) => {
            let call = &choice["message"]["tool_calls"][0]["function"];
            assert_eq!(call_action(call["name"].as_str().unwrap(), call["arguments"].as_str().unwrap()), parsed.action);
            assert_eq!(choice["finish_reason"], "tool_calls");
        }
        // The random weights wrote no call: the text comes back as it was, with its finish reason.
        Err(_) if !raw.contains("<tool_call>") => {
            assert_eq!(choice["message"]["content"], json!(raw), "{with}");
            assert_eq!(choice["finish_reason"], plain["choices"][0]["finish_reason"]);
            assert!(choice["message"].get("tool_calls").is_none(), "{with}");
        }
        Err(e) => eprintln!("a call the parser refuses ({e}); the conversion is checked on the stub"),
    }

    // A call handed back as OpenAI's tool_calls and a tool message is the prompt of the model's own text
    // and a user turn in `<tool_response>` tags (Qwen's chat template): the same tokens, the same answer.
    let click = ActionLanguage::ToolCall.render(&Action::Click(Target::point(500, 500))).unwrap();
    let call = json!({"id": "call_1", "type": "function",
                      "function": {"name": "computer_use", "arguments": "{\"action\": \"left_click\", \"coordinate\": [500, 500]}"}});
    let as_calls = ask(json!({"messages": [
        {"role": "user", "content": "Open the settings"},
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "clicked"}]}));
    let as_text = ask(json!({"messages": [
        {"role": "user", "content": "Open the settings"},
        {"role": "assistant", "content": click},
        {"role": "user", "content": "<tool_response>\nclicked\n</tool_response>"}]}));
    assert_eq!(as_calls["usage"], as_text["usage"]);
    assert_eq!(as_calls["choices"][0]["message"], as_text["choices"][0]["message"]);
    server.stop();
}
