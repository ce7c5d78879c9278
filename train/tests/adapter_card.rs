//! The `askgui.json` askgui-train writes: the run's prompt and image settings beside the adapter, carried
//! into a merged model folder, and read back by askgui-eval's in-process agent as its defaults.

use std::path::{Path, PathBuf};

use askgui_data::{AdapterCard, FrameKind, PromptConfig, PromptFlags, SystemPrompt};
use askgui_eval::agent::Agent;
use askgui_eval::backends::InProcessAgent;
use askgui_model::LoadOptions;
use askgui_train::data::DataOptions;
use askgui_train::merge::{merge, MergeArgs};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures")
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("askgui-card-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// What the trainer gives the data loader for `--system-prompt compact --max-pixels 12544
/// --history-images 1 --elements --history-length 3` on the tiny fixture (min_pixels: the checkpoint's).
fn run_options() -> DataOptions {
    DataOptions {
        prompt: PromptConfig {
            frame: FrameKind::Resized,
            min_pixels: 3136,
            max_pixels: 12_544,
            history_images: 1,
            elements: true,
            system_prompt: SystemPrompt::Compact,
            token_side: 28,
            action_language: Default::default(),
        },
        task_mode: Default::default(),
        extra_task_modes: vec![],
        history_length: 3,
        max_seq_len: 8192,
        skip_bad_records: false,
        ask_repeat: 1,
        say_repeat: 1,
        dialog_repeat: 1,
        region_words: false,
    }
}

#[test]
fn the_card_holds_the_runs_settings_and_travels_into_a_merged_model() {
    let dir = scratch("merge");
    let adapter = dir.join("adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(fixtures().join("lora/tiny-qwen2_5_vl-peft").join(f), adapter.join(f)).unwrap();
    }
    askgui_train::adapter_card::write(&adapter, &run_options()).unwrap();
    let text = std::fs::read_to_string(adapter.join("askgui.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(json["version"], 1);
    assert_eq!(json["askgui_version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(
        json["prompt"],
        serde_json::json!({"system_prompt": "compact", "frame": "resized", "history_images": 1, "elements": true,
                           "history_length": 3})
    );
    assert_eq!(json["image"], serde_json::json!({"min_pixels": 3136, "max_pixels": 12544}));

    let out = dir.join("merged");
    let base = fixtures().join("tiny-qwen2_5_vl").display().to_string();
    let s = merge(&MergeArgs { model: base, adapter: adapter.clone(), out: out.clone() }).unwrap();
    assert!(s.copied.iter().any(|f| f == "askgui.json"), "{:?}", s.copied);
    assert_eq!(std::fs::read_to_string(out.join("askgui.json")).unwrap(), text);

    // The merged folder alone gives the evaluator the settings it was trained with.
    let agent =
        InProcessAgent::load(out.to_str().unwrap(), None, &PromptFlags::default(), tokens(4), LoadOptions::default())
            .unwrap();
    let p = agent.identity().prompt;
    assert_eq!((p.max_pixels, p.system_prompt, p.history_images), (Some(12_544), Some(SystemPrompt::Compact), Some(1)));
    assert!(p.elements);
    assert_eq!(AdapterCard::read(&out).unwrap().unwrap().prompt.history_length, 3);
}

fn tokens(max: usize) -> askgui_data::agent_api::StepOptions {
    askgui_data::agent_api::StepOptions { max_tokens: Some(max), ..Default::default() }
}
