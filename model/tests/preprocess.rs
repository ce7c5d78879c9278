//! Image preprocessing against transformers' `Qwen2VLImageProcessor` (fixtures from
//! `scripts/fixtures/make_fixtures.py`): `image_grid_thw` for many sizes, full `pixel_values` on small images,
//! and, when `../shared/data/screenagent-train-sample` is present, real desktop screenshots.
//!
//! Tolerance: 1e-5 absolute on normalised values (about 2e-6 of one uint8 step after normalisation is
//! 1 / (255 * 0.27) = 0.0146). The resize is bit-exact, so only f32 rounding of the normalisation may
//! differ. For the JPEG screenshots our decoder (the `image` crate) and Pillow's libjpeg may differ by a
//! few uint8 steps on some pixels, so that test checks the decoded images first and reports the pixel
//! difference separately from the preprocessing difference.

mod common;

use std::path::PathBuf;

use askgui_kernels::tiling::TilingError;
use askgui_model::{load_image, preprocess, ImageProcessorConfig, ModelError};
use candle_core::{DType, Device, Tensor};
use common::*;

fn cfg(min: usize, max: usize) -> ImageProcessorConfig {
    ImageProcessorConfig { min_pixels: min, max_pixels: max, ..Default::default() }
}

#[test]
fn grid_thw_matches_transformers_for_many_sizes() -> anyhow::Result<()> {
    let text = std::fs::read_to_string(fixtures().join("preprocess.json"))?;
    let doc: serde_json::Value = serde_json::from_str(&text)?;
    let cases = doc["cases"].as_array().expect("preprocess.json `cases`");
    assert!(cases.len() >= 30, "expected many sizes, got {}", cases.len());
    for c in cases {
        let (w, h) = (c["width"].as_u64().unwrap() as u32, c["height"].as_u64().unwrap() as u32);
        let (min, max) = (c["min_pixels"].as_u64().unwrap() as usize, c["max_pixels"].as_u64().unwrap() as usize);
        let img = image::RgbImage::from_pixel(w, h, image::Rgb([90, 120, 200]));
        let got = preprocess(&img, &cfg(min, max));
        if w.min(h) < 2 {
            // Our one deliberate difference: a one-pixel side is refused (ImageProcessorConfig::min_side).
            let e = got.expect_err("one-pixel side accepted");
            assert!(
                matches!(e, ModelError::ImageTooSmall { .. }) && e.to_string().contains(&format!("{w}x{h}")),
                "{e}"
            );
            continue;
        }
        match c["grid_thw"].as_array() {
            Some(g) => {
                let want: Vec<usize> = g.iter().map(|x| x.as_u64().unwrap() as usize).collect();
                let p =
                    got.unwrap_or_else(|e| panic!("{w}x{h} ({min}, {max}): transformers gives {want:?}, we fail: {e}"));
                assert_eq!(p.grid_thw.to_vec(), want, "{w}x{h} min {min} max {max}");
            }
            None => {
                let e =
                    got.err().unwrap_or_else(|| panic!("{w}x{h}: transformers rejects it ({}), we accept", c["error"]));
                // A clear error naming the size, never a panic.
                assert!(e.to_string().contains(&format!("{w}x{h}")), "{w}x{h}: unclear error `{e}`");
            }
        }
    }
    // 1x1 is rejected clearly (transformers would upsample it to 56x56).
    let e = preprocess(&image::RgbImage::new(1, 1), &cfg(56 * 56, 28 * 28 * 1280)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "image is 1x1: a side of fewer than 2 pixels has no structure to resize; pass a real screenshot"
    );
    Ok(())
}

#[test]
fn pixel_values_match_transformers() -> anyhow::Result<()> {
    let st = load_st("preprocess_pixels.safetensors");
    let mut n = 0;
    while let Some(img) = st.get(&format!("p{n}_image")) {
        let (h, w, _) = img.dims3()?;
        let raw: Vec<u8> = img.flatten_all()?.to_vec1()?;
        let mm: Vec<i64> = get(&st, &format!("p{n}_minmax")).to_dtype(DType::I64)?.to_vec1()?;
        let rgb = image::RgbImage::from_raw(w as u32, h as u32, raw).unwrap();
        let p = preprocess(&rgb, &cfg(mm[0] as usize, mm[1] as usize))?;
        let want_grid = grids(get(&st, &format!("p{n}_grid_thw")));
        assert_eq!(vec![p.grid_thw], want_grid, "image {n} ({w}x{h})");
        let (max, mean, _) = diff(&p.pixel_tensor(&Device::Cpu)?, get(&st, &format!("p{n}_pixel_values")));
        eprintln!("image {n} ({w}x{h} -> {:?}): pixel_values max abs diff {max:.3e}, mean {mean:.3e}", p.resized);
        assert!(max <= 1e-5, "image {n}: max abs diff {max}");
        n += 1;
    }
    assert!(n >= 3, "expected 3 fixture images, found {n}");
    Ok(())
}

