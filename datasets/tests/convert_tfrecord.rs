//! AndroidControl's published form, end to end: GZIP TFRecords of tf.train.Example (tests/fixtures,
//! written by scripts/fixtures/android_control_tfrecord.py with the official protos) converted whole,
//! with their split file, and corrupted or cut short: each failure names the file and record.

mod common;

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::Result;
use askgui_data::action::{Action, Direction, DoneStatus, Target};
use askgui_data::convert::{
    convert_android_control, convert_android_control_split, convert_android_control_with, ConvertError, ConvertOptions,
    BAD_RECORD,
};
use askgui_data::episode::load_episodes;
use askgui_data::validate::validate_file;

use common::*;

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(rel)
}

const AC_FILE: &str = "android_control/android_control-00000-of-00001";

fn gunzip(bytes: &[u8]) -> Result<Vec<u8>> {
    let mut raw = vec![];
    flate2::read::GzDecoder::new(bytes).read_to_end(&mut raw)?;
    Ok(raw)
}

fn gzip(raw: &[u8]) -> Result<Vec<u8>> {
    let mut enc = flate2::write::GzEncoder::new(vec![], flate2::Compression::default());
    enc.write_all(raw)?;
    Ok(enc.finish()?)
}

/// Where each record of a TFRecord stream starts (its 12-byte header), and where the stream ends.
fn record_starts(raw: &[u8]) -> Vec<usize> {
    let mut starts = vec![0];
    while let Some(&at) = starts.last().filter(|&&at| at < raw.len()) {
        let len = u64::from_le_bytes(raw[at..at + 8].try_into().expect("8 bytes")) as usize;
        starts.push(at + 12 + len + 4);
    }
    starts
}

fn el(e: &askgui_data::episode::Element) -> (&str, &str, &str, [i32; 4]) {
    (e.id.as_str(), e.role.as_str(), e.text.as_str(), e.bbox)
}

