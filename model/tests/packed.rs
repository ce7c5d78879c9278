//! The packed decoder pass (several sequences, each over its own KV cache, in one forward) against the
//! same sequences run one by one, and a truncated cache against the cache of the shorter prompt.
//!
//! Tolerance: 1e-5 of the largest hidden magnitude. Packing changes only the row count of each GEMM, so
//! the two paths differ by float reassociation (seen: ~1e-7); a row attending to the wrong sequence's keys,
//! a wrong position or a misplaced cache append moves hidden states by 1e-1 or more.

mod common;

use askgui_model::model::positions_tensor;
use askgui_model::Qwen2Vl;
use askgui_model::{KvCache, NewRows};
use candle_core::{DType, Device, Tensor};
use common::*;

fn model() -> Qwen2Vl {
    Qwen2Vl::load(fixtures().join("tiny-qwen2_5_vl").to_str().unwrap(), &Device::Cpu, DType::F32).unwrap()
}

fn text_positions(start: usize, n: usize) -> Vec<[u32; 3]> {
    (start..start + n).map(|p| [p as u32; 3]).collect()
}

/// Runs `ids` (text only) at positions `start..` through the decoder on `cache`: hidden `(n, H)`.
fn run(m: &Qwen2Vl, ids: &[u32], start: usize, cache: &mut KvCache) -> Tensor {
    let n = ids.len();
    let emb = m.embed(&Tensor::from_slice(ids, (1, n), &Device::Cpu).unwrap(), None).unwrap();
    let pos = positions_tensor(&[text_positions(start, n)], n).unwrap();
    m.decode(&emb, &pos, None, cache).unwrap().squeeze(0).unwrap()
}

fn ids(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (seed * 7919 + i * 104_729) % 200 + 1).collect()
}

fn close(what: &str, got: &Tensor, want: &Tensor) {
    let (max, _, scale) = diff(got, want);
    eprintln!("{what}: max |diff| {max:.2e} (scale {scale:.2e})");
    assert!(max <= 1e-5 * scale.max(1.0), "{what}: {max:e} > 1e-5 x {scale:e}");
}

#[test]
fn packed_sequences_equal_one_by_one() {
    let m = model();
    // Three sequences with caches of 7, 30 and 0 positions, then 1, 3 and 12 new tokens.
    let (prior, new) = ([7usize, 30, 0], [1usize, 3, 12]);
    let mut alone = Vec::new();
    let mut caches = Vec::new();
    for (s, (&p, &n)) in prior.iter().zip(&new).enumerate() {
        let all = ids(s as u32 + 1, p + n);
        let mut c = m.new_cache();
        if p > 0 {
            run(&m, &all[..p], 0, &mut c);
        }
        caches.push(c.clone());
        alone.push((run(&m, &all[p..], p, &mut c), c));
    }
    let mut rows = Vec::new();
    let mut pos = Vec::new();
    for (s, (&p, &n)) in prior.iter().zip(&new).enumerate() {
        rows.extend_from_slice(&ids(s as u32 + 1, p + n)[p..]);
        pos.extend(text_positions(p, n));
    }
    let total = rows.len();
    let emb = m.embed(&Tensor::from_slice(&rows, (1, total), &Device::Cpu).unwrap(), None).unwrap();
    let positions = positions_tensor(&[pos], total).unwrap();
    let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
    let appended: Vec<NewRows> = new.iter().map(|&n| NewRows::Append(n)).collect();
    let packed = m.decode_packed(&emb, &positions, &appended, &mut refs).unwrap().squeeze(0).unwrap();
    let mut start = 0;
    for (s, &n) in new.iter().enumerate() {
        close(&format!("sequence {s} hidden"), &packed.narrow(0, start, n).unwrap(), &alone[s].0);
        assert_eq!(caches[s].len(), prior[s] + n, "sequence {s}: the cache grows by its own tokens");
        // The caches they leave behind continue identically.
        let next = [42u32];
        let a = run(&m, &next, prior[s] + n, &mut caches[s].clone());
        let b = run(&m, &next, prior[s] + n, &mut alone[s].1.clone());
        close(&format!("sequence {s} next step"), &a, &b);
        start += n;
    }
    let short = [NewRows::Append(1), NewRows::Append(2)];
    assert!(m.decode_packed(&emb, &positions, &short, &mut refs_of(&mut caches)).is_err(), "lengths must add up");
}

fn refs_of(c: &mut [KvCache]) -> Vec<&mut KvCache> {
    c.iter_mut().collect()
}

#[test]
fn a_truncated_cache_is_the_shorter_prompts_cache() {
    let m = model();
    let all = ids(3, 40);
    let mut full = m.new_cache();
    run(&m, &all, 0, &mut full);
    let mut cut = full.truncated(25).unwrap();
    assert_eq!(cut.len(), 25);
    assert!(full.truncated(0).unwrap().is_empty());
    // Re-feeding the last 15 tokens on the truncated cache gives the full prompt's last rows.
    let mut fresh = m.new_cache();
    let want = run(&m, &all, 0, &mut fresh).narrow(0, 25, 15).unwrap();
    close("rows after the shared prefix", &run(&m, &all[25..], 25, &mut cut), &want);
    assert_eq!(full.len(), 40, "truncating leaves the original cache alone");
}

/// `images_features` (each image patch-embedded from its own pixel buffer) against `image_features` on the
/// pixels copied into one tensor, both architectures, two screenshots of different sizes: equal within
/// 1e-6 of the largest feature (the same GEMMs on the same rows; seen: bitwise equal). An image whose pixel
/// values do not fill its grid is an error that names it.
#[test]
fn images_features_equal_the_features_of_one_pixel_tensor() {
    for dir in ["tiny-qwen2_5_vl", "tiny-qwen2_vl"] {
        let m = Qwen2Vl::load(fixtures().join(dir).to_str().unwrap(), &Device::Cpu, DType::F32).unwrap();
        let shot = |w: u32, h: u32, seed: u32| {
            let img = image::RgbImage::from_fn(w, h, |x, y| {
                image::Rgb([((x * 7 + seed) % 256) as u8, ((y * 3 + seed * 5) % 256) as u8, (seed * 40 % 256) as u8])
            });
            askgui_model::preprocess(&img, &m.image_config).unwrap()
        };
        let images = [shot(200, 150, 1), shot(120, 260, 2)];
        let refs: Vec<_> = images.iter().collect();
        let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid_thw).collect();
        let one = m.image_features(&askgui_model::pixel_rows(&refs, &Device::Cpu).unwrap(), &grids).unwrap();
        let parts = m.images_features(&refs).unwrap();
        let (d, _, scale) = diff(&parts, &one);
        eprintln!("{dir}: max |images_features - image_features| = {d:e} (largest feature {scale:.3})");
        assert!(d <= 1e-6 * scale, "{dir}: differs by {d}");

        let mut ragged = shot(200, 150, 3);
        ragged.pixel_values.pop();
        let err = m.images_features(&[&images[0], &ragged]).unwrap_err().to_string();
        assert!(err.contains("image 1") && err.contains("pixel values"), "{dir}: {err}");
    }
}
