//! Checkpoints that work from any folder: a run started with relative paths stores them absolute (a hub id
//! stays a hub id) and resumes from another folder into its run folder, wherever that moved; an older
//! checkpoint's relative path that is not there is named with the flag to pass; a run folder given where
//! one checkpoint is expected names the checkpoints inside it; `convert-adapter` leaves the training state
//! out; a run that fails before writing anything leaves no empty output folder; the data's counts are
//! logged as words.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use askgui_train::cli::from_args;
use askgui_train::merge::MergeArgs;
use askgui_train::snapshot::{OPTIMIZER_FILE, STATE_FILE};
use askgui_train::RunControl;
use common::{episodes, fixture, scratch};

fn train_in(cwd: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_askgui-train"))
        .current_dir(cwd)
        .args(args)
        .env("RUST_LOG", "info")
        .output()
        .expect("askgui-train runs");
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn read_toml(path: &Path) -> toml::Table {
    toml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn a_run_with_relative_paths_stores_them_absolute_and_resumes_from_anywhere_in_its_folder() {
    let dir = scratch("paths-relative");
    episodes(&dir, 1);
    std::os::unix::fs::symlink(fixture(), dir.join("base")).unwrap();
    let elsewhere = dir.join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    let tiny = "--max-pixels 12544 --max-steps 2 --batch-size 1 --grad-accum 1 --lora-rank 2 --progress false \
                --eval-episodes 0";
    let mut args = vec!["--model", "base", "--data", "train.jsonl", "--output-dir", "run", "--stop-after", "1"];
    args.extend(tiny.split_whitespace());
    let (ok, err) = train_in(&dir, &args);
    assert!(ok, "{err}");
    // The data's counts are a sentence, not a Rust struct: one episode file line is "1 record".
    assert!(err.contains("1 record (0 skipped)") && !err.contains("DataStats"), "{err}");

    // Every path, as the first run gave it relative to `dir`, is stored as `dir`'s absolute path.
    let ckpt = dir.join("run/checkpoint-0000001");
    let cfg = read_toml(&ckpt.join("config.toml"));
    let abs = |rel: &str| dir.join(rel).display().to_string();
    assert_eq!(cfg["model"]["model"].as_str(), Some(abs("base").as_str()));
    assert_eq!(cfg["data"]["data"].as_str(), Some(abs("train.jsonl").as_str()));
    assert_eq!(cfg["run"]["output_dir"].as_str(), Some(abs("run").as_str()));
    let adapter = read_json(&ckpt.join("adapter_config.json"));
    assert_eq!(adapter["base_model_name_or_path"].as_str(), Some(abs("base").as_str()));

    // The run folder moved, and resumed from another folder by its new path alone: the run goes on in it.
    std::fs::create_dir_all(dir.join("moved")).unwrap();
    std::fs::rename(dir.join("run"), dir.join("moved/run")).unwrap();
    let (ok, err) = train_in(&elsewhere, &["--resume", dir.join("moved/run").to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(dir.join("moved/run/checkpoint-0000002").join(STATE_FILE).is_file());
    assert!(!dir.join("run").exists(), "the old place is not written again");
    assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0, "nothing is written where it ran");
}

#[test]
fn a_hub_id_stays_a_hub_id_and_local_paths_become_absolute() {
    let (cfg, _) = from_args(["askgui-train", "--model", "Qwen/Qwen2.5-VL-3B-Instruct", "--data", "d.jsonl"]).unwrap();
    let abs = cfg.with_absolute_paths().unwrap();
    // No folder of that name is here, so it is a hub id and must stay one (PEFT resolves it on the hub).
    assert!(!Path::new("Qwen/Qwen2.5-VL-3B-Instruct").exists());
    assert_eq!(abs.model.model.as_deref(), Some("Qwen/Qwen2.5-VL-3B-Instruct"));
    let here = std::env::current_dir().unwrap();
    assert_eq!(abs.data.data, Some(here.join("d.jsonl")));
    assert_eq!(abs.run.output_dir, here.join("runs/askgui-train"), "the default --output-dir");
}

/// A folder that `--resume` takes for a checkpoint: a trainer state and the given config.toml.
fn fake_checkpoint(dir: &Path, config: &str) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join(STATE_FILE), "{}").unwrap();
    std::fs::write(dir.join("config.toml"), config).unwrap();
}

#[test]
fn an_older_checkpoints_relative_path_that_is_not_here_is_named_with_its_flag() {
    let dir = scratch("paths-older");
    let ckpt = dir.join("run/checkpoint-0000003");
    // As runs before absolute paths wrote it, started in the repository root.
    fake_checkpoint(
        &ckpt,
        "[model]\nmodel = \"model/tests/fixtures/tiny-qwen2_5_vl\"\n[data]\ndata = \"target/tiny/train.jsonl\"\n",
    );
    // The tests run in train/, where neither relative path exists.
    assert!(!Path::new("model/tests/fixtures/tiny-qwen2_5_vl").exists());
    let e = from_args(["askgui-train", "--resume", dir.join("run").to_str().unwrap()]).unwrap_err().to_string();
    assert!(e.contains("relative path model = \"model/tests/fixtures/tiny-qwen2_5_vl\""), "{e}");
    assert!(e.contains(&ckpt.join("config.toml").display().to_string()) && e.contains("pass --model"), "{e}");
    // Given the model from here, the data path is the next one named.
    let model = fixture().display().to_string();
    let e = from_args(["askgui-train", "--resume", dir.join("run").to_str().unwrap(), "--model", &model])
        .unwrap_err()
        .to_string();
    assert!(e.contains("relative path data = \"target/tiny/train.jsonl\"") && e.contains("pass --data"), "{e}");
}

/// A run folder holding two checkpoints of the fixture's PEFT adapter.
fn run_folder(dir: &Path) -> PathBuf {
    let run = dir.join("run");
    let adapter = fixture().join("../lora/tiny-qwen2_5_vl-peft");
    for step in ["checkpoint-0000002", "checkpoint-0000004"] {
        std::fs::create_dir_all(run.join(step)).unwrap();
        for f in ["adapter_config.json", "adapter_model.safetensors"] {
            std::fs::copy(adapter.join(f), run.join(step).join(f)).unwrap();
        }
    }
    std::fs::write(run.join("metrics.jsonl"), "").unwrap();
    run
}

#[test]
fn a_run_folder_where_a_checkpoint_is_expected_names_its_checkpoints() {
    let dir = scratch("paths-run-folder");
    let run = run_folder(&dir);
    let last = run.join("checkpoint-0000004").display().to_string();
    let check = |e: String| {
        assert!(e.contains("a folder of 2 (checkpoint-0000002, checkpoint-0000004)"), "{e}");
        assert!(e.contains(&format!("e.g. {last}")), "{e}");
    };
    let merge = MergeArgs { model: fixture().display().to_string(), adapter: run.clone(), out: dir.join("merged") };
    check(askgui_train::merge::merge(&merge).unwrap_err().to_string());
    let (run_s, out_s, model_s) =
        (run.display().to_string(), dir.join("converted").display().to_string(), fixture().display().to_string());
    let argv = ["convert-adapter", "--in", &run_s, "--out", &out_s, "--to", "hub", "--model", &model_s];
    check(askgui_train::convert_adapter::run_cli(argv).unwrap_err().to_string());
    // And so without --model, where the base is read from the adapter's config.
    let argv = ["convert-adapter", "--in", &run_s, "--out", &out_s, "--to", "hub"];
    check(askgui_train::convert_adapter::run_cli(argv).unwrap_err().to_string());
}

#[test]
fn convert_adapter_leaves_a_checkpoints_training_state_out() {
    let dir = scratch("paths-convert-state");
    let ckpt = run_folder(&dir).join("checkpoint-0000004");
    std::fs::write(ckpt.join(OPTIMIZER_FILE), "optimiser moments").unwrap();
    std::fs::write(ckpt.join(STATE_FILE), "{}").unwrap();
    std::fs::write(ckpt.join("askgui.json"), "{\"version\": 1}\n").unwrap();
    let (in_s, out_s, model_s) =
        (ckpt.display().to_string(), dir.join("hub").display().to_string(), fixture().display().to_string());
    let s = askgui_train::convert_adapter::run_cli([
        "convert-adapter",
        "--in",
        &in_s,
        "--out",
        &out_s,
        "--to",
        "hub",
        "--model",
        &model_s,
    ])
    .unwrap();
    assert_eq!(s.conversion.copied, ["askgui.json"], "the card travels, the training state does not");
    let mut written: Vec<String> =
        std::fs::read_dir(&s.out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    written.sort();
    assert_eq!(written, ["README.md", "adapter_config.json", "adapter_model.safetensors", "askgui.json"]);
}

#[test]
fn a_run_that_fails_before_writing_leaves_no_empty_output_folder() {
    let dir = scratch("paths-failed-run");
    let data = episodes(&dir, 1);
    let out = dir.join("runs/first");
    let (cfg, _) = from_args([
        "askgui-train",
        "--model",
        dir.join("no-such-model").to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
    ])
    .unwrap();
    let e = askgui_train::train(&cfg, &RunControl::default()).unwrap_err().to_string();
    assert!(e.contains("no-such-model"), "{e}");
    assert!(!dir.join("runs").exists(), "the folders the run created are gone");
}
