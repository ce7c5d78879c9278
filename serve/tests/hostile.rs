//! Malformed and hostile requests, generated from a fixed seed so a failure replays: random bytes,
//! truncated and retyped valid requests, huge numbers, strings near the body limit, path-like ids and
//! adapter names, unknown routes and methods, a PNG header claiming 100000 x 100000 pixels, bad base64,
//! data URLs of other types, deep nesting. Every answer must be a 4xx with a JSON error (never a 5xx,
//! never a dropped connection), and the server must be healthy afterwards.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

const SEED: u64 = 0x5eed_a5c9;
const CASES: usize = 1200;
const BODY_LIMIT: usize = 1 << 20;

/// One request: method, path, body.
type Case = (&'static str, String, Option<Vec<u8>>);

fn valid_bodies(session: &str) -> Vec<(&'static str, String, Value)> {
    let shot = data_url(&png(12, 9));
    vec![
        (
            "POST",
            "/v1/agent/step".into(),
            json!({"task": "Open settings", "observation": {"screenshot": shot},
            "history": [{"turn": "agent", "action": {"action": "click", "x": 1, "y": 2}}], "options": {"max_tokens": 8}}),
        ),
        ("POST", "/v1/sessions".into(), json!({"task": "Buy milk", "options": {"temperature": 0.0}})),
        ("POST", format!("/v1/sessions/{session}/step"), json!({"observation": {"screenshot": shot}})),
        (
            "POST",
            "/v1/chat/completions".into(),
            json!({"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": shot}}]}]}),
        ),
    ]
}

/// A JSON value of a random type other than the one at hand (never null: null is valid for options).
fn other_type(rng: &mut StdRng, v: &Value) -> Value {
    loop {
        let candidate = match rng.random_range(0..5) {
            0 => json!(rng.random::<i32>()),
            1 => json!("a string"),
            2 => json!([1, "two", null]),
            3 => json!(true),
            _ => json!({"nested": {"x": 1}}),
        };
        let same = std::mem::discriminant(&candidate) == std::mem::discriminant(v);
        if !same {
            return candidate;
        }
    }
}

fn random_string(rng: &mut StdRng, max: usize) -> String {
    let len = rng.random_range(0..max);
    (0..len).map(|_| char::from(rng.random_range(32u8..127))).collect()
}

