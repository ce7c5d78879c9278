//! What the converter tests share: temporary folders, small PNGs, and the check that a converter's
//! output validates.
#![allow(dead_code)]

use std::fs;
use std::io::Cursor;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use askgui_data::convert::ConvertOptions;
use askgui_data::episode::{load_episodes, LoadedEpisode};
use askgui_data::validate::validate_file;
use serde_json::Value;

/// A fresh, empty folder under the system temp folder.
pub fn temp_dir(name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("askgui-convert-{name}-{}-{nanos}", std::process::id()));
    fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// A solid-colour PNG.
pub fn png(w: u32, h: u32, rgb: [u8; 3]) -> Vec<u8> {
    let img = image::RgbImage::from_pixel(w, h, image::Rgb(rgb));
    let mut out = Cursor::new(vec![]);
    img.write_to(&mut out, image::ImageFormat::Png).expect("encode png");
    out.into_inner()
}

pub fn pixel(ep: &LoadedEpisode, step: usize, x: u32, y: u32) -> [u8; 3] {
    let img = image::open(ep.image_path(step)).expect("output image").to_rgb8();
    img.get_pixel(x, y).0
}

pub fn assert_valid(out: &Path) -> Result<Vec<LoadedEpisode>> {
    let path = out.join("episodes.jsonl");
    let report = validate_file(&path, true)?;
    let problems: Vec<String> = report.problems.iter().map(|p| p.to_string()).collect();
    assert!(problems.is_empty(), "{} problems:\n{}", problems.len(), problems.join("\n"));
    Ok(load_episodes(&path)?)
}

pub const SKIP_BAD: ConvertOptions = ConvertOptions { skip_bad_records: true };

pub fn read_json(path: &Path) -> Result<Value> {
    serde_json::from_str(&fs::read_to_string(path)?).with_context(|| path.display().to_string())
}