#[test]
fn android_control_tfrecords_convert_with_elements_and_splits() -> Result<()> {
    let dir = temp_dir("android-tfrecord");
    let (input, splits) = (fixture("android_control"), fixture("android_control/splits.json"));
    let report = convert_android_control_split(&input, Some(&splits), &dir, ConvertOptions::default())?;
    assert_eq!((report.episodes, report.steps, report.skipped.len()), (3, 15, 0), "{:#?}", report.skipped);
    let eps = assert_valid(&dir)?;
    let ids: Vec<&str> = eps.iter().map(|e| e.episode.id.as_str()).collect();
    assert_eq!(ids, ["androidcontrol-1001", "androidcontrol-1002", "androidcontrol-1003"]);
    let shop = &eps[0].episode;
    assert_eq!(
        (shop.task.as_str(), shop.screen.width, shop.screen.height),
        ("Add oat milk to my cart in the Shop app", 108, 240)
    );
    let acts: Vec<&Action> = shop.steps.iter().map(|s| &s.action).collect();
    assert_eq!(
        acts,
        [
            &Action::OpenApp { name: "Shop".into() },
            &Action::Click(Target::point(54, 27)),
            &Action::Type { text: "oat milk".into() },
            &Action::Press { key: "enter".into() },
            &Action::Click(Target::point(87, 54)),
            &Action::Done { status: DoneStatus::Success },
        ]
    );
    let instr: Vec<Option<&str>> = shop.steps.iter().map(|s| s.instruction.as_deref()).collect();
    assert_eq!(
        instr[..5],
        [
            Some("Open the Shop app"),
            Some("Search for oat milk"),
            Some("Search for oat milk"),
            Some("Search for oat milk"),
            Some("Add oat milk to the cart")
        ]
    );
    assert_eq!(instr[5], None);
    // Both windows (status bar first); the hint when there is no text; text | content description; the
    // invisible drawer and the unlabelled, inert ImageView left out; the box below the screen clipped.
    let els =
        |step: usize| shop.steps[step].elements.as_ref().expect("element list").iter().map(el).collect::<Vec<_>>();
    assert_eq!(
        els(1),
        [
            ("e0", "TextView", "12:30", [2, 0, 30, 12]),
            ("e1", "clickable EditText", "Search products", [6, 18, 102, 36]),
            ("e2", "TextView", "Deals | Today's deals", [6, 44, 102, 80]),
            ("e3", "clickable Button", "More", [6, 230, 102, 240]),
        ]
    );
    assert_eq!(els(2), els(1), "the three steps of a `type` share their screenshot's elements");
    assert_eq!(
        els(4)[1..],
        [
            ("e1", "clickable EditText", "oat milk", [6, 18, 102, 36]),
            ("e2", "RecyclerView", "", [0, 40, 108, 200]),
            ("e3", "TextView", "Oat milk", [6, 44, 70, 64]),
            ("e4", "clickable Button", "Add | Add oat milk to cart", [72, 44, 102, 64]),
        ]
    );
    assert_eq!(
        els(0)[1],
        ("e1", "clickable TextView", "Shop", [40, 100, 68, 128]),
        "text equal to its description once"
    );
    assert_eq!(els(5)[1].2, "Added to cart");

    let feed = &eps[1].episode;
    let acts: Vec<&Action> = feed.steps.iter().map(|s| &s.action).collect();
    assert_eq!(
        acts,
        [
            &Action::Scroll { x: None, y: None, direction: Direction::Down },
            &Action::LongPress(Target::point(50, 60)),
            &Action::Press { key: "back".into() },
            &Action::Wait { seconds: 2.0 },
            &Action::Type { text: "saved".into() },
            &Action::Press { key: "home".into() },
            &Action::Done { status: DoneStatus::Success },
        ]
    );
    let tree0 = feed.steps[0].elements.as_ref().map(|e| e.iter().map(el).collect::<Vec<_>>());
    assert_eq!(tree0, Some(vec![("e0", "TextView", "News", [6, 20, 102, 100])]), "a forest without a status bar");
    assert!(feed.steps[1..].iter().all(|s| s.elements.is_none()), "an empty tree is no element list");
    let short = &eps[2].episode;
    assert_eq!(short.steps[0].action, Action::Click(Target::point(54, 62)), "float coordinates round");
    assert_eq!(short.steps[0].instruction, None, "no step_instructions feature");

    // The split file: 1001 is train, 1002 test, 1003 in no split; the other ids are not in this file.
    let files: Vec<(&str, usize)> = report.splits.iter().map(|(s, _, n)| (s.as_str(), *n)).collect();
    assert_eq!((files, report.unsplit), (vec![("train", 1), ("test", 1)], 1));
    let train = load_episodes(&dir.join("train.jsonl"))?;
    assert_eq!(train.iter().map(|e| e.episode.id.as_str()).collect::<Vec<_>>(), ["androidcontrol-1001"]);
    assert_eq!(validate_file(&dir.join("test.jsonl"), true)?.problems.len(), 0);
    assert!(!dir.join("val.jsonl").exists(), "no converted episode is in `validation`");

    // The file itself (not the folder) converts the same.
    let one = dir.join("one");
    assert_eq!(convert_android_control(&fixture(AC_FILE), &one)?.steps, 15);
    assert_eq!(fs::read_to_string(one.join("episodes.jsonl"))?, fs::read_to_string(dir.join("episodes.jsonl"))?);
    fs::remove_dir_all(&dir)?;
    Ok(())
}

/// The fixture with record `n` (from 1) changed by `f`, re-compressed, in `dir`.
fn corrupt(dir: &Path, name: &str, n: usize, f: impl Fn(&mut Vec<u8>, usize)) -> Result<PathBuf> {
    let mut raw = gunzip(&fs::read(fixture(AC_FILE))?)?;
    let at = record_starts(&raw)[n - 1];
    f(&mut raw, at);
    let path = dir.join(name);
    fs::write(&path, gzip(&raw)?)?;
    Ok(path)
}