fn case(rng: &mut StdRng, session: &str) -> Case {
    let bodies = valid_bodies(session);
    let post = |path: &str, v: Value| ("POST", path.to_string(), Some(v.to_string().into_bytes()));
    match rng.random_range(0..16) {
        // Random bytes to a JSON endpoint.
        0 => {
            let (_, path, _) = &bodies[rng.random_range(0..bodies.len())];
            let len = rng.random_range(0..2000);
            ("POST", path.clone(), Some((0..len).map(|_| rng.random::<u8>()).collect()))
        }
        // A valid request cut short.
        1 | 2 => {
            let (_, path, v) = &bodies[rng.random_range(0..bodies.len())];
            let text = v.to_string().into_bytes();
            let cut = rng.random_range(0..text.len());
            ("POST", path.clone(), Some(text[..cut].to_vec()))
        }
        // A required field of the wrong type.
        3 | 4 => {
            let (_, path, mut v) = bodies[rng.random_range(0..bodies.len())].clone();
            let field = match path.as_str() {
                "/v1/agent/step" => ["task", "observation", "history"][rng.random_range(0..3)],
                "/v1/sessions" => "task",
                "/v1/chat/completions" => ["model", "messages"][rng.random_range(0..2)],
                _ => "observation",
            };
            let replacement = other_type(rng, &v[field]);
            v[field] = replacement;
            post(&path, v)
        }
        // Numbers out of range or out of type.
        5 => {
            let raw = [
                r#"{"task": "t", "observation": {"screenshot": "aGk="}, "options": {"max_tokens": 1e400}}"#,
                r#"{"task": "t", "observation": {"screenshot": "aGk="}, "options": {"max_tokens": 18446744073709551616}}"#,
                r#"{"task": "t", "observation": {"screenshot": "aGk="}, "options": {"max_tokens": -1}}"#,
                r#"{"task": "t", "observation": {"elements": [], "screen": {"width": 4294967296, "height": 1}}}"#,
                r#"{"task": "t", "observation": {"elements": [], "screen": {"width": 4294967295, "height": 4294967295}}}"#,
                r#"{"task": "t", "observation": {"elements": [], "screen": {"width": 0, "height": 10}}}"#,
                r#"{"task": "t", "observation": {"screenshot": "aGk="}, "options": {"temperature": -1}}"#,
                r#"{"task": "t", "observation": {"screenshot": "aGk="}, "options": {"pause_threshold": 7}}"#,
                r#"{"task": "t", "observation": {"screenshot": "aGk="}, "history": [{"turn": "agent", "action": {"action": "click", "x": 1e12, "y": 0}}]}"#,
            ];
            let chat = [
                json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": u64::MAX}),
                json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 99999999999u64}),
                json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 0}),
                json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 1e300}),
            ];
            if rng.random_bool(0.6) {
                ("POST", "/v1/agent/step".into(), Some(raw[rng.random_range(0..raw.len())].as_bytes().to_vec()))
            } else {
                post("/v1/chat/completions", chat[rng.random_range(0..chat.len())].clone())
            }
        }
        // Enormous strings just under the body limit.
        6 => {
            let big = "A".repeat(BODY_LIMIT - 200 - rng.random_range(0..1000));
            match rng.random_range(0..3) {
                0 => post("/v1/agent/step", json!({"task": "t", "observation": {"screenshot": big}})),
                1 => post("/v1/agent/step", json!({"task": big, "observation": {}})),
                _ => {
                    post("/v1/chat/completions", json!({"model": big, "messages": [{"role": "user", "content": "x"}]}))
                }
            }
        }
        // Path-like and odd ids, adapters and model names.
        7 => {
            let names = [
                "../../etc/passwd",
                "..%2F..%2Fetc%2Fpasswd",
                "%00",
                "C:\\Windows\\system32",
                "a/b",
                "~root",
                " ",
                "\u{202e}lora",
            ];
            let name = names[rng.random_range(0..names.len())];
            match rng.random_range(0..4) {
                0 => {
                    post("/v1/agent/step", json!({"task": "t", "observation": {"screenshot": "aGk="}, "adapter": name}))
                }
                1 => post("/v1/sessions", json!({"task": "t", "adapter": name})),
                2 => {
                    post("/v1/chat/completions", json!({"model": name, "messages": [{"role": "user", "content": "x"}]}))
                }
                _ => {
                    let id =
                        ["..%2F..%2Fetc%2Fpasswd", "%2e%2e", "%00", "x".repeat(2000).as_str(), "0123", "%E2%80%AE"]
                            [rng.random_range(0..6)]
                        .to_string();
                    match rng.random_range(0..3) {
                        0 => ("GET", format!("/v1/sessions/{id}"), None),
                        1 => ("DELETE", format!("/v1/sessions/{id}"), None),
                        _ => post(&format!("/v1/sessions/{id}/say"), json!({"text": "yes"})),
                    }
                }
            }
        }
        // Unknown routes and wrong methods.
        8 => {
            let known = ["/v1/agent/step", "/v1/sessions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"];
            match rng.random_range(0..3) {
                0 => ("GET", format!("/{}", random_string(rng, 40).replace(['?', '#', ' ', '%', '\\'], "x")), None),
                1 => {
                    let path = known[rng.random_range(0..known.len())];
                    let method = ["PUT", "PATCH", "DELETE", "OPTIONS"][rng.random_range(0..4)];
                    (method, path.to_string(), Some(b"{}".to_vec()))
                }
                _ => (
                    "GET",
                    ["/v1/agent/step", "/v1/chat/completions", "/v1/sessions"][rng.random_range(0..3)].into(),
                    None,
                ),
            }
        }
        // A decompression bomb's header.
        9 => {
            let bomb = data_url(&png_header_claiming(100_000, 100_000));
            if rng.random_bool(0.5) {
                post("/v1/agent/step", json!({"task": "t", "observation": {"screenshot": bomb}}))
            } else {
                let content = json!([{"type": "image_url", "image_url": {"url": bomb}}]);
                post(
                    "/v1/chat/completions",
                    json!({"model": MODEL, "messages": [{"role": "user", "content": content}]}),
                )
            }
        }
        // Bad base64 and non-images.
        10 => {
            let shots = [
                "!!!!",
                "a",
                "data:image/png;base64",
                "data:image/png,aGk=",
                "data:image/png;base64,",
                "aGVsbG8gd29ybGQ=",
                "",
                "data:;base64,%%%",
            ];
            post(
                "/v1/agent/step",
                json!({"task": "t", "observation": {"screenshot": shots[rng.random_range(0..shots.len())]}}),
            )
        }
        // Data URLs of other types, and remote URLs.
        11 => {
            let png_b64 = askgui_data::convert::base64_encode(&png(4, 4));
            let urls = [
                format!("data:image/gif;base64,{png_b64}"),
                format!("data:text/html;base64,{png_b64}"),
                format!("data:application/pdf;base64,{png_b64}"),
                format!("data:image/svg+xml;base64,{png_b64}"),
                "data:image/png;base64,PHN2Zz4=".to_string(),
                "http://169.254.169.254/latest/meta-data".to_string(),
                "https://example.com/x.png".to_string(),
                "file:///etc/passwd".to_string(),
            ];
            let url = urls[rng.random_range(0..urls.len())].clone();
            let content = json!([{"type": "image_url", "image_url": {"url": url}}]);
            post("/v1/chat/completions", json!({"model": MODEL, "messages": [{"role": "user", "content": content}]}))
        }
        // JSON of the wrong shape, deep nesting, broken UTF-8.
        12 => {
            let bodies: [Vec<u8>; 7] = [
                b"[]".to_vec(),
                b"null".to_vec(),
                b"\"task\"".to_vec(),
                b"{}".to_vec(),
                b"".to_vec(),
                format!("{}{}", "[".repeat(5000), "]".repeat(5000)).into_bytes(),
                b"{\"task\": \"\xff\xfe\", \"observation\": {}}".to_vec(),
            ];
            let paths = ["/v1/agent/step", "/v1/sessions", "/v1/chat/completions"];
            ("POST", paths[rng.random_range(0..3)].into(), Some(bodies[rng.random_range(0..bodies.len())].clone()))
        }
        // Chat messages that cannot be served.
        13 => {
            let messages = [
                json!([]),
                json!([{"role": "tool", "content": "x"}]),
                json!([{"role": "user", "content": null}]),
                json!([{"role": "user", "content": 5}]),
                json!([{"role": "user", "content": [{"type": "audio", "audio": "x"}]}]),
                json!([{"role": "user", "content": [{"type": "text"}]}]),
                json!([{"role": "user", "content": [{"type": "image_url"}]}]),
                json!([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
                json!([{"role": "system", "content": "only a system message"}]),
                json!([{"content": "no role"}]),
            ];
            let m = messages[rng.random_range(0..messages.len())].clone();
            let stream = rng.random_bool(0.5);
            post("/v1/chat/completions", json!({"model": MODEL, "messages": m, "stream": stream}))
        }
        // Session misuse: unknown ids, empty answers, answers nobody asked for, bad observations.
        14 => match rng.random_range(0..4) {
            0 => post(
                &format!("/v1/sessions/{:032x}/step", rng.random::<u128>()),
                json!({"observation": {"screenshot": "aGk="}}),
            ),
            1 => post(&format!("/v1/sessions/{session}/say"), json!({"text": ""})),
            2 => post(&format!("/v1/sessions/{session}/say"), json!({"text": "nobody asked"})),
            _ => post(&format!("/v1/sessions/{session}/step"), json!({"observation": {}})),
        },
        // History with unknown or broken actions.
        _ => {
            let turns = [
                json!({"turn": "agent", "action": {"action": "teleport", "x": 1}}),
                json!({"turn": "agent", "action": {"action": "click"}}),
                json!({"turn": "agent", "action": {"action": "type", "text": ""}}),
                json!({"turn": "robot", "text": "hi"}),
                json!({"turn": "say"}),
            ];
            let t = turns[rng.random_range(0..turns.len())].clone();
            post("/v1/agent/step", json!({"task": "t", "observation": {"screenshot": "aGk="}, "history": [t]}))
        }
    }
}