fn screenshots_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("ASKGUI_SCREENSHOTS").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/screenagent-train-sample")
    });
    dir.is_dir().then_some(dir)
}

#[test]
fn real_screenshots_match_transformers() -> anyhow::Result<()> {
    let Some(dir) = screenshots_dir() else {
        eprintln!("SKIPPED real_screenshots_match_transformers: ../shared/data/screenagent-train-sample is absent (set ASKGUI_SCREENSHOTS to run it)");
        return Ok(());
    };
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("screenshots_ref.json"))?)?;
    let st = load_st("screenshots_ref.safetensors");
    let files = meta["images"].as_array().expect("screenshots_ref.json `images`");
    assert!(!files.is_empty());
    let icfg = cfg(56 * 56, 28 * 28 * 1280);
    let (mut worst_sample, mut worst_mean) = (0f64, 0f64);
    for (i, f) in files.iter().enumerate() {
        let rel = f["path"].as_str().expect("path");
        let img = load_image(&dir.join(rel), icfg.max_input_pixels)?;
        let decoded_sum: u64 = img.as_raw().iter().map(|&x| x as u64).sum();
        let want_sum = f["rgb_sum"].as_u64().expect("rgb_sum");
        let p = preprocess(&img, &icfg)?;
        assert_eq!(vec![p.grid_thw], grids(get(&st, &format!("s{i}_grid_thw"))), "{rel}");
        let pv = p.pixel_tensor(&Device::Cpu)?;
        let idx: Vec<i64> = get(&st, &format!("s{i}_sample_idx")).to_vec1()?;
        let flat: Vec<f32> = pv.flatten_all()?.to_vec1()?;
        let sample = Tensor::new(idx.iter().map(|&j| flat[j as usize]).collect::<Vec<f32>>(), &Device::Cpu)?;
        let (smax, smean, _) = diff(&sample, get(&st, &format!("s{i}_sample_val")));
        let (mmax, _, _) = diff(&pv.mean(1)?, get(&st, &format!("s{i}_patch_mean")));
        eprintln!(
            "{rel}: decoded rgb sum {decoded_sum} vs PIL {want_sum}; sampled values max abs diff {smax:.3e} (mean {smean:.3e}); patch means max diff {mmax:.3e}"
        );
        worst_sample = worst_sample.max(smax);
        worst_mean = worst_mean.max(mmax);
        if decoded_sum == want_sum {
            assert!(
                smax <= 1e-5 && mmax <= 1e-5,
                "{rel}: same decoded pixels but preprocessing differs ({smax}, {mmax})"
            );
        } else {
            // Decoders differ by at most a few uint8 steps on a few pixels: 4 steps after normalisation
            // is 4 / (255 * 0.26) = 0.06, and a patch mean moves far less.
            assert!(smax <= 0.07 && mmax <= 0.01, "{rel}: differs beyond JPEG decoder noise ({smax}, {mmax})");
        }
    }
    eprintln!("screenshots: worst sampled diff {worst_sample:.3e}, worst patch-mean diff {worst_mean:.3e}");
    Ok(())
}

#[test]
fn bad_images_give_clear_errors() -> anyhow::Result<()> {
    let tmp = std::env::temp_dir().join(format!("askgui-img-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let garbage = tmp.join("broken.png");
    std::fs::write(&garbage, b"\x89PNG\r\n\x1a\nnot really")?;
    let e = load_image(&garbage, 1 << 26).unwrap_err();
    assert!(matches!(e, ModelError::Image { .. }) && e.to_string().contains("broken.png"), "{e}");
    let e = load_image(&tmp.join("missing.png"), 1 << 26).unwrap_err();
    assert!(e.to_string().contains("missing.png"), "{e}");
    let big = tmp.join("big.png");
    image::RgbImage::new(300, 200).save(&big)?;
    let e = load_image(&big, 50_000).unwrap_err();
    assert!(matches!(e, ModelError::ImageTooLarge { limit: 50_000, .. }), "{e}");
    assert!(e.to_string().contains("300x200") && e.to_string().contains("50000"), "{e}");
    let e = preprocess(&image::RgbImage::new(2, 500), &cfg(3136, 1 << 20)).unwrap_err();
    assert!(matches!(e, ModelError::Tiling { source: TilingError::AspectRatio { .. }, .. }), "{e}");
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(())
}
