//! `askgui-train demo` at a toy scale (a few steps, a few episodes): every stage runs through the library
//! functions and report.json holds every key under its stable name. It asserts nothing about the scores:
//! a toy run reaches none of the demo's targets, and the report must say so (`all_met` false). Both
//! families the demo can build run: Qwen2.5-VL and Qwen3-VL.

use askgui_data::{ActionLanguage, TaskMode};
use askgui_train::demo::{run, DemoArch, DemoArgs};

#[test]
fn toy_demo_writes_every_report_key() -> anyhow::Result<()> {
    toy_demo(DemoArch::Qwen25Vl, ActionLanguage::AskguiJson)
}

/// `--arch qwen3_vl`: the same run with the Qwen3-VL agent, its screens on the 32-pixel grid.
#[test]
fn toy_demo_builds_a_qwen3_vl_agent() -> anyhow::Result<()> {
    toy_demo(DemoArch::Qwen3Vl, ActionLanguage::AskguiJson)
}

/// `--action-language ui-tars`: both models' askgui.json say so, and the evaluation, which reads it there,
/// sends UI-TARS prompts and reads UI-TARS answers.
#[test]
fn toy_demo_speaks_ui_tars() -> anyhow::Result<()> {
    toy_demo(DemoArch::Qwen25Vl, ActionLanguage::UiTars)
}

