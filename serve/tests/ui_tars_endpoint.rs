//! What askgui-serve returns over the OpenAI endpoint for a UI-TARS model, read by the official UI-TARS
//! parser (`@ui-tars/action-parser`, as UI-TARS-desktop reads it): every action kind UI-TARS has, written by
//! the stub in the served language (`STUB_ACT`), returned plain and streamed, parses to the same action
//! through askgui's parser and through the official one. The text itself is the language's rendering; that
//! the model's constrained decoder writes those renderings is `runtime/tests/constrained.rs`'s test.
//! The official parser needs node and `ASKGUI_UI_TARS_NODE_MODULES` (installed by `.ci/run`); without them
//! askgui's parser alone is checked and the test says SKIPPED for the official part.

mod common;
#[path = "../../datasets/tests/official/mod.rs"]
mod official;

use askgui_data::ActionLanguage;
use askgui_serve::stub::StubBackend;
use common::*;
use serde_json::{json, Value};

/// The answer's content, plain (`stream` false) or the streamed deltas put together.
fn content(server: &askgui_serve::ServerHandle, say: &str, stream: bool) -> String {
    let body =
        json!({"model": MODEL, "messages": [{"role": "user", "content": say}], "max_tokens": 256, "stream": stream});
    let r = post(&server.url("/v1/chat/completions"), &body);
    assert_eq!(r.status, 200, "{}", r.body);
    if !stream {
        return r.json()["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    }
    let deltas = r.body.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| *d != "[DONE]");
    deltas
        .map(|d| {
            serde_json::from_str::<Value>(d).unwrap()["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect()
}

#[test]
fn the_official_parser_reads_every_ui_tars_answer_of_the_endpoint() {
    let language = ActionLanguage::UiTars;
    let factory: askgui_serve::BackendFactory = Box::new(move || {
        Ok(Box::new(StubBackend::with_log(MODEL, &[ADAPTER], std::sync::Arc::default()).with_language(language)) as _)
    });
    let server = askgui_serve::start(config(), factory).expect("the server starts");
    wait_ready(&server);
    let (mut texts, mut wants) = (Vec::new(), Vec::new());
    for action in official::every_action_kind() {
        if language.render(&action).is_err() {
            continue;
        }
        let say = format!("STUB_ACT {}", serde_json::to_string(&action).unwrap());
        let (plain, streamed) = (content(&server, &say, false), content(&server, &say, true));
        assert_eq!(plain, streamed, "streamed and plain answers differ");
        let ours = language.parse(&plain).unwrap_or_else(|e| panic!("{e}: {plain}")).action;
        assert_eq!(ours, language.normal_form(&action), "{plain}");
        texts.push(plain);
        wants.push(ours);
    }
    server.stop();
    assert!(texts.len() >= 20, "every kind UI-TARS writes: {}", texts.len());
    let Some(parsed) = official::parse(&texts, "the_official_parser_reads_every_ui_tars_answer_of_the_endpoint") else {
        return;
    };
    for ((text, want), theirs) in texts.iter().zip(&wants).zip(&parsed) {
        assert_eq!(&official::action(theirs), want, "the official parser reads {text} otherwise: {theirs}");
    }
    eprintln!("the official UI-TARS parser read all {} endpoint answers as askgui does", texts.len());
}
