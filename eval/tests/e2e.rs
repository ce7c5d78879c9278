//! End to end through the `askgui-eval` binary: synthetic episodes from askgui-data, scored (a) against a
//! real HTTP endpoint started here (an OpenAI-compatible server that always answers `done`, so every
//! number of the report is known in advance) and (b) with the in-process backend on the tiny random
//! checkpoint of askgui-model's fixtures (with its two test LoRA adapters). Also resuming: an `--out` made
//! by another agent or decoding is refused with the field that differs, `--restart` discards it. And
//! `calibrate`: its threshold lands in the adapter's askgui.json and the next `run` evaluates with it.

use std::ffi::OsStr;
use std::fmt::Debug;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use askgui_data::load_episodes;
use askgui_data::synth::{synth, SynthArgs};
use serde_json::Value;

fn tmp(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("askgui-eval-e2e-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Six synthetic episodes (about half ambiguous) at a small screen size.
fn episodes(dir: &Path) -> PathBuf {
    synth(&SynthArgs {
        out: dir.into(),
        episodes: 6,
        seed: 5,
        width: 224,
        height: 400,
        split: "1:0:0".into(),
        ambiguous_fraction: 0.5,
        slot_colors: false,
        grid: 0,
        icons: false,
    })
    .expect("synth");
    dir.join("train.jsonl")
}

/// An OpenAI-compatible server on 127.0.0.1 answering every chat completion with `done`.
fn done_server() -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    let count = Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut len = 0usize;
            let mut line = String::new();
            while reader.read_line(&mut line).unwrap_or(0) > 0 && line != "\r\n" {
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap_or(0);
                }
                line.clear();
            }
            let mut body = vec![0; len];
            reader.read_exact(&mut body).unwrap();
            let req: Value = serde_json::from_slice(&body).unwrap();
            assert!(req["messages"][0]["content"].as_str().unwrap().contains("\"action\":\"ask\""), "system prompt");
            seen.fetch_add(1, Ordering::SeqCst);
            let answer = serde_json::json!({
                "choices": [{"index": 0, "message": {"role": "assistant",
                    "content": "Nothing left to do.\n{\"action\":\"done\",\"status\":\"success\"}"}}]
            })
            .to_string();
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{answer}",
                answer.len()
            );
        }
    });
    (url, count)
}

/// Runs the binary and expects it to refuse (exit 2); returns its stderr.
fn refused<S: AsRef<OsStr> + Debug>(args: &[S]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_askgui-eval")).args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "askgui-eval {args:?} should be refused:\n{stderr}");
    stderr
}

fn run<S: AsRef<OsStr> + Debug>(args: &[S]) -> std::process::Output {
    let out = Command::new(env!("CARGO_BIN_EXE_askgui-eval")).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "askgui-eval {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn http_endpoint_run_writes_the_reports_with_known_numbers() -> anyhow::Result<()> {
    let dir = tmp("http");
    let file = episodes(&dir.join("data"));
    let eps = load_episodes(&file)?;
    let (n, steps) = (eps.len(), eps.iter().map(|e| e.episode.steps.len()).sum::<usize>());
    // Navi-plus F.1: the mean over episodes of 1 / T_e (one right step each).
    let ssr = eps.iter().map(|e| 1.0 / e.episode.steps.len() as f64).sum::<f64>() / n as f64;
    let out = dir.join("run");
    let (url, calls) = done_server();
    let (f, o) = (file.to_str().unwrap(), out.to_str().unwrap());
    run(&["run", "--episodes", f, "--out", o, "--openai-base", &url, "--openai-model", "always-done", "--table"]);
    for name in ["report.json", "report.md", "step_accuracy.svg", "ask_offset.svg", "ask_behaviour.svg"] {
        assert!(out.join(name).is_file(), "{name} not written");
    }
    let report: Value = serde_json::from_str(&std::fs::read_to_string(out.join("report.json"))?)?;
    let original = report["modes"].as_array().unwrap().iter().find(|m| m["mode"] == "original").expect("original row");
    // Every synthetic episode ends with its only `done`: the agent is right on exactly one step each.
    assert_eq!(original["steps"], steps);
    assert_eq!(original["correct_steps"], n);
    assert!((original["ssr"].as_f64().unwrap() - ssr).abs() < 1e-12);
    assert!((original["ssr_pooled"].as_f64().unwrap() - n as f64 / steps as f64).abs() < 1e-12);
    assert_eq!(original["sr"], 0.0, "no episode is all right");
    let md = std::fs::read_to_string(out.join("report.md"))?;
    for row in ["original task", "incomplete task", "+ASK", "+Dual eval"] {
        assert!(md.contains(row), "report.md lacks the `{row}` row:\n{md}");
    }
    let svg = std::fs::read_to_string(out.join("step_accuracy.svg"))?;
    assert!(svg.starts_with("<svg") || svg.starts_with("<?xml"), "{}", &svg[..svg.len().min(80)]);

    // A second run finds every episode done: no new request.
    let before = calls.load(Ordering::SeqCst);
    assert!(before >= steps, "{before} requests for {steps} steps");
    run(&["run", "--episodes", f, "--out", o, "--openai-base", &url, "--openai-model", "always-done", "--table"]);
    assert_eq!(calls.load(Ordering::SeqCst), before, "a finished run must not ask again");
    Ok(())
}

