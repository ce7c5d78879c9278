//! Training on real screenshots: the ScreenAgent sample (desktop sessions, see its README) converted by
//! askgui-data's converter, LoRA-trained on the tiny random fixture: the loss falls, a stopped and resumed
//! run repeats the uninterrupted one, and the adapter loads into the model.
//!
//! The sample is not in the repository: the test looks for `../shared/data/screenagent-train-sample`
//! beside the checkout (or `ASKGUI_SCREENAGENT`) and SKIPS with a message when it is absent. The converted
//! episodes go to the target's tmp folder. About 30 s in a debug build (12 steps of 2 sequences, twice, on
//! 2 cores).

use std::path::{Path, PathBuf};

use askgui_model::Qwen2Vl;
use askgui_train::cli::from_args;
use askgui_train::{RunControl, TrainConfig};
use candle_core::{DType, Device};

fn sample_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("ASKGUI_SCREENAGENT")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/screenagent-train-sample"));
    dir.is_dir().then_some(dir)
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/tiny-qwen2_5_vl")
}

fn config(data: &Path, out: &Path, flags: &str) -> TrainConfig {
    let mut argv: Vec<String> = ["askgui-train", "--model"].map(String::from).to_vec();
    argv.push(fixture().display().to_string());
    for (k, v) in [("--data", data), ("--output-dir", out)] {
        argv.extend([k.to_string(), v.display().to_string()]);
    }
    // Desktop screenshots shrunk to a few patches; the fixture's byte-level vocabulary makes the long
    // ScreenAgent tasks thousands of tokens, so the context is cut (oldest history first).
    argv.extend(
        "--max-pixels 12544 --max-seq-len 1024 --progress false --lr 1e-2 --warmup-steps 0 --min-lr-ratio 1 \
         --batch-size 1 --grad-accum 2 --lora-rank 8 --lora-dropout 0 --seed 1"
            .split_whitespace()
            .map(String::from),
    );
    argv.extend(flags.split_whitespace().map(String::from));
    from_args(argv).unwrap().0
}

#[test]
fn screenagent_sample_trains_resumes_and_loads() {
    let Some(input) = sample_dir() else {
        eprintln!(
            "SKIPPED screenagent_sample_trains_resumes_and_loads: no ../shared/data/screenagent-train-sample \
             (or set ASKGUI_SCREENAGENT)"
        );
        return;
    };
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("askgui-train-screenagent");
    let _ = std::fs::remove_dir_all(&dir);
    let report = askgui_data::convert::convert_screenagent(&input, &dir.join("data")).unwrap();
    eprintln!("converted {} episodes, {} steps", report.episodes, report.steps);
    let data = dir.join("data/episodes.jsonl");

    let flags = "--max-steps 12 --save-every 6";
    let full = askgui_train::train(&config(&data, &dir.join("full"), flags), &RunControl::default()).unwrap();
    let losses: Vec<f64> = full.steps.iter().map(|s| s.loss).collect();
    eprintln!("losses: {losses:?}");
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    assert!(mean(&losses[9..]) < 0.75 * mean(&losses[..3]), "{losses:?}");

    let part = dir.join("part");
    let stop = RunControl { stop_after: Some(6), ..RunControl::default() };
    askgui_train::train(&config(&data, &part, flags), &stop).unwrap();
    let resume = RunControl { resume: Some(part.clone()), ..RunControl::default() };
    let rest = askgui_train::train(&config(&data, &part, flags), &resume).unwrap();
    let resumed: Vec<f64> = rest.steps.iter().map(|s| s.loss).collect();
    assert_eq!(resumed, losses[6..], "the resumed steps repeat the uninterrupted run's");

    let ckpt = full.last_checkpoint.unwrap();
    let mut model = Qwen2Vl::load(fixture().to_str().unwrap(), &Device::Cpu, DType::F32).unwrap();
    model.load_adapter("trained", &ckpt).unwrap();
    eprintln!("adapter {} loads", ckpt.display());
}
