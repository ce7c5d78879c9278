//! Shared helpers for the parity tests: fixture paths, versions, difference statistics.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use askgui_model::TrainExample;
use candle_core::{DType, Device, Tensor};

/// The fixture format these tests read; bump together with scripts/fixtures/make_fixtures.py.
pub const FIXTURE_VERSION: u64 = 1;
pub const REGENERATE: &str = "regenerate with `python scripts/fixtures/make_fixtures.py` \
    (needs torch, transformers, torchvision, pillow, safetensors)";

pub fn fixtures() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let manifest = std::fs::read_to_string(dir.join("manifest.json"))
        .unwrap_or_else(|e| panic!("{}: {e}; {REGENERATE}", dir.join("manifest.json").display()));
    let v: serde_json::Value = serde_json::from_str(&manifest).expect("manifest.json is JSON");
    let version = v["version"].as_u64().unwrap_or(0);
    assert_eq!(
        version, FIXTURE_VERSION,
        "fixtures are version {version}, tests expect {FIXTURE_VERSION}: {REGENERATE}"
    );
    dir
}

pub fn load_st(name: &str) -> HashMap<String, Tensor> {
    let path = fixtures().join(name);
    candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}; {REGENERATE}", path.display()))
}

pub fn get<'a>(m: &'a HashMap<String, Tensor>, k: &str) -> &'a Tensor {
    m.get(k).unwrap_or_else(|| panic!("fixture tensor `{k}` missing; {REGENERATE}"))
}

/// `(max |a - b|, mean |a - b|, max |b|)` over all elements, in f64.
pub fn diff(a: &Tensor, b: &Tensor) -> (f64, f64, f64) {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let a: Vec<f64> = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let b: Vec<f64> = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let mut max = 0f64;
    let mut sum = 0f64;
    let mut scale = 0f64;
    for (x, y) in a.iter().zip(&b) {
        max = max.max((x - y).abs());
        sum += (x - y).abs();
        scale = scale.max(y.abs());
    }
    (max, sum / a.len().max(1) as f64, scale)
}

pub fn to_u32(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::I64).unwrap().flatten_all().unwrap().to_vec1::<i64>().unwrap().iter().map(|&x| x as u32).collect()
}

pub fn grids(t: &Tensor) -> Vec<[usize; 3]> {
    let v: Vec<i64> = t.to_dtype(DType::I64).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    v.chunks(3).map(|c| [c[0] as usize, c[1] as usize, c[2] as usize]).collect()
}

/// The right-padded PEFT batch of `lora/grad/batch.safetensors` as our examples: two sequences of
/// different lengths with three images (the first sequence has two), unpadded. `vision_start` is the
/// model's `<|vision_start|>` id, which counts each sequence's images.
pub fn peft_batch(want: &HashMap<String, Tensor>, vision_start: u32) -> Vec<TrainExample> {
    let ids: Vec<u32> = to_u32(get(want, "input_ids"));
    let keep: Vec<u32> = to_u32(get(want, "attention_mask"));
    let sup = to_u32(get(want, "labels_mask"));
    let (b, t) = get(want, "input_ids").dims2().unwrap();
    let mut grid_rows = grids(get(want, "image_grid_thw")).into_iter();
    let pv = get(want, "pixel_values");
    let (mut batch, mut row) = (vec![], 0);
    for s in 0..b {
        let r = s * t..(s + 1) * t;
        let seq: Vec<u32> =
            ids[r.clone()].iter().zip(&keep[r.clone()]).filter(|(_, &k)| k == 1).map(|(&i, _)| i).collect();
        let n_images = seq.iter().filter(|&&i| i == vision_start).count();
        let grid_thw: Vec<[usize; 3]> = grid_rows.by_ref().take(n_images).collect();
        let rows: usize = grid_thw.iter().map(|g| g.iter().product::<usize>()).sum();
        batch.push(TrainExample {
            labels_mask: sup[r][..seq.len()].iter().map(|&m| m != 0).collect(),
            ids: seq,
            pixel_values: Some(pv.narrow(0, row, rows).unwrap()),
            grid_thw,
            region_targets: vec![],
        });
        row += rows;
    }
    assert_eq!(row, pv.dim(0).unwrap(), "every image row belongs to a sequence; {REGENERATE}");
    batch
}
