//! Strict request bodies, end to end: 300 requests with one misspelt or extra field, generated from a
//! fixed seed at every level of every JSON endpoint (top level, observation, elements, options, history
//! turns and actions, session bodies, the OpenAI body, its messages, content parts and stream_options),
//! each a 400 whose message names the field's exact path; the OpenAI body with every documented
//! parameter served; the refusals; `--lenient-requests`; and the official OpenAI Python client when
//! `ASKGUI_OPENAI_PYTHON` names a Python that has it.

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

const SEED: u64 = 0x5717_c7ed;
const CASES: usize = 300;

/// Free-form parameters: the server does not look inside them (documented in the README).
const FREE_FORM: [&str; 6] = ["metadata", "logit_bias", "response_format", "tools", "functions", "prediction"];

/// Names that are no field anywhere in either API: the mistakes a new user makes.
const NOT_FIELDS: [&str; 10] = [
    "max_new_tokens",
    "prompt",
    "image",
    "screenshot_url",
    "coords",
    "top_k",
    "repetition_penalty",
    "do_sample",
    "bounding_box",
    "instruction",
];

/// A chat body with every parameter of OpenAI's reference (values the server honours or ignores).
fn full_chat(shot: &str) -> Value {
    json!({
        "model": MODEL,
        "messages": [
            {"role": "developer", "content": "You are a GUI agent.", "name": "ops"},
            {"role": "user", "name": "ann", "content": [
                {"type": "text", "text": "one two"},
                {"type": "image_url", "image_url": {"url": shot, "detail": "low"}}
            ]},
            {"role": "assistant", "content": [{"type": "text", "text": "ok"}], "name": "agent", "refusal": null,
             "tool_calls": [], "function_call": null, "audio": null, "tool_call_id": null},
            {"role": "user", "content": "three"}
        ],
        "max_tokens": 8, "max_completion_tokens": 8, "temperature": 0.0, "top_p": 1.0, "seed": 7,
        "stop": ["\n\n"], "stream": false, "stream_options": {"include_usage": true, "include_obfuscation": false},
        "n": 1, "logprobs": false, "top_logprobs": 0, "response_format": {"type": "text"},
        "modalities": ["text"], "audio": null, "tool_choice": "auto", "function_call": "none",
        "web_search_options": null, "frequency_penalty": 0.5, "presence_penalty": -0.5,
        // Empty: the stub answers askgui JSON, which calls no tools (`tests/tool_calls.rs` has the lists).
        "logit_bias": {"50256": -100}, "tools": [], "functions": [], "parallel_tool_calls": false, "prediction": {"type": "content", "content": "x"},
        "reasoning_effort": "low", "verbosity": "low", "user": "u-1", "safety_identifier": "s-1",
        "prompt_cache_key": "k", "prompt_cache_retention": "in_memory", "metadata": {"run": "7"}, "store": false,
        "service_tier": "auto"
    })
}

/// Observation with every field; `w` x `h` pixels.
fn full_observation(w: u32, h: u32) -> Value {
    json!({
        "screenshot": data_url(&png(w, h)),
        "elements": [{"id": "e1", "role": "button", "text": "OK", "bbox": [0, 0, 4, 3]},
                     {"id": "e2", "role": "field", "text": "", "bbox": [4, 3, 8, 6]}],
        "screen": {"width": w, "height": h}
    })
}

