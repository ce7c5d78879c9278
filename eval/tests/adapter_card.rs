//! An adapter's askgui.json sets the in-process agent's prompt and image settings, and a prompt flag
//! given with another value wins with a warning naming the setting and both values.

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use askgui_data::adapter_card::CardPause;
use askgui_data::{AdapterCard, PromptConfig, SystemPrompt};
use askgui_eval::backends::from_args;
use askgui_eval::identity::AgentIdentity;
use common::args;

const TINY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../model/tests/fixtures/tiny-qwen2_5_vl");
const PEFT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../model/tests/fixtures/lora/tiny-qwen2_5_vl-peft");

/// The PEFT fixture adapter copied to a folder of its own per `name` (the tests run in parallel, and each
/// rewrites its folder), with a card trained at 12,544 pixels and the compact system prompt.
fn adapter_with_card(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("askgui-eval-adapter-card-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(Path::new(PEFT).join(f), dir.join(f)).unwrap();
    }
    let trained = PromptConfig { max_pixels: 12_544, system_prompt: SystemPrompt::Compact, ..Default::default() };
    AdapterCard::new(&trained, 0).write(&dir).unwrap();
    dir
}

/// The identity of the agent `list` names, with what it logged at warn level.
fn load(list: &[&str]) -> (AgentIdentity, String) {
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let agent = tracing::subscriber::with_default(subscriber, || from_args(&args(list)).unwrap());
    let logged = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
    (agent.identity(), logged)
}

#[test]
fn the_adapter_card_is_the_default_and_a_different_flag_wins_with_a_warning() {
    let dir = adapter_with_card("prompt");
    let adapter = dir.to_str().unwrap();

    // No card: the checkpoint's processor and the full prompt, as before.
    let (plain, logged) = load(&["--model", TINY, "--adapter", PEFT]);
    assert_eq!((plain.prompt.max_pixels, plain.prompt.system_prompt), (Some(1_003_520), Some(SystemPrompt::Full)));
    assert!(logged.is_empty(), "{logged}");

    // The card's settings, without a flag and without a warning.
    let (carded, logged) = load(&["--model", TINY, "--adapter", adapter]);
    assert_eq!((carded.prompt.max_pixels, carded.prompt.system_prompt), (Some(12_544), Some(SystemPrompt::Compact)));
    assert!(logged.is_empty(), "{logged}");
    // Flags equal to the card are no conflict.
    let (_, logged) = load(&["--model", TINY, "--adapter", adapter, "--max-pixels", "12544"]);
    assert!(logged.is_empty(), "{logged}");

    // A different flag wins, and the warning names the setting, the adapter's value and the flag's.
    let (flagged, logged) = load(&["--model", TINY, "--adapter", adapter, "--max-pixels", "57344"]);
    assert_eq!((flagged.prompt.max_pixels, flagged.prompt.system_prompt), (Some(57_344), Some(SystemPrompt::Compact)));
    assert!(logged.contains("WARN") && logged.contains("--max-pixels 57344"), "{logged}");
    assert!(logged.contains("max-pixels = 12544"), "{logged}");
    let (flagged, logged) = load(&["--model", TINY, "--adapter", adapter, "--system-prompt", "full"]);
    assert_eq!(flagged.prompt.system_prompt, Some(SystemPrompt::Full));
    assert!(logged.contains("--system-prompt full") && logged.contains("system-prompt = compact"), "{logged}");
}

/// `askgui-eval calibrate`'s pause level in the card is the agent's default `pause_threshold`; the flag
/// wins.
#[test]
fn the_cards_calibrated_pause_threshold_is_the_default_and_the_flag_wins() {
    let dir = adapter_with_card("pause");
    let mut card = AdapterCard::read(&dir).unwrap().unwrap();
    card.pause = Some(CardPause {
        threshold: 0.37,
        target_fpr: 0.05,
        episodes: "val.jsonl".into(),
        strict_f1: Some(0.9),
        fpr: Some(0.01),
        bound_met: true,
    });
    card.write(&dir).unwrap();
    let adapter = dir.to_str().unwrap();
    let (carded, _) = load(&["--model", TINY, "--adapter", adapter]);
    assert_eq!(carded.decoding.pause_threshold, Some(0.37));
    let (flagged, _) = load(&["--model", TINY, "--adapter", adapter, "--pause-threshold", "0.8"]);
    assert_eq!(flagged.decoding.pause_threshold, Some(0.8));
    let (plain, _) = load(&["--model", TINY, "--adapter", PEFT]);
    assert_eq!(plain.decoding.pause_threshold, None, "no card, no threshold: the model's own choice");
}
