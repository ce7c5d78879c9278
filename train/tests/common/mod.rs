//! What the training tests share: the tiny fixture checkpoint, scratch folders, synthetic episodes, and
//! configs resolved from flags as the binary resolves them.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use askgui_data::synth::{synth, SynthArgs};
use askgui_train::cli::from_args;
use askgui_train::TrainConfig;

pub fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/tiny-qwen2_5_vl")
}

/// A fresh folder under the target's tmp dir.
pub fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("askgui-train-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `episodes` synthetic episodes (train split only) in `dir`; returns the JSONL path.
pub fn episodes(dir: &Path, episodes: usize) -> PathBuf {
    synth(&SynthArgs {
        out: dir.into(),
        episodes,
        seed: 11,
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

/// The config the binary would resolve from these flags (plus the fixture and tiny images).
pub fn config(data: &Path, out: &Path, flags: &str) -> TrainConfig {
    let (m, d, o) = (fixture(), data.to_path_buf(), out.to_path_buf());
    let mut argv: Vec<String> = ["askgui-train", "--model"].map(String::from).to_vec();
    argv.push(m.display().to_string());
    argv.extend(["--data".into(), d.display().to_string(), "--output-dir".into(), o.display().to_string()]);
    argv.extend(["--max-pixels", "12544", "--progress", "false"].map(String::from));
    argv.extend(flags.split_whitespace().map(String::from));
    from_args(argv).unwrap().0
}
