//! What askgui-data tells its user: counts in the singular when there is one, the split file's splits and
//! ids that matched no converted episode, and flag values written as the flags take them.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use anyhow::Result;
use askgui_data::adapter_card::AdapterCard;
use askgui_data::convert::{convert_android_control_split, ConvertOptions};
use askgui_data::episode::load_episodes;
use askgui_data::{plural, PromptConfig, PromptFlags, SystemPrompt};
use common::temp_dir;

fn askgui_data(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_askgui-data")).args(args).output().expect("askgui-data runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn plural_says_one_in_the_singular() {
    assert_eq!(plural(1, "episode"), "1 episode");
    assert_eq!(plural(0, "problem"), "0 problems");
    assert_eq!(plural(3, "ambiguous episode"), "3 ambiguous episodes");
}

#[test]
fn one_episode_and_no_problem_read_as_english() -> Result<()> {
    let dir = temp_dir("messages-synth");
    let out = dir.join("synth");
    let (ok, text) = askgui_data(&[
        "synth",
        "--out",
        out.to_str().unwrap(),
        "--episodes",
        "1",
        "--split",
        "1:0:0",
        "--width",
        "224",
        "--height",
        "400",
    ]);
    assert!(ok, "{text}");
    let file = out.join("train.jsonl");
    assert!(text.contains(&format!("train: 1 episode -> {}", file.display())), "{text}");
    assert!(!text.contains("1 episodes"), "{text}");

    let (ok, text) = askgui_data(&["validate", file.to_str().unwrap()]);
    assert!(ok, "{text}");
    // The synthetic world's episodes have several steps, so "steps" stays plural here.
    let steps = load_episodes(&file)?[0].episode.steps.len();
    assert!(steps > 1);
    assert_eq!(text.trim(), format!("{}: 1 episode, {steps} steps, 0 problems", file.display()));
    Ok(())
}

#[test]
fn a_split_file_says_which_splits_and_ids_matched_no_episode() -> Result<()> {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/android_control");
    let dir = temp_dir("messages-splits");
    let r =
        convert_android_control_split(&fixture, Some(&fixture.join("splits.json")), &dir, ConvertOptions::default())?;
    // splits.json: train [1001, 17, 18], validation [19], test [1002, 20]; the fixture's records are the
    // episodes 1001, 1002 and 1003. So train and test get one episode each, validation none (its one id,
    // 19, was not converted), 1003 is in no split, and 17, 18, 19, 20 are ids of no converted episode.
    let at = |name: &str| dir.join(name).display().to_string();
    assert_eq!(
        r.split_lines(),
        [
            format!("train: 1 episode -> {}", at("train.jsonl")),
            format!("test: 1 episode -> {}", at("test.jsonl")),
            "val: no file written: its one id is no converted episode".to_string(),
            "1 episode is in no split of the split file (only in episodes.jsonl)".to_string(),
            "4 ids of the split file are no converted episode (17, 18, 19, 20): another part of the dataset, or \
             skipped"
                .to_string(),
        ]
    );
    assert!(!Path::new(&at("val.jsonl")).exists());
    Ok(())
}

/// The log lines `f` writes at warn level and above.
fn warnings(f: impl FnOnce()) -> String {
    let buf = Arc::new(Mutex::new(Vec::<u8>::new()));
    let sink = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .with_writer(move || Writer(sink.clone()))
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    let bytes = buf.lock().unwrap().clone();
    String::from_utf8(bytes).unwrap()
}

struct Writer(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Writer {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_flag_that_overrides_the_card_is_named_with_the_flags_values() {
    let trained = PromptConfig { system_prompt: SystemPrompt::Compact, ..Default::default() };
    let card = AdapterCard::new(&trained, 0);
    let flags = PromptFlags { system_prompt: Some(SystemPrompt::Full), ..Default::default() };
    let text = warnings(|| {
        flags.with_card(Some(&card));
    });
    // `--system-prompt` takes `full` and `compact`; the warning must say what to type.
    assert!(
        text.contains(
            "--system-prompt full overrides the adapter's askgui.json (system-prompt = compact): the model was \
             trained with compact"
        ),
        "{text}"
    );
    assert!(!text.contains("Full") && !text.contains("Compact"), "{text}");
}

#[test]
fn a_conversion_that_fails_leaves_no_empty_output_folder() {
    let dir = temp_dir("messages-failed-convert");
    // A JSONL export whose one record lacks every feature: a bad record, which stops the conversion
    // after the output folder was made.
    let (input, out) = (dir.join("export.jsonl"), dir.join("data/converted"));
    std::fs::write(&input, "{\"episode_id\": 7}\n").unwrap();
    let e = convert_android_control_split(&input, None, &out, ConvertOptions::default()).unwrap_err();
    assert!(e.to_string().contains("export.jsonl line 1"), "{e}");
    assert!(!dir.join("data").exists(), "the folders the conversion created are gone");
}
