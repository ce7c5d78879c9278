//! The trainer loads episodes through the checks of `askgui-data validate`: an episode that `validate`
//! rejects (here a click at x=5000 on a 224-pixel screen) is a bad record, an error naming its line, or
//! left out and counted with `--skip-bad-records`.

use std::path::{Path, PathBuf};

use askgui_data::synth::{synth, SynthArgs};
use askgui_data::validate::validate_file;
use askgui_data::PromptConfig;
use askgui_model::{ImageProcessorConfig, QwenTokenizer};
use askgui_train::data::{load_dataset, DataOptions};
use askgui_train::TrainError;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/tiny-qwen2_5_vl")
}

#[test]
fn an_episode_that_validate_rejects_is_a_bad_record() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("askgui-train-validated-data");
    let _ = std::fs::remove_dir_all(&dir);
    let args = SynthArgs {
        out: dir.clone(),
        episodes: 3,
        seed: 11,
        width: 224,
        height: 400,
        split: "1:0:0".into(),
        ambiguous_fraction: 0.0,
        slot_colors: false,
        grid: 0,
        icons: false,
    };
    synth(&args).expect("synth");
    let data = dir.join("train.jsonl");
    let text = std::fs::read_to_string(&data).unwrap();
    let mut lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    lines[1]["steps"][0]["action"] = serde_json::json!({"action": "click", "x": 5000, "y": 10});
    let out: Vec<String> = lines.iter().map(|v| v.to_string()).collect();
    std::fs::write(&data, out.join("\n") + "\n").unwrap();
    let report = validate_file(&data, false).unwrap();
    assert_eq!(report.problems.len(), 1, "validate rejects the off-screen click");

    let tok = QwenTokenizer::from_file(&fixture().join("tokenizer.json"), None).unwrap();
    let mut images = ImageProcessorConfig::from_file(&fixture().join("preprocessor_config.json")).unwrap();
    images.max_pixels = 12544;
    let opts = DataOptions {
        prompt: PromptConfig { min_pixels: images.min_pixels, max_pixels: images.max_pixels, ..Default::default() },
        task_mode: Default::default(),
        extra_task_modes: vec![],
        history_length: 0,
        max_seq_len: 8192,
        skip_bad_records: false,
        ask_repeat: 1,
        say_repeat: 1,
        dialog_repeat: 1,
        region_words: false,
    };
    let e = load_dataset(&data, &opts, &tok, &images).expect_err("the off-screen click is refused");
    let msg = e.to_string();
    assert!(matches!(e, TrainError::BadRecord { line: 2, .. }), "{msg}");
    assert!(msg.contains("outside the 224x400 screen"), "{msg}");

    let skip = DataOptions { skip_bad_records: true, ..opts };
    let d = load_dataset(&data, &skip, &tok, &images).unwrap();
    assert_eq!((d.stats.records, d.stats.bad_records), (3, 1));
    assert!(d.samples.iter().all(|s| s.line != 2) && !d.samples.is_empty());
}
