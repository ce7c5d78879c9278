//! `askgui-eval` as a user meets it: help texts without rustdoc link syntax and with the server's real
//! address, and the user's own mistakes (a wrong `--model` path, a run folder given as `--adapter`)
//! reported as such, never as an internal error.

use std::path::{Path, PathBuf};
use std::process::Command;

use askgui_data::synth::{synth, SynthArgs};

fn eval(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_askgui-eval")).args(args).output().expect("askgui-eval runs");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code(), text(&out.stdout), text(&out.stderr))
}

fn tmp(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("askgui-eval-cli-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures")
}

/// One synthetic episode; returns its file.
fn one_episode(dir: &Path) -> PathBuf {
    synth(&SynthArgs {
        out: dir.into(),
        episodes: 1,
        seed: 3,
        width: 224,
        height: 400,
        split: "1:0:0".into(),
        ambiguous_fraction: 0.0,
        slot_colors: false,
        grid: 0,
        icons: false,
    })
    .unwrap();
    dir.join("train.jsonl")
}

#[test]
fn help_texts_have_no_rustdoc_links_and_the_servers_port() {
    for args in [
        &["--help"][..],
        &["run", "--help"],
        &["calibrate", "--help"],
        &["sensitivity", "--help"],
        &["score-text", "--help"],
    ] {
        let (code, text, err) = eval(args);
        assert_eq!(code, Some(0), "{args:?}: {err}");
        assert!(!text.contains("[`") && !text.contains("`]"), "{args:?} shows rustdoc link syntax:\n{text}");
        assert!(!text.contains("8080"), "{args:?}: askgui-serve does not listen on 8080:\n{text}");
    }
    // askgui-serve listens on 127.0.0.1:8000 unless told otherwise (its --port default, the README).
    let (_, text, _) = eval(&["run", "--help"]);
    assert!(text.contains("e.g. http://127.0.0.1:8000 (requests go to {base}/v1/agent/step)"), "{text}");
}

#[test]
fn a_wrong_model_path_is_the_users_error_not_an_internal_one() {
    let dir = tmp("wrong-model");
    let episodes = one_episode(&dir);
    let missing = dir.join("no-such-model");
    let (e, o, m) = (episodes.to_str().unwrap(), dir.join("out"), missing.to_str().unwrap());
    let (code, _, err) = eval(&["run", "--episodes", e, "--out", o.to_str().unwrap(), "--model", m]);
    assert_eq!(code, Some(2), "{err}");
    assert!(!err.contains("internal"), "{err}");
    assert!(err.contains(&format!("model: checkpoint {m}: not a directory")), "{err}");
    assert!(!o.exists(), "nothing was evaluated, so no --out folder");
}

#[test]
fn a_run_folder_given_as_adapter_names_its_checkpoints() {
    let dir = tmp("run-folder");
    let episodes = one_episode(&dir);
    let run = dir.join("run");
    for step in ["checkpoint-0000001", "checkpoint-0000002"] {
        std::fs::create_dir_all(run.join(step)).unwrap();
        for f in ["adapter_config.json", "adapter_model.safetensors"] {
            std::fs::copy(fixtures().join("lora/tiny-qwen2_5_vl-peft").join(f), run.join(step).join(f)).unwrap();
        }
    }
    let model = fixtures().join("tiny-qwen2_5_vl");
    let (code, _, err) = eval(&[
        "run",
        "--episodes",
        episodes.to_str().unwrap(),
        "--out",
        dir.join("out").to_str().unwrap(),
        "--model",
        model.to_str().unwrap(),
        "--adapter",
        run.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(!err.contains("internal"), "{err}");
    assert!(err.contains("a folder of 2 (checkpoint-0000001, checkpoint-0000002)"), "{err}");
    assert!(err.contains(&format!("e.g. {}", run.join("checkpoint-0000002").display())), "{err}");
}
