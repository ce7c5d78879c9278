//! The periodic eval on the tiny random Qwen2.5-VL fixture with synthetic episodes: next to the validation
//! loss, the model runs as an agent on validation episodes through askgui-eval (standard mode) and its
//! SSR, SR and ASK precision / recall / F1 land in metrics.jsonl under stable keys; one validation sample's
//! prediction and target land in samples.jsonl. `--eval-episodes 0` turns the agent eval off.
//!
//! The model is random, so the values say nothing about quality; the tests check the keys, that the
//! ratios are ratios, and that the counts are those of the episodes given.

use std::path::{Path, PathBuf};

use askgui_data::synth::{synth, SynthArgs};
use askgui_train::cli::from_args;
use askgui_train::{RunControl, TrainConfig};
use serde_json::Value;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/tiny-qwen2_5_vl")
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("askgui-train-eval-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Three synthetic episodes (tiny screens) in `dir/train.jsonl`, used as training and validation data.
fn episodes(dir: &Path) -> PathBuf {
    synth(&SynthArgs {
        out: dir.into(),
        episodes: 3,
        seed: 3,
        width: 224,
        height: 400,
        split: "1:0:0".into(),
        // Every task ambiguous, so the evaluated episodes have ASK steps (recall and F1 are defined).
        ambiguous_fraction: 1.0,
        slot_colors: false,
        grid: 0,
        icons: false,
    })
    .expect("synth");
    dir.join("train.jsonl")
}

fn config(data: &Path, out: &Path, flags: &str) -> TrainConfig {
    let mut argv: Vec<String> = ["askgui-train", "--model"].map(String::from).to_vec();
    argv.push(fixture().display().to_string());
    for (k, v) in [("--data", data), ("--val", data), ("--output-dir", out)] {
        argv.extend([k.to_string(), v.display().to_string()]);
    }
    argv.extend(
        "--max-pixels 12544 --progress false --max-steps 2 --batch-size 1 --grad-accum 1 --lora-rank 4 \
         --save-checkpoints false --eval-every 1 --eval-samples 2 --eval-max-new-tokens 12"
            .split_whitespace()
            .map(String::from),
    );
    argv.extend(flags.split_whitespace().map(String::from));
    from_args(argv).unwrap().0
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn is_ratio(v: &Value) -> bool {
    v.as_f64().is_some_and(|x| (0.0..=1.0).contains(&x))
}

#[test]
fn eval_logs_agent_metrics_and_a_sample_prediction() {
    let dir = scratch("on");
    let data = episodes(&dir);
    let run = dir.join("run");
    let s = askgui_train::train(&config(&data, &run, "--eval-episodes 2"), &RunControl::default()).unwrap();
    assert_eq!(s.agent_metrics.iter().map(|m| m.0).collect::<Vec<_>>(), [1, 2]);

    let evals: Vec<Value> =
        lines(&run.join("metrics.jsonl")).into_iter().filter(|v| v.get("val_loss").is_some()).collect();
    assert_eq!(evals.len(), 2);
    // The synthetic episodes have annotated ASK steps, so recall and F1 are defined; precision is null
    // when the agent never asks (a ratio over nothing), else a ratio.
    let steps: usize = askgui_data::load_episodes(&data).unwrap()[..2].iter().map(|e| e.episode.steps.len()).sum();
    for e in &evals {
        eprintln!("{e}");
        assert_eq!(e["eval_mode"], "standard");
        assert_eq!(e["eval_episodes"], 2);
        assert_eq!(e["eval_skipped"], 0);
        assert_eq!(e["eval_steps"].as_u64(), Some(steps as u64));
        for k in ["ssr", "sr", "ask_recall", "ask_f1"] {
            assert!(is_ratio(&e[k]), "{k} = {}", e[k]);
        }
        assert!(e["ask_precision"].is_null() || is_ratio(&e["ask_precision"]), "{}", e["ask_precision"]);
        assert!(e["val_loss"].as_f64().is_some_and(f64::is_finite));
    }

    let samples = lines(&run.join("samples.jsonl"));
    assert_eq!(samples.iter().map(|v| v["step"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2]);
    for v in &samples {
        assert!(v["predicted"].is_string() && v["episode"].is_string() && v["episode_step"].is_u64(), "{v}");
        let target = v["target"].as_str().unwrap();
        assert!(target.contains("\"action\""), "the target is an action's text: {target}");
    }
    assert_eq!(s.samples.len(), 2);
}

#[test]
fn eval_episodes_zero_turns_the_agent_eval_off() {
    let dir = scratch("off");
    let data = episodes(&dir);
    let run = dir.join("run");
    let s = askgui_train::train(&config(&data, &run, "--eval-episodes 0"), &RunControl::default()).unwrap();
    assert!(s.agent_metrics.is_empty());
    let evals: Vec<Value> =
        lines(&run.join("metrics.jsonl")).into_iter().filter(|v| v.get("val_loss").is_some()).collect();
    assert_eq!(evals.len(), 2);
    assert!(evals.iter().all(|e| e.get("ssr").is_none() && e.get("ask_f1").is_none()), "{evals:?}");
    // The sample prediction stays: it costs one generation.
    assert_eq!(lines(&run.join("samples.jsonl")).len(), 2);
}