#[test]
fn android_control_bad_crc_names_the_file_and_record() -> Result<()> {
    let dir = temp_dir("android-crc");
    let data = corrupt(&dir, "data-crc", 2, |raw, at| raw[at + 12 + 40] ^= 0x10)?;
    let e = convert_android_control(&data, &dir.join("out")).unwrap_err().to_string();
    assert!(e.contains("data-crc record 2:") && e.contains("CRC of the record's data"), "{e}");
    let report = convert_android_control_with(&data, &dir.join("out"), SKIP_BAD)?;
    assert_eq!((report.episodes, report.skip_counts.get(BAD_RECORD)), (2, Some(&1)), "{:#?}", report.skipped);
    assert!(
        report.skipped[0].contains("record 2") && report.skipped[0].ends_with("record skipped"),
        "{:?}",
        report.skipped
    );
    assert_valid(&dir.join("out"))?;

    // A bad length CRC cannot be gone past: the rest of the file is skipped.
    let length = corrupt(&dir, "length-crc", 2, |raw, at| raw[at + 1] ^= 0x01)?;
    let e = convert_android_control(&length, &dir.join("out2")).unwrap_err().to_string();
    assert!(e.contains("length-crc record 2:") && e.contains("CRC of the record's length"), "{e}");
    let report = convert_android_control_with(&length, &dir.join("out2"), SKIP_BAD)?;
    assert_eq!(report.episodes, 1);
    assert!(report.skipped[0].ends_with("the rest of the file is skipped"), "{:?}", report.skipped);
    fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn android_control_truncated_file_names_the_file_and_record() -> Result<()> {
    let dir = temp_dir("android-truncated");
    // The record stream cut inside record 3, then compressed properly.
    let cut = corrupt(&dir, "cut", 3, |raw, at| raw.truncate(at + 100))?;
    let e = convert_android_control(&cut, &dir.join("out")).unwrap_err().to_string();
    assert!(e.contains("cut record 3:") && e.contains("truncated") && e.contains("--skip-bad-records"), "{e}");
    let report = convert_android_control_with(&cut, &dir.join("out"), SKIP_BAD)?;
    assert_eq!((report.episodes, report.skip_counts.get(BAD_RECORD)), (2, Some(&1)));
    assert_valid(&dir.join("out"))?;
    // The compressed file cut short, as an interrupted download leaves it.
    let gz = fs::read(fixture(AC_FILE))?;
    for keep in [gz.len() - 4, gz.len() / 2, 30] {
        let path = dir.join(format!("short-{keep}"));
        fs::write(&path, &gz[..keep])?;
        let e = convert_android_control(&path, &dir.join("out3")).unwrap_err().to_string();
        assert!(e.contains(&format!("short-{keep} record")) && e.contains("truncated"), "{keep}: {e}");
    }
    fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn android_control_wrong_schema_names_the_feature_and_record() -> Result<()> {
    let dir = temp_dir("android-schema");
    let bad = fixture("android_control_bad");
    let e = convert_android_control(&bad, &dir).unwrap_err().to_string();
    assert!(e.contains("00001 record 2") && e.contains("missing feature `actions`"), "{e}");
    let report = convert_android_control_with(&bad, &dir, SKIP_BAD)?;
    assert_eq!((report.episodes, report.skip_counts.get(BAD_RECORD)), (1, Some(&4)), "{:#?}", report.skipped);
    let expected = [
        ("record 2", "missing feature `actions`"),
        ("record 3", "feature `goal` is an int64_list, not a bytes_list"),
        ("record 4", "screenshot 0: screenshot bytes are not an image"),
        ("record 5", "accessibility_trees 0: "),
    ];
    for ((at, why), line) in expected.iter().zip(&report.skipped) {
        assert!(line.contains(at) && line.contains(why), "{line}");
    }
    assert_valid(&dir)?;

    // A split file that puts one episode in two splits is refused before anything is written.
    let splits = dir.join("splits.json");
    fs::write(&splits, r#"{"train": [1001], "test": ["1001"]}"#)?;
    let e = convert_android_control_split(&bad, Some(&splits), &dir.join("out"), SKIP_BAD).unwrap_err();
    assert!(matches!(e, ConvertError::SplitFile { .. }) && e.to_string().contains("episode 1001 is in both"), "{e}");
    fs::remove_dir_all(&dir)?;
    Ok(())
}
