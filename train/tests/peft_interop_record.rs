//! The trainer's default adapter is the one the last interop check loaded in PEFT. The check itself,
//! `scripts/checks/peft_interop.py`, needs torch, transformers and peft, so it stays outside the test suite;
//! a passing run writes `scripts/checks/peft_interop.json`: the versions it ran, the trainer flags it used,
//! the layout the trainer wrote by default and the adapter keys PEFT expected on that stack. This test
//! trains one step with those flags and default everything else, and compares the keys of the checkpoint
//! with PEFT's. A change of the default layout or of the key mapping fails here until the interop check is
//! run again (and passes) on the new default.

use std::path::{Path, PathBuf};

use askgui_data::synth::{synth, SynthArgs};
use askgui_model::AdapterLayout;
use askgui_train::cli::from_args;
use serde_json::Value;

const RECORD: &str = "scripts/checks/peft_interop.json";
const RERUN: &str = "run `python scripts/checks/peft_interop.py --record scripts/checks/peft_interop.json` \
                     with today's transformers and PEFT, and commit the record it writes";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn record() -> Value {
    let path = repo().join(RECORD);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}; {RERUN}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn strings(v: &Value) -> Vec<String> {
    serde_json::from_value(v.clone()).expect("a list of strings")
}

#[test]
fn the_record_is_a_passing_check_on_transformers_5() {
    let r = record();
    assert!(r["transformers"].as_str().unwrap().starts_with("5."), "{}", r["transformers"]);
    assert!(r["peft"].is_string() && r["checked"].is_string());
    for (direction, res) in r["results"].as_object().unwrap() {
        for field in ["missing", "unexpected", "missing_keys", "unexpected_keys", "mismatched_keys", "warnings"] {
            assert!(res.get(field).is_none_or(|n| n == 0), "{direction}: {field} = {}", res[field]);
        }
        let (diff, limit) = (res["max_abs_diff"].as_f64().unwrap(), res["limit"].as_f64().unwrap());
        assert!(diff <= limit, "{direction}: logits differ by {diff} > {limit}");
        assert!(res["vision_lora_effect"].as_f64().unwrap() > 10.0 * limit, "{direction}: vision LoRA not applied");
    }
    assert_eq!(r["results"].as_object().unwrap().len(), 3, "PEFT -> askgui, askgui -> PEFT and merged");
}

#[test]
fn the_trainers_default_adapter_has_the_keys_peft_expected_in_the_interop_check() {
    let r = record();
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("askgui-interop-record");
    let _ = std::fs::remove_dir_all(&dir);
    synth(&SynthArgs {
        out: dir.join("data"),
        episodes: 2,
        seed: 5,
        width: 224,
        height: 400,
        split: "1:0:0".into(),
        ambiguous_fraction: 0.5,
        slot_colors: false,
        grid: 0,
        icons: false,
    })
    .unwrap();
    let model = repo().join(r["model"].as_str().unwrap());
    let mut argv: Vec<String> = vec!["askgui-train".into(), "--model".into(), model.display().to_string()];
    argv.extend(["--data".into(), dir.join("data/train.jsonl").display().to_string()]);
    argv.extend(["--output-dir".into(), dir.join("run").display().to_string()]);
    // The record's flags with one step instead of its few: the keys do not depend on the steps.
    let flags = strings(&r["trainer_flags"]);
    let mut it = flags.iter();
    while let Some(f) = it.next() {
        if f == "--max-steps" {
            it.next();
        } else {
            argv.push(f.clone());
        }
    }
    argv.extend(["--max-steps".into(), "1".into()]);
    let (cfg, control) = from_args(argv).unwrap();
    assert!(control.resume.is_none() && control.stop_after.is_none(), "{control:?}");
    let layout = AdapterLayout::from(cfg.run.adapter_keys);
    assert_eq!(
        layout.name(),
        r["trainer_default_layout"].as_str().unwrap(),
        "the trainer's default key layout is not the one the interop check verified; {RERUN}"
    );

    let summary = askgui_train::train(&cfg, &control).unwrap();
    let ckpt = summary.last_checkpoint.expect("a checkpoint");
    let weights =
        candle_core::safetensors::load(ckpt.join("adapter_model.safetensors"), &candle_core::Device::Cpu).unwrap();
    let mut keys: Vec<String> = weights.into_keys().collect();
    keys.sort();
    assert_eq!(
        keys,
        strings(&r["peft_keys"]),
        "the trainer's default adapter keys differ from those PEFT {} expected on transformers {}; {RERUN}",
        r["peft"],
        r["transformers"]
    );
    let card = std::fs::read_to_string(ckpt.join("README.md")).unwrap();
    assert!(card.contains(&format!("askgui_key_layout: {}\n", layout.name())), "{card}");
}