fn toy_demo(arch: DemoArch, language: ActionLanguage) -> anyhow::Result<()> {
    let out = std::env::temp_dir().join(format!("askgui-demo-toy-{arch:?}-{language:?}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let args = DemoArgs {
        out: out.clone(),
        arch,
        action_language: language,
        episodes: 12,
        split: "8:1:3".into(),
        width: 160,
        height: 160,
        max_pixels: 12_544,
        ambiguous_fraction: 0.5,
        plain_slots: false,
        model_config: None,
        vocab_size: 300,
        base_extra: vec![TaskMode::Steps, TaskMode::Language, TaskMode::Describe],
        base_steps: 2,
        base_lr: 1e-3,
        region_weight: 1.0,
        region_layer: 1,
        lora_region_weight: 1.0,
        lora_steps: 2,
        lora_lr: 1e-3,
        lora_rank: 4,
        ask_repeat: 3,
        say_repeat: 2,
        dialog_repeat: 2,
        lora_extra: vec![TaskMode::Full],
        batch_size: 2,
        no_packing: false,
        micro_batch_threads: 2,
        eval_episodes: 2,
        max_new_tokens: 6,
        target_fpr: 0.05,
        seed: 1,
        no_progress: true,
    };
    let report = run(&args)?;
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("report.json"))?)?;
    for key in [
        "base_original",
        "base_incomplete",
        "base_blank_screen",
        "lora_original",
        "lora_standard",
        "lora_dual",
        "lora_strict",
        "calibrated_original",
        "calibrated_standard",
        "calibrated_dual",
        "calibrated_strict",
    ] {
        for field in [
            "ssr",
            "sr",
            "ssr_before",
            "ssr_after",
            "ssr_pooled",
            "ask_precision",
            "ask_recall",
            "ask_fpr",
            "ask_task_fpr",
            "ask_f1",
            "steps",
            "episodes",
        ] {
            assert!(json[key].get(field).is_some(), "report.json lacks {key}.{field}");
        }
        assert_eq!(json[key]["episodes"], 2, "{key}");
    }
    let names: Vec<&str> = json["checks"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(names.len(), 7, "{names:?}");
    assert_eq!(json["checks_uncalibrated"].as_array().map(Vec::len), Some(7));
    let threshold = json["calibration"]["threshold"].as_f64().expect("calibration.threshold");
    assert!((0.0..=1.0).contains(&threshold), "{threshold}");
    for k in ["target_fpr", "bound_met", "val_episodes", "val_fpr", "ece", "brier", "temperature", "dir"] {
        assert!(json["calibration"].get(k).is_some(), "report.json lacks calibration.{k}");
    }
    // The threshold is the adapter's served default, and the calibration's plots are written.
    let card = askgui_data::AdapterCard::read(&report.adapter)?.expect("the adapter's askgui.json");
    assert_eq!(card.pause_threshold(), Some(threshold));
    for f in ["calibration.md", "reliability.svg", "pr_curve.svg"] {
        assert!(out.join("eval/calibration").join(f).is_file(), "{f}");
    }
    for k in [
        "all_met",
        "timings_s",
        "total_s",
        "test_episodes",
        "train_final_loss",
        "lora_final_loss",
        "base_model",
        "adapter",
    ] {
        assert!(json.get(k).is_some(), "report.json lacks {k}");
    }
    // Both trainings packed their steps: no decoder row of padding was computed.
    for stage in ["base", "lora"] {
        let metrics = std::fs::read_to_string(out.join(stage).join("metrics.jsonl"))?;
        let steps: Vec<serde_json::Value> = metrics
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|m| m.get("step").is_some())
            .collect();
        assert_eq!(steps.len(), 2, "{stage}: {metrics}");
        for m in steps {
            assert!(m["tokens"].as_u64().is_some_and(|t| t > 0), "{stage}: {m}");
            assert_eq!(m["computed_tokens"], m["tokens"], "{stage}: {m}");
        }
    }
    assert!(!report.all_met, "a two-step toy run cannot meet the demo's targets");
    let md = std::fs::read_to_string(out.join("report.md"))?;
    assert!(md.contains("Dual-Stream") && md.contains("--system-prompt compact"), "{md}");
    // The learned tokenizer went into the model folders, so serve and eval load it like any other.
    assert!(out.join("tokenizer.json").exists() && report.base_model.join("tokenizer.json").exists());
    let config = std::fs::read_to_string(report.base_model.join("config.json"))?;
    let model_type = match arch {
        DemoArch::Qwen25Vl => "qwen2_5_vl",
        DemoArch::Qwen3Vl => "qwen3_vl",
    };
    assert!(config.contains(&format!("\"model_type\": \"{model_type}\"")), "{config}");
    for dir in [&report.base_model, &report.adapter] {
        let card = askgui_data::AdapterCard::read(dir)?.expect("askgui.json");
        assert_eq!(card.prompt.action_language, language, "{}", dir.display());
    }
    // Every answer of the evaluation starts with the language's forced prefix (the base agent's and the
    // LoRA agent's, each given its folder's askgui.json).
    for results in ["eval/base/results-original.jsonl", "eval/lora/results-standard.jsonl"] {
        let text = std::fs::read_to_string(out.join(results))?;
        let raws: Vec<String> = text
            .lines()
            .map(serde_json::from_str::<serde_json::Value>)
            .collect::<Result<Vec<_>, _>>()?
            .iter()
            .flat_map(|r| r["calls"].as_array().cloned().unwrap_or_default())
            .map(|c| c["raw"].as_str().unwrap_or_default().to_string())
            .collect();
        assert!(!raws.is_empty(), "{results}");
        for raw in raws {
            assert!(raw.starts_with(language.answer_prefix()), "{results}: {raw}");
        }
    }
    std::fs::remove_dir_all(&out)?;
    Ok(())
}

/// The README's first command, `askgui-train demo`, takes no arguments: every knob has a default (clap
/// makes a field without one a required argument, and the command would fail).
#[test]
fn demo_needs_no_arguments() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: DemoArgs,
    }
    let cli = Cli::try_parse_from(["demo"]).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(cli.args.out, std::path::PathBuf::from("runs/demo"));
    assert_eq!((cli.args.base_steps, cli.args.lora_steps), (2400, 750));
    assert_eq!((cli.args.ask_repeat, cli.args.say_repeat), (4, 5));
    assert_eq!(cli.args.lora_extra, [TaskMode::Full]);
    // A mix can be turned off: the flag with no value.
    let cli = Cli::try_parse_from(["demo", "--lora-extra", "--base-extra"]).unwrap_or_else(|e| panic!("{e}"));
    assert!(cli.args.lora_extra.is_empty() && cli.args.base_extra.is_empty());
}