#[test]
fn in_process_model_run() -> anyhow::Result<()> {
    let dir = tmp("inprocess");
    let file = episodes(&dir.join("data"));
    let out = dir.join("run");
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/tiny-qwen2_5_vl");
    run(&[
        "run",
        "--episodes",
        file.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--model",
        model.to_str().unwrap(),
        "--max-new-tokens",
        "4",
        "--modes",
        "standard",
        "--concurrency",
        "2",
    ]);
    let results = std::fs::read_to_string(out.join("results-standard.jsonl"))?;
    assert_eq!(results.lines().count(), load_episodes(&file)?.len());
    let report: Value = serde_json::from_str(&std::fs::read_to_string(out.join("report.json"))?)?;
    // A random model writes no valid action: every step is wrong, and that is measured, not an error.
    assert_eq!(report["modes"][0]["correct_steps"], 0);
    Ok(())
}

#[test]
fn an_out_made_with_other_settings_is_refused_and_not_asked_again() -> anyhow::Result<()> {
    let dir = tmp("other-settings");
    let file = episodes(&dir.join("data"));
    let out = dir.join("run");
    let (url, calls) = done_server();
    let (f, o) = (file.to_str().unwrap(), out.to_str().unwrap());
    let args = |tokens: &'static str| {
        let base = ["run", "--episodes", f, "--out", o, "--openai-base", &url, "--openai-model", "always-done"];
        let mut v: Vec<&str> = base.to_vec();
        v.extend(["--modes", "standard", "--max-new-tokens", tokens]);
        v
    };
    run(&args("128"));
    let before = calls.load(Ordering::SeqCst);

    let err = refused(&args("64"));
    assert!(err.contains("agent.decoding.max_new_tokens: stored 128, now 64"), "{err}");
    assert!(err.contains("use a new --out, or --restart"), "{err}");
    assert_eq!(calls.load(Ordering::SeqCst), before, "a refused run asks nothing");

    // Results from before runs were keyed (no identity.json) are refused too.
    std::fs::remove_file(out.join("identity.json"))?;
    let err = refused(&args("128"));
    assert!(err.contains("without an identity.json"), "{err}");
    assert_eq!(calls.load(Ordering::SeqCst), before);
    Ok(())
}

