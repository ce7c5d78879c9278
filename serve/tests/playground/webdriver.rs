//! A small W3C WebDriver client for the playground test: chromedriver started as a child process on a free
//! port, headless chromium, and the handful of commands the test needs (navigate, find, click, type,
//! execute a script, take a screenshot), as JSON over HTTP with ureq.
//!
//! Hand-written rather than a WebDriver crate: ten endpoints of the W3C spec
//! (<https://www.w3.org/TR/webdriver2/>) cost less than a client library's dependency tree. The driver and
//! the browser session end when [`Browser`] is dropped, so a failing assertion leaves no process behind.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// The key under which WebDriver returns an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// The first of `names` found in `PATH`.
fn in_path(names: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).flat_map(|dir| names.iter().map(move |n| dir.join(n))).find(|p| p.is_file())
}

/// A headless chromium driven through chromedriver.
pub struct Browser {
    driver: Child,
    base: String,
    http: ureq::Agent,
}

impl Browser {
    /// chromedriver and chromium from `PATH`, or why they cannot be used.
    pub fn installed() -> Result<(PathBuf, PathBuf), String> {
        let driver = in_path(&["chromedriver"]).ok_or("no chromedriver in PATH (Debian: chromium-driver)")?;
        let chromium = in_path(&["chromium", "chromium-browser", "google-chrome"]).ok_or("no chromium in PATH")?;
        Ok((driver, chromium))
    }

    /// Starts chromedriver on a free port and a headless chromium through it; panics when either fails
    /// (installed but broken is a failure, not a skip).
    pub fn launch(driver: &Path, chromium: &Path) -> Self {
        let port = TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port();
        let child = Command::new(driver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", driver.display()));
        let http = ureq::AgentBuilder::new().timeout(Duration::from_secs(120)).build();
        // From here on, a panic drops `b`, which ends chromedriver.
        let mut b = Browser { driver: child, base: format!("http://127.0.0.1:{port}"), http };
        b.wait_driver().unwrap_or_else(|e| panic!("{e}"));
        b.new_session(chromium).unwrap_or_else(|e| panic!("{} does not start: {e}", chromium.display()));
        b
    }

    fn wait_driver(&self) -> Result<(), String> {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(20) {
            let ready =
                self.http.get(&format!("{}/status", self.base)).call().ok().and_then(|r| r.into_json::<Value>().ok());
            if ready.is_some_and(|v| v["value"]["ready"] == json!(true)) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err("chromedriver did not answer /status in 20 s".into())
    }

    fn new_session(&mut self, chromium: &Path) -> Result<(), String> {
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium,
                // --no-sandbox: CI runs as root, where chromium's sandbox refuses to start.
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--window-size=1280,900", "--hide-scrollbars"],
            },
        }}});
        let v = self.call("POST", "/session", Some(caps))?;
        let id = v["sessionId"].as_str().ok_or_else(|| format!("no session id in {v}"))?;
        self.base = format!("{}/session/{id}", self.base);
        Ok(())
    }

    /// One WebDriver command; its `value`, or the WebDriver error as text.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
        let req = self.http.request(method, &format!("{}{path}", self.base));
        let res = match body {
            Some(b) => req.send_json(b),
            None => req.call(),
        };
        let v: Value = match res {
            Ok(r) => r.into_json().map_err(|e| e.to_string())?,
            Err(ureq::Error::Status(code, r)) => {
                let v: Value = r.into_json().unwrap_or(Value::Null);
                return Err(format!("{method} {path}: {code} {}", v["value"]["message"]));
            }
            Err(e) => return Err(format!("{method} {path}: {e}")),
        };
        Ok(v["value"].clone())
    }

    fn cmd(&self, method: &str, path: &str, body: Value) -> Value {
        self.call(method, path, Some(body)).unwrap_or_else(|e| panic!("webdriver: {e}"))
    }

    pub fn goto(&self, url: &str) {
        self.cmd("POST", "/url", json!({"url": url}));
    }

    /// The element matching the CSS selector `css` (panics when there is none).
    pub fn find(&self, css: &str) -> String {
        let v = self.cmd("POST", "/element", json!({"using": "css selector", "value": css}));
        v[ELEMENT].as_str().unwrap_or_else(|| panic!("no element id for `{css}`: {v}")).to_string()
    }

    pub fn click(&self, css: &str) {
        let id = self.find(css);
        self.cmd("POST", &format!("/element/{id}/click"), json!({}));
    }

    /// Types `text` into the element, after clearing it.
    pub fn fill(&self, css: &str, text: &str) {
        let id = self.find(css);
        self.cmd("POST", &format!("/element/{id}/clear"), json!({}));
        self.cmd("POST", &format!("/element/{id}/value"), json!({"text": text}));
    }

    /// Chooses the file at `path` in a file input, as a user picking it in the file dialog.
    pub fn upload(&self, css: &str, path: &Path) {
        let id = self.find(css);
        self.cmd("POST", &format!("/element/{id}/value"), json!({"text": path.display().to_string()}));
    }

    /// Runs `script` (a function body; `arguments[i]` are `args`) in the page and returns its value.
    pub fn exec(&self, script: &str, args: Value) -> Value {
        self.cmd("POST", "/execute/sync", json!({"script": script, "args": args}))
    }

    /// An element's text as the user sees it.
    pub fn text(&self, css: &str) -> String {
        let v =
            self.exec("const e = document.querySelector(arguments[0]); return e ? e.innerText : null;", json!([css]));
        v.as_str().unwrap_or_else(|| panic!("no element `{css}`")).to_string()
    }

    /// Polls `script` until it returns something truthy (not null/false/""), which it returns; panics with
    /// `what` and the page's error line, if any, after `timeout`.
    pub fn wait_for(&self, script: &str, timeout: Duration, what: &str) -> Value {
        let t0 = Instant::now();
        loop {
            let v = self.exec(script, json!([]));
            if !matches!(&v, Value::Null | Value::Bool(false)) && v != json!("") {
                return v;
            }
            if t0.elapsed() > timeout {
                let err = self.exec("return document.getElementById('error')?.innerText || ''", json!([]));
                panic!("waited {timeout:?} for {what}; the page's error line: {err}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Saves a PNG of the browser window at `path` and prints where.
    pub fn screenshot(&self, path: &Path) {
        let v = self.call("GET", "/screenshot", None).unwrap_or_else(|e| panic!("webdriver: {e}"));
        let png = askgui_data::convert::base64_decode(v.as_str().expect("base64 screenshot")).expect("base64");
        std::fs::write(path, png).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        println!("page screenshot: {}", path.display());
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if self.base.contains("/session/") {
            let _ = self.http.delete(&self.base).timeout(Duration::from_secs(10)).call();
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}