/// Every JSON endpoint with a body holding every field it knows: `(path, body)`.
fn valid_bodies(session: &str) -> Vec<(String, Value)> {
    let options = json!({"max_tokens": 8, "temperature": 0.0, "seed": 7, "constrain": true, "pause_threshold": 0.5});
    let history = json!([
        {"turn": "agent", "action": {"action": "click", "x": 1, "y": 2, "element": "e1"}},
        {"turn": "agent", "action": {"action": "scroll", "x": 3, "y": 4, "direction": "down"}},
        {"turn": "agent", "action": {"action": "ask", "question": "Which one?",
                                     "options": [{"label": "A", "detail": "the first"}], "kind": "selection"}},
        {"turn": "say", "text": "The first."},
        {"turn": "agent", "action": {"action": "type", "text": "oat milk"}}
    ]);
    vec![
        (
            "/v1/agent/step".into(),
            json!({"task": "Buy oat milk", "observation": full_observation(12, 9), "history": history,
                   "adapter": ADAPTER, "options": options}),
        ),
        ("/v1/sessions".into(), json!({"task": "Buy milk", "adapter": ADAPTER, "options": options})),
        (
            format!("/v1/sessions/{session}/step"),
            json!({"observation": full_observation(10, 8), "options": {"max_tokens": 8}}),
        ),
        (format!("/v1/sessions/{session}/say"), json!({"text": "The first."})),
        ("/v1/chat/completions".into(), full_chat(&data_url(&png(8, 8)))),
    ]
}

/// Every object in `v` with its display path (`history[2].action`) and JSON pointer, outside free-form
/// parameters.
fn objects(v: &Value, path: &str, pointer: &str, out: &mut Vec<(String, String)>) {
    match v {
        Value::Object(map) => {
            out.push((path.to_string(), pointer.to_string()));
            for (k, c) in map.iter().filter(|(k, _)| !(path.is_empty() && FREE_FORM.contains(&k.as_str()))) {
                let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                objects(c, &p, &format!("{pointer}/{k}"), out);
            }
        }
        Value::Array(items) => {
            for (i, c) in items.iter().enumerate() {
                objects(c, &format!("{path}[{i}]"), &format!("{pointer}/{i}"), out);
            }
        }
        _ => {}
    }
}

/// Every key used anywhere in the valid bodies: a misspelling must not land on one.
fn known_keys(bodies: &[(String, Value)]) -> BTreeSet<String> {
    fn keys(v: &Value, out: &mut BTreeSet<String>) {
        match v {
            Value::Object(m) => m.iter().for_each(|(k, c)| {
                out.insert(k.clone());
                keys(c, out)
            }),
            Value::Array(a) => a.iter().for_each(|c| keys(c, out)),
            _ => {}
        }
    }
    let mut out = BTreeSet::new();
    bodies.iter().for_each(|(_, b)| keys(b, &mut out));
    out
}

/// A misspelling of `key`: a letter dropped, doubled or swapped with the next, a capital, a plural.
fn misspell(rng: &mut StdRng, key: &str) -> String {
    let c: Vec<char> = key.chars().collect();
    let i = rng.random_range(0..c.len());
    let mut out = c.clone();
    match rng.random_range(0..5) {
        0 if c.len() > 2 => drop(out.remove(i)),
        1 => out.insert(i, c[i]),
        2 if i + 1 < c.len() && c[i] != c[i + 1] => out.swap(i, i + 1),
        3 => out[0] = out[0].to_ascii_uppercase(),
        _ => out.push('s'),
    }
    out.into_iter().collect()
}

/// One hostile case: the endpoint, the body, the path the answer must name, and the key it replaced.
fn case(rng: &mut StdRng, bodies: &[(String, Value)], known: &BTreeSet<String>) -> (String, Value, String, String) {
    let (url, body) = &bodies[rng.random_range(0..bodies.len())];
    let mut nodes = Vec::new();
    objects(body, "", "", &mut nodes);
    let (path, pointer) = nodes[rng.random_range(0..nodes.len())].clone();
    let mut body = body.clone();
    let obj = body.pointer_mut(&pointer).and_then(Value::as_object_mut).unwrap();
    let (new_key, old_key) = if rng.random_bool(0.5) {
        let old = obj.keys().nth(rng.random_range(0..obj.len())).unwrap().clone();
        let new = loop {
            let k = misspell(rng, &old);
            if !known.contains(&k) {
                break k;
            }
        };
        let v = obj.remove(&old).unwrap();
        obj.insert(new.clone(), v);
        (new, old)
    } else {
        let name = match rng.random_bool(0.5) {
            true => NOT_FIELDS[rng.random_range(0..NOT_FIELDS.len())].to_string(),
            false => format!("zz_{}", rng.random_range(0..10_000)),
        };
        obj.insert(name.clone(), json!(rng.random_range(0..100)));
        (name, String::new())
    };
    let field = if path.is_empty() { new_key } else { format!("{path}.{new_key}") };
    (url.clone(), body, field, old_key)
}