#[test]
fn another_adapter_is_refused_the_same_resumes_and_restart_reruns() -> anyhow::Result<()> {
    let dir = tmp("adapter");
    let file = episodes(&dir.join("data"));
    let n = load_episodes(&file)?.len();
    let out = dir.join("run");
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures");
    let model = fixtures.join("tiny-qwen2_5_vl");
    let (a, b) = (fixtures.join("lora/tiny-qwen2_5_vl-peft"), fixtures.join("lora/tiny-qwen2_5_vl-peft-qv"));
    let args = |adapter: &Path, extra: &[&'static str]| -> Vec<String> {
        let mut v: Vec<String> = ["run", "--episodes", file.to_str().unwrap(), "--out", out.to_str().unwrap()]
            .iter()
            .map(|s| s.to_string())
            .collect();
        for s in ["--model", model.to_str().unwrap(), "--adapter", adapter.to_str().unwrap()] {
            v.push(s.into());
        }
        v.extend(["--max-new-tokens", "2", "--modes", "standard"].iter().map(|s| s.to_string()));
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let results = out.join("results-standard.jsonl");

    run(&args(&a, &[]));
    let first = std::fs::read_to_string(&results)?;
    assert_eq!(first.lines().count(), n);
    let report: Value = serde_json::from_str(&std::fs::read_to_string(out.join("report.json"))?)?;
    let agent = &report["identity"]["agent"];
    assert_eq!(agent["adapter"], identity_path(&a));
    assert!(agent["adapter_fingerprint"].as_str().is_some_and(|f| f.contains("fnv1a64")), "{agent}");
    assert_eq!(agent["decoding"]["max_new_tokens"], 2);
    assert!(std::fs::read_to_string(out.join("report.md"))?.contains("Adapter: `"));

    let err = refused(&args(&b, &[]));
    assert!(err.contains("agent.adapter: stored "), "{err}");
    assert!(err.contains("agent.adapter_fingerprint: stored "), "{err}");
    assert!(err.contains("--restart"), "{err}");

    // The same agent resumes: every episode is done, nothing is appended.
    run(&args(&a, &[]));
    assert_eq!(std::fs::read_to_string(&results)?, first);

    // --restart discards the other adapter's results and runs again.
    let restarted = run(&args(&b, &["--restart"]));
    assert!(String::from_utf8_lossy(&restarted.stderr).contains("--restart: discarded"));
    assert_eq!(std::fs::read_to_string(&results)?.lines().count(), n);
    let report: Value = serde_json::from_str(&std::fs::read_to_string(out.join("report.json"))?)?;
    assert_eq!(report["identity"]["agent"]["adapter"], identity_path(&b));
    run(&args(&b, &[]));
    Ok(())
}

/// A path as the identity records it.
fn identity_path(p: &Path) -> String {
    std::fs::canonicalize(p).unwrap().display().to_string()
}

/// `calibrate` on the tiny checkpoint writes its threshold into the adapter's askgui.json, and a later
/// `run` with that adapter evaluates with it; a given `--pause-threshold` is refused, as is a run with
/// nowhere to write.
#[test]
fn calibrate_writes_the_threshold_that_run_then_evaluates_with() -> anyhow::Result<()> {
    let dir = tmp("calibrate");
    let file = episodes(&dir.join("data"));
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures");
    let model = fixtures.join("tiny-qwen2_5_vl");
    let adapter = dir.join("adapter");
    std::fs::create_dir_all(&adapter)?;
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(fixtures.join("lora/tiny-qwen2_5_vl-peft").join(f), adapter.join(f))?;
    }
    askgui_data::AdapterCard::new(&askgui_data::PromptConfig::default(), 0).write(&adapter)?;
    let (f, m, a) = (file.to_str().unwrap(), model.to_str().unwrap(), adapter.to_str().unwrap());
    let cal = dir.join("cal");
    let c = cal.to_str().unwrap();
    let common = ["--episodes", f, "--model", m, "--adapter", a, "--max-new-tokens", "4", "--no-progress"];

    run(&[&["calibrate", "--out", c][..], &common].concat());
    let calibration: Value = serde_json::from_str(&std::fs::read_to_string(cal.join("calibration.json"))?)?;
    let threshold = calibration["threshold"].as_f64().expect("a threshold");
    for name in ["calibration.md", "reliability.svg", "pr_curve.svg", "results-standard.jsonl", "results-strict.jsonl"]
    {
        assert!(cal.join(name).is_file(), "{name} not written");
    }
    let card = askgui_data::AdapterCard::read(&adapter)?.expect("the card");
    assert_eq!(card.pause_threshold(), Some(threshold));

    let out = dir.join("run");
    run(&[&["run", "--out", out.to_str().unwrap(), "--modes", "standard"][..], &common].concat());
    let report: Value = serde_json::from_str(&std::fs::read_to_string(out.join("report.json"))?)?;
    assert_eq!(report["identity"]["agent"]["decoding"]["pause_threshold"].as_f64(), Some(threshold));

    let err = refused(&[&["calibrate", "--out", c, "--pause-threshold", "0.5"][..], &common].concat());
    assert!(err.contains("leave --pause-threshold"), "{err}");
    let err = refused(&["calibrate", "--episodes", f, "--out", c, "--endpoint", "http://127.0.0.1:9"]);
    assert!(err.contains("--card DIR") && err.contains("--no-write"), "{err}");
    Ok(())
}
