//! Multimodal-Mind2Web's published form, end to end: snappy parquet shards with the dataset's schema
//! (tests/fixtures/mind2web*, written by scripts/fixtures/mind2web_parquet.py with pyarrow) converted as one
//! file and as a folder of shards, and broken (cut short, a column missing, bad rows, corrupt pages): each
//! failure names the file and the row or column. The expected values come from what the script writes.

mod common;

use std::fs;
use std::path::PathBuf;

use anyhow::Result;
use askgui_data::action::{Action, Target};
use askgui_data::convert::{convert_mind2web, convert_mind2web_with, ConvertError, BAD_RECORD};
use askgui_data::episode::Element;

use common::*;

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(rel)
}

const SHARD0: &str = "mind2web/train-00000-of-00002.parquet";
const FLIGHT: &str = "mind2web-0b1c2d3e-aaaa-4000-8000-000000000001";
const CAR: &str = "mind2web-0b1c2d3e-bbbb-4000-8000-000000000002";
const NEWS: &str = "mind2web-0b1c2d3e-cccc-4000-8000-000000000003";

fn click(x: i32, y: i32, id: &str) -> Action {
    Action::Click(Target { x: Some(x), y: Some(y), element: Some(id.into()) })
}

fn element(id: &str, role: &str, text: &str, bbox: [i32; 4]) -> Element {
    Element { id: id.into(), role: role.into(), text: text.into(), bbox }
}

#[test]
fn mind2web_parquet_shard_converts_and_validates() -> Result<()> {
    let out = temp_dir("m2w-parquet");
    let report = convert_mind2web(&fixture(SHARD0), &out)?;
    // Flight: TYPE (click + type) and CLICK = 3 steps; car: SELECT (click + type), ENTER, CLICK = 4 steps.
    assert_eq!((report.episodes, report.steps, report.skipped.len()), (2, 7, 0), "{:#?}", report.skipped);
    let eps = assert_valid(&out)?;
    let (flight, car) = (&eps[0].episode, &eps[1].episode);
    assert_eq!((flight.id.as_str(), flight.task.as_str()), (FLIGHT, "Find a one-way flight from New York to Boston"));
    assert_eq!((flight.screen.width, flight.screen.height), (64, 48));
    let acts: Vec<&Action> = flight.steps.iter().map(|s| &s.action).collect();
    // Row 1 (index 0) comes first: typing "Boston" into the box (8, 10, 40, 8) -> [8, 10, 48, 18], centre (28, 14);
    // then row 0 (index 1): the button (50.5, 30, 10, 7.5) grows to whole pixels [50, 30, 61, 38], centre (55, 34).
    assert_eq!(acts, [&click(28, 14, "f0-n"), &Action::Type { text: "Boston".into() }, &click(55, 34, "f1-n")]);
    let els: Vec<&Element> = flight.steps.iter().map(|s| &s.elements.as_ref().expect("elements")[0]).collect();
    assert_eq!(els[0], &element("f0-n", "input", "To", [8, 10, 48, 18]));
    assert_eq!(els[2], &element("f1-n", "button", "Search", [50, 30, 61, 38]));

    // The car task spans both row groups; its last page is 60 high, so the screen is 64x60.
    assert_eq!((car.id.as_str(), car.screen.width, car.screen.height), (CAR, 64, 60));
    let acts: Vec<&Action> = car.steps.iter().map(|s| &s.action).collect();
    // SELECT "2 adults" on (4, 20, 30, 10): centre (19, 25); ENTER: a key press; CLICK on (20, 50, 24, 8): (32, 54).
    let enter = Action::Press { key: "enter".into() };
    assert_eq!(
        acts,
        [&click(19, 25, "c0-n"), &Action::Type { text: "2 adults".into() }, &enter, &click(32, 54, "c2-n")]
    );
    // The pages' own pixels stay (the car's colour, the white target box), the 48-high ones padded white below.
    assert_eq!(pixel(&eps[1], 0, 1, 1), [255, 230, 200]);
    assert_eq!(pixel(&eps[1], 0, 10, 25), [255, 255, 255]);
    assert_eq!(pixel(&eps[1], 0, 1, 55), [255, 255, 255]);
    assert_eq!(pixel(&eps[1], 3, 1, 55), [255, 230, 200]);
    fs::remove_dir_all(&out)?;
    Ok(())
}