/// A server with a session waiting for an answer (so the valid `say` body is valid).
fn serve_waiting() -> (askgui_serve::ServerHandle, String) {
    let (server, _) = serve();
    let r = post(&server.url("/v1/sessions"), &json!({"task": "Which milk?"}));
    let id = r.json()["id"].as_str().unwrap().to_string();
    let r = post(&server.url(&format!("/v1/sessions/{id}/step")), &json!({"observation": full_observation(10, 8)}));
    assert_eq!(r.json()["action"]["action"], "ask", "{}", r.body);
    (server, id)
}

#[test]
fn three_hundred_misspelt_or_extra_fields_are_each_a_400_naming_the_field() {
    let (server, session) = serve_waiting();
    let bodies = valid_bodies(&session);
    // Each valid body is served (the say at the end: it answers the pending question).
    for (url, body) in bodies.iter().filter(|(u, _)| !u.ends_with("/say")) {
        let r = post(&server.url(url), body);
        assert!(r.status == 200 || r.status == 201, "{url}: {} {}", r.status, r.body);
    }
    let known = known_keys(&bodies);
    let mut rng = StdRng::seed_from_u64(SEED);
    let (mut misspelt, mut levels) = (0, BTreeSet::new());
    for i in 0..CASES {
        let (url, body, field, old) = case(&mut rng, &bodies, &known);
        let r = post(&server.url(&url), &body);
        assert_eq!(r.status, 400, "case {i}: {url} `{field}`: {}", r.body);
        let m = r.message();
        assert!(m.contains(&format!("unknown field `{field}`")), "case {i}: {url} `{field}`: {m}");
        assert!(m.contains("the known fields of"), "case {i}: {m}");
        if !old.is_empty() {
            misspelt += 1;
            // The known fields listed are those of the object the misspelt key is in.
            let listed = m.split("are: ").nth(1).unwrap_or("").split([';', ' ']).collect::<Vec<_>>();
            assert!(listed.iter().any(|k| k.trim_end_matches(',') == old), "case {i}: `{old}` not listed: {m}");
        }
        let level: String =
            field.rsplit_once('.').map_or("", |(p, _)| p).chars().filter(|c| !c.is_ascii_digit()).collect();
        levels.insert(format!("{} {level}", url.replace(&session, "{id}")));
    }
    eprintln!("{CASES} cases, {misspelt} misspelt, at {} levels: {levels:?}", levels.len());
    assert!(misspelt > CASES / 3 && levels.len() >= 20, "too little variety: {misspelt} misspelt, {levels:?}");
    // The session was not touched by any of them: it still waits for its answer.
    let r = post(&server.url(&format!("/v1/sessions/{session}/say")), &json!({"text": "The first."}));
    assert_eq!(r.status, 200, "{}", r.body);
    server.stop();
}

#[test]
fn the_issue_example_is_refused_with_the_known_options() {
    let (server, _) = serve();
    let body =
        json!({"task": "t", "observation": {"screenshot": data_url(&png(8, 8))}, "options": {"max_new_tokens": 5}});
    let r = post(&server.url("/v1/agent/step"), &body);
    assert_eq!(r.status, 400);
    assert_eq!(
        r.message(),
        "unknown field `options.max_new_tokens`; the known fields of `options` are: max_tokens, temperature, seed, \
         constrain, pause_threshold, coordinates"
    );
    let mut body = body;
    body["history"] = json!([{"turn": "agent", "action": {"action": "type", "txt": "milk"}}]);
    body["options"] = json!({});
    let m = post(&server.url("/v1/agent/step"), &body).message();
    assert!(
        m.starts_with(
            "unknown field `history[0].action.txt` (did you mean `text`?); the known fields of `history[0].action` \
             are: action, text"
        ),
        "{m}"
    );
    server.stop();
}