#[test]
fn a_thousand_hostile_requests_get_4xx_and_the_server_stays_healthy() {
    let mut cfg = config();
    cfg.max_body_bytes = BODY_LIMIT;
    let (server, _) = serve_with(cfg);
    // The readiness polls may have met `/health` still loading (503): only 5xx answered after them count.
    let five_xx = |metrics: &str| -> Vec<String> {
        metrics
            .lines()
            .filter(|l| l.starts_with("askgui_requests_total") && l.contains("status=\"5"))
            .map(String::from)
            .collect()
    };
    let before = five_xx(&get(&server.url("/metrics")).body);
    let session = post(&server.url("/v1/sessions"), &json!({"task": "t"})).json()["id"].as_str().unwrap().to_string();
    let mut rng = StdRng::seed_from_u64(SEED);
    let start = Instant::now();
    let mut statuses = std::collections::BTreeMap::new();
    for i in 0..CASES {
        let (method, path, body) = case(&mut rng, &session);
        // A fresh connection each time: a dropped connection is this request's fault, not a stale pool's.
        let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(30)).build();
        let shown =
            |b: &Option<Vec<u8>>| b.as_ref().map(|b| String::from_utf8_lossy(&b[..b.len().min(200)]).into_owned());
        let reply = try_send(&agent, method, &server.url(&path), body.as_deref(), None)
            .unwrap_or_else(|e| panic!("case {i}: {method} {path} {:?}: no answer: {e}", shown(&body)));
        assert!(
            (400..500).contains(&reply.status),
            "case {i}: {method} {path} {:?}: {} {}",
            shown(&body),
            reply.status,
            reply.body
        );
        if method != "HEAD" {
            let v: Value = serde_json::from_str(&reply.body)
                .unwrap_or_else(|e| panic!("case {i}: {method} {path}: not JSON ({e}): {}", reply.body));
            assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "case {i}: {}", reply.body);
        }
        *statuses.entry(reply.status).or_insert(0) += 1;
    }
    eprintln!("{CASES} hostile requests in {:.2?}: {statuses:?}", start.elapsed());
    assert!(statuses.len() >= 4, "too little variety: {statuses:?}");

    // Not HTTP at all: the server answers 400 and closes.
    for garbage in
        [&b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"[..], b"GET / HTTP/9.9\r\n\r\n", b"\x00\x00\x00\x00\r\n\r\n"]
    {
        let mut s = TcpStream::connect(server.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(garbage).unwrap();
        let mut head = Vec::new();
        let _ = s.read_to_end(&mut head);
        let text = String::from_utf8_lossy(&head);
        assert!(text.starts_with("HTTP/1.1 4"), "{garbage:?} -> {text:?}");
    }

    assert_eq!(get(&server.url("/health")).status, 200);
    assert_eq!(post(&server.url("/v1/agent/step"), &step_body("still fine", 8, 8)).status, 200);
    let metrics = get(&server.url("/metrics")).body;
    assert_eq!(five_xx(&metrics), before, "a 5xx was answered:\n{metrics}");
    server.stop();
}