#[test]
fn mind2web_parquet_folder_reads_its_shards_in_name_order() -> Result<()> {
    let out = temp_dir("m2w-parquet-folder");
    let report = convert_mind2web(&fixture("mind2web"), &out)?;
    // Shard 0 as above (2 tasks, 7 steps), then shard 1: one CLICK on (2, 2, 12, 6), centre (8, 5).
    assert_eq!((report.episodes, report.steps), (3, 8), "{:#?}", report.skipped);
    let eps = assert_valid(&out)?;
    let ids: Vec<&str> = eps.iter().map(|e| e.episode.id.as_str()).collect();
    assert_eq!(ids, [FLIGHT, CAR, NEWS]);
    assert_eq!(eps[2].episode.steps[0].action, click(8, 5, "n0-n"));

    let empty = temp_dir("m2w-parquet-empty");
    let e = convert_mind2web(&empty, &out.join("again")).unwrap_err();
    assert!(matches!(e, ConvertError::NoRecords { .. }) && e.to_string().contains("*.parquet"), "{e}");
    fs::remove_dir_all(&out)?;
    fs::remove_dir_all(&empty)?;
    Ok(())
}

#[test]
fn mind2web_parquet_cut_short_is_an_error_naming_the_file() -> Result<()> {
    let dir = temp_dir("m2w-parquet-cut");
    let bytes = fs::read(fixture(SHARD0))?;
    let cut = dir.join("train-00000-of-00001.parquet");
    fs::write(&cut, &bytes[..bytes.len() / 2])?;
    let e = convert_mind2web(&cut, &dir.join("out")).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, ConvertError::BadRecord { .. }), "{msg}");
    assert!(msg.contains("train-00000-of-00001.parquet") && msg.contains("not a readable parquet file"), "{msg}");
    fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn mind2web_parquet_bad_shards_name_the_column_or_row_and_can_be_skipped() -> Result<()> {
    let dir = temp_dir("m2w-parquet-bad");
    let input = fixture("mind2web_bad");
    let e = convert_mind2web(&input, &dir).unwrap_err().to_string();
    assert!(e.contains("a-no-screenshot.parquet") && e.contains("no column `screenshot`"), "{e}");

    let report = convert_mind2web_with(&input, &dir, SKIP_BAD)?;
    // b-bad-rows.parquet (target_action_index as int64): rows 0-1 the car's SELECT and ENTER, row 1 with a
    // screenshot that is no image; row 2 the news CLICK with an operation that is not JSON; row 3 without a task
    // id. Left: the car's SELECT (click + type).
    assert_eq!((report.episodes, report.steps), (1, 2), "{:#?}", report.skipped);
    let eps = assert_valid(&dir)?;
    assert_eq!(eps[0].episode.id, CAR);
    assert_eq!(eps[0].episode.steps[1].action, Action::Type { text: "2 adults".into() });
    let skipped = report.skipped.join("\n");
    for (file_row, why) in [
        ("a-no-screenshot.parquet", "no column `screenshot`"),
        ("b-bad-rows.parquet row 1", "not an image"),
        ("b-bad-rows.parquet row 2", "`operation`: not JSON"),
        ("b-bad-rows.parquet row 3", "`annotation_id` is null"),
    ] {
        assert!(skipped.lines().any(|l| l.contains(file_row) && l.contains(why)), "{file_row}: {why}\n{skipped}");
    }
    assert_eq!(report.skip_counts.get(BAD_RECORD), Some(&4), "{:?}", report.skip_counts);
    assert_eq!(report.skip_counts.get("no convertible action"), Some(&1), "the news task lost its only row");
    fs::remove_dir_all(&dir)?;
    Ok(())
}

/// Zeroed stretches anywhere in a shard: each conversion ends in episodes or an error naming the file, never a
/// panic (the parquet crate asserts on some corrupt pages; the converter turns that into an error).
#[test]
fn mind2web_parquet_corrupt_bytes_never_panic() -> Result<()> {
    let dir = temp_dir("m2w-parquet-corrupt");
    let bytes = fs::read(fixture(SHARD0))?;
    let file = dir.join("corrupt.parquet");
    let mut errors = 0;
    for start in (4..bytes.len() - 8).step_by(97) {
        let mut b = bytes.clone();
        let end = (start + 48).min(bytes.len() - 8);
        b[start..end].fill(0);
        fs::write(&file, &b)?;
        if let Err(e) = convert_mind2web_with(&file, &dir.join("out"), SKIP_BAD) {
            assert!(e.to_string().contains("corrupt.parquet"), "zeroed at {start}: {e}");
            errors += 1;
        }
    }
    assert!(errors > 0, "zeroing the footer must fail");
    fs::remove_dir_all(&dir)?;
    Ok(())
}