#[test]
fn every_documented_openai_parameter_is_served_and_impossible_values_are_refused() {
    let (server, _) = serve();
    let url = server.url("/v1/chat/completions");
    let full = full_chat(&data_url(&png(8, 8)));
    let r = post(&url, &full);
    assert_eq!(r.status, 200, "{}", r.body);
    // The stub echoes the last user message.
    assert_eq!(r.json()["choices"][0]["message"]["content"], "echo: three");
    let mut streamed = full.clone();
    streamed["stream"] = json!(true);
    let r = post(&url, &streamed);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains("\"usage\"") && r.body.ends_with("data: [DONE]\n\n"), "{}", r.body);

    for (patch, named) in [
        (json!({"n": 2}), "n:"),
        (json!({"logprobs": true}), "logprobs:"),
        (json!({"top_logprobs": 3}), "logprobs:"),
        (json!({"response_format": {"type": "json_schema", "json_schema": {}}}), "response_format:"),
        (json!({"modalities": ["text", "audio"]}), "modalities:"),
        (json!({"audio": {"voice": "alloy", "format": "wav"}}), "modalities:"),
        (json!({"tool_choice": "required"}), "tool_choice:"),
        (json!({"function_call": {"name": "g"}}), "function_call:"),
        (json!({"web_search_options": {}}), "web_search_options:"),
        (json!({"seed": "seven"}), "seed: invalid type"),
        (json!({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}), "audio"),
        (json!({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}), "unknown variant `audio`"),
    ] {
        let mut body = full.clone();
        patch.as_object().unwrap().iter().for_each(|(k, v)| body[k] = v.clone());
        let r = post(&url, &body);
        assert_eq!(r.status, 400, "{patch}: {}", r.body);
        assert!(r.message().contains(named), "{patch}: {}", r.body);
    }
    server.stop();
}

#[test]
fn lenient_requests_log_unknown_fields_and_serve() {
    let mut cfg = config();
    cfg.lenient_requests = true;
    let (server, _) = serve_with(cfg);
    let body = json!({"task": "t", "observation": {"screenshot": data_url(&png(8, 8)), "dpi": 2},
                      "options": {"max_new_tokens": 5}, "client": "x"});
    assert_eq!(post(&server.url("/v1/agent/step"), &body).status, 200);
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "x": 1}]}],
                      "repetition_penalty": 1.1});
    assert_eq!(post(&server.url("/v1/chat/completions"), &chat).status, 200);
    // A type error is still a 400.
    let bad = json!({"task": "t", "observation": {"screenshot": data_url(&png(8, 8))}, "options": {"seed": "x"}});
    let r = post(&server.url("/v1/agent/step"), &bad);
    assert_eq!(r.status, 400);
    assert!(r.message().contains("options.seed: invalid type"), "{}", r.body);
    server.stop();
}

#[test]
fn the_official_openai_python_client_passes() {
    let Ok(py) = std::env::var("ASKGUI_OPENAI_PYTHON") else {
        eprintln!("SKIPPED: set ASKGUI_OPENAI_PYTHON to a Python with the `openai` package");
        return;
    };
    let (server, _) = serve();
    let dir = std::env::temp_dir().join(format!("askgui-strict-openai-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let img = dir.join("screen.png");
    std::fs::write(&img, png(24, 16)).unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
    let out = std::process::Command::new(py).arg(script).arg(server.url("/v1")).arg(MODEL).arg(&img).output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!("{}", String::from_utf8_lossy(&out.stdout));
    assert!(out.status.success(), "the OpenAI client failed: {}", String::from_utf8_lossy(&out.stderr));
    server.stop();
}
