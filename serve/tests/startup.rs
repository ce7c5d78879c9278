//! Start-up failures are loud: the built `askgui-serve` binary exits non-zero with the loader's message
//! when the model does not load (unless `--stay-up-on-load-failure`), and names a port that is in use
//! with the way out (`--port 0`). The model is an empty directory: it fails at once, with no download.

mod common;

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const BIN: &str = env!("CARGO_BIN_EXE_askgui-serve");

fn serve_cmd(args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(args).env("RUST_LOG", "info").stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
    // Flags only: no environment variable of a developer's shell may change the test.
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("ASKGUI_SERVE_")) {
        cmd.env_remove(k);
    }
    cmd
}

/// Waits for the process to exit (at most 60 s); its status and everything it wrote to stderr.
fn wait_exit(mut child: Child) -> (std::process::ExitStatus, String) {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
            return (status, err);
        }
        if start.elapsed() > Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("askgui-serve did not exit within 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn empty_model_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("askgui-startup-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn a_model_that_does_not_load_ends_the_process_with_the_loaders_message() {
    let dir = empty_model_dir("exit");
    let model = dir.to_str().unwrap();
    let child = serve_cmd(&["--model", model, "--port", "0", "--device", "cpu"]).spawn().unwrap();
    let (status, err) = wait_exit(child);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!status.success(), "exited {status}: {err}");
    assert!(err.contains(&format!("the model `{model}` failed to load")), "{err}");
    assert!(err.contains("no config.json"), "the loader's reason: {err}");
    assert!(err.contains("--stay-up-on-load-failure"), "{err}");
}

#[test]
fn stay_up_on_load_failure_keeps_serving_health_and_503s() {
    let dir = empty_model_dir("stay");
    let args = ["--model", dir.to_str().unwrap(), "--port", "0", "--device", "cpu", "--stay-up-on-load-failure"];
    let mut child = serve_cmd(&args).spawn().unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("askgui-serve ended before listening").unwrap();
        if let Some(at) = line.split("listening on http://").nth(1) {
            break at.trim().to_string();
        }
    };
    let start = Instant::now();
    let health = loop {
        let r = get(&format!("http://{addr}/health"));
        if r.json()["status"] != "loading" || start.elapsed() > Duration::from_secs(30) {
            break r;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // Still up after the failure was logged.
    std::thread::sleep(Duration::from_millis(300));
    let step = post(&format!("http://{addr}/v1/agent/step"), &step_body("t", 8, 8));
    let still_running = child.try_wait().unwrap().is_none();
    child.kill().unwrap();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!((health.status, health.json()["status"].as_str()), (503, Some("failed")), "{}", health.body);
    assert!(health.json()["error"].as_str().unwrap().contains("no config.json"), "{}", health.body);
    assert_eq!(step.status, 503, "{}", step.body);
    assert!(still_running, "the process exited despite --stay-up-on-load-failure");
}

#[test]
fn a_port_in_use_is_named_with_the_way_out() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let child = serve_cmd(&["--stub", "--model", MODEL, "--port", &port.to_string()]).spawn().unwrap();
    let (status, err) = wait_exit(child);
    assert!(!status.success(), "exited {status}: {err}");
    assert!(err.contains(&format!("cannot listen on 127.0.0.1:{port}")), "{err}");
    assert!(err.contains(&format!("port {port} is in use")) && err.contains("--port 0"), "{err}");

    // The library says the same to an embedding program.
    let mut cfg = config();
    cfg.port = port;
    let e = askgui_serve::start(cfg, stub_factory(Default::default())).err().expect("the port is taken");
    assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse);
    assert!(e.to_string().contains("--port 0"), "{e}");
    drop(taken);
}
