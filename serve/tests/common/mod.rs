//! Helpers shared by the server tests: a real server on a free loopback port with the stub backend, and a
//! small blocking HTTP client (ureq) that returns every status as a value instead of an error.

#![allow(dead_code)]

use std::io::Cursor;
use std::sync::Arc;
use std::time::{Duration, Instant};

use askgui_serve::stub::{StubBackend, StubLog};
use askgui_serve::{BackendFactory, Config, ServerHandle};
use serde_json::Value;

pub const MODEL: &str = "stub-model";
pub const ADAPTER: &str = "navi-lora";

/// The test settings: port 0, two workers, small limits where a test wants to reach them.
pub fn config() -> Config {
    let mut c = Config::for_model(MODEL);
    c.port = 0;
    c.workers = 2;
    c
}

/// A stub factory sharing `log` with the test.
pub fn stub_factory(log: Arc<StubLog>) -> BackendFactory {
    Box::new(move || Ok(Box::new(StubBackend::with_log(MODEL, &[ADAPTER], log)) as _))
}

/// A server with the stub backend, ready (its `/health` answered 200).
pub fn serve_with(config: Config) -> (ServerHandle, Arc<StubLog>) {
    let log = Arc::new(StubLog::default());
    let server = askgui_serve::start(config, stub_factory(log.clone())).expect("the server starts");
    wait_ready(&server);
    (server, log)
}

pub fn serve() -> (ServerHandle, Arc<StubLog>) {
    serve_with(config())
}

pub fn wait_ready(server: &ServerHandle) {
    let start = Instant::now();
    loop {
        if get(&server.url("/health")).status == 200 {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "the server never became ready");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// An answer: status, headers we look at, and the body.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub body: String,
    pub content_type: String,
    pub retry_after: Option<String>,
    pub allow: Option<String>,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// The error message of an error body.
    pub fn message(&self) -> String {
        self.json()["error"]["message"].as_str().unwrap_or_else(|| panic!("no error message: {}", self.body)).into()
    }
}

fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new().timeout(Duration::from_secs(30)).build()
}

pub fn into_reply(result: Result<ureq::Response, ureq::Error>) -> Result<Reply, String> {
    let resp = match result {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => return Err(e.to_string()),
    };
    let status = resp.status();
    let content_type = resp.header("content-type").unwrap_or("").to_string();
    let retry_after = resp.header("retry-after").map(String::from);
    let allow = resp.header("allow").map(String::from);
    let body = resp.into_string().map_err(|e| e.to_string())?;
    Ok(Reply { status, body, content_type, retry_after, allow })
}

pub fn send(method: &str, url: &str, body: Option<&[u8]>, key: Option<&str>) -> Reply {
    try_send(&agent(), method, url, body, key).unwrap_or_else(|e| panic!("{method} {url}: {e}"))
}

pub fn try_send(
    agent: &ureq::Agent,
    method: &str,
    url: &str,
    body: Option<&[u8]>,
    key: Option<&str>,
) -> Result<Reply, String> {
    let mut req = agent.request(method, url);
    if let Some(k) = key {
        req = req.set("Authorization", &format!("Bearer {k}"));
    }
    into_reply(match body {
        Some(b) => req.set("Content-Type", "application/json").send_bytes(b),
        None => req.call(),
    })
}

pub fn get(url: &str) -> Reply {
    send("GET", url, None, None)
}

pub fn post(url: &str, body: &Value) -> Reply {
    send("POST", url, Some(body.to_string().as_bytes()), None)
}

/// A PNG of `w` x `h` pixels.
pub fn png(w: u32, h: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x % 256) as u8, (y % 256) as u8, 128]));
    let mut out = Vec::new();
    img.write_to(&mut Cursor::new(&mut out), image::ImageFormat::Png).unwrap();
    out
}

pub fn data_url(bytes: &[u8]) -> String {
    format!("data:image/png;base64,{}", askgui_data::convert::base64_encode(bytes))
}

/// One PNG chunk: length, type, data, CRC of type and data.
fn png_chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    let mut body = kind.to_vec();
    body.extend_from_slice(data);
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    out.extend_from_slice(&crc32(&body).to_be_bytes());
}

/// A PNG signature, a well-formed IHDR chunk (correct CRC) claiming `w` x `h` pixels, a tiny IDAT and
/// IEND: its header reads fine, its pixels do not exist (a decompression-bomb shape).
pub fn png_header_claiming(w: u32, h: u32) -> Vec<u8> {
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&w.to_be_bytes());
    ihdr.extend_from_slice(&h.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]); // 8-bit RGB, deflate, no filter, no interlace
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    png_chunk(&mut out, b"IHDR", &ihdr);
    png_chunk(&mut out, b"IDAT", &[0x78, 0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01]);
    png_chunk(&mut out, b"IEND", &[]);
    out
}

/// CRC-32 (IEEE, reflected, as PNG uses), bit by bit.
pub fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = 0xffff_ffffu32;
    for &b in bytes {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0xedb8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

/// A valid step request body.
pub fn step_body(task: &str, w: u32, h: u32) -> Value {
    serde_json::json!({"task": task, "observation": {"screenshot": data_url(&png(w, h))}})
}
