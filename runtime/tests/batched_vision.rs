//! Batched vision on the tiny random Qwen2.5-VL checkpoint: screenshots of different sizes embedded in
//! one call ([`Packed::embed_all`], one vision forward) give the embeddings that each gives alone, and
//! the feature cache is filled so that the next call encodes nothing.

use std::path::Path;
use std::sync::Arc;

use askgui_model::{preprocess, Qwen2Vl};
use askgui_runtime::{Item, Packed, PreparedImage};
use candle_core::{DType, Device, Tensor};

fn model() -> Qwen2Vl {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/tiny-qwen2_5_vl");
    Qwen2Vl::load(dir.to_str().unwrap(), &Device::Cpu, DType::F32).unwrap()
}

fn screenshot(model: &Qwen2Vl, w: u32, h: u32, seed: u32) -> PreparedImage {
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        image::Rgb([((x * 7 + seed) % 256) as u8, ((y * 3 + seed * 5) % 256) as u8, (seed * 40 % 256) as u8])
    });
    (seed as u64, Arc::new(preprocess(&img, &model.image_config).unwrap()))
}

/// An item whose tokens are a text token, the images' placeholder runs and another text token.
fn item(model: &Qwen2Vl, images: Vec<PreparedImage>) -> Item {
    let merge = model.cfg.vision.spatial_merge_size;
    let mut ids = vec![9u32];
    for (_, img) in &images {
        ids.extend(std::iter::repeat_n(model.cfg.image_token_id, img.num_tokens(merge)));
    }
    ids.push(11);
    let positions = (0..ids.len() as u32).map(|p| [p; 3]).collect();
    Item { ids, positions, images, cache: model.text.new_cache(), logits_rows: 1, forks: vec![], adapter: None }
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

/// Tolerance 1e-5 absolute (embeddings are O(1)): batching changes only the row counts of the vision
/// tower's GEMMs; the attention of each image is over its own rows in both cases.
#[test]
fn batched_vision_equals_one_image_at_a_time() {
    let m = model();
    let shots = [(200, 150, 1), (120, 260, 2), (320, 200, 3), (200, 150, 4)];
    let shots: Vec<PreparedImage> = shots.iter().map(|&(w, h, s)| screenshot(&m, w, h, s)).collect();
    // Three items: one image, two images, and one image shared with the first item.
    let items = [
        item(&m, vec![shots[0].clone()]),
        item(&m, vec![shots[1].clone(), shots[2].clone()]),
        item(&m, vec![shots[3].clone(), shots[0].clone()]),
    ];

    let mut together = Packed::new(m);
    let embedded = together.embed_all(&items.iter().collect::<Vec<_>>());
    assert_eq!(embedded.images_encoded, 4, "four distinct screenshots in one call");
    let batched: Vec<Tensor> = embedded.embeds.into_iter().map(|e| e.unwrap()).collect();

    let mut alone = Packed::new(model());
    for (i, (it, b)) in items.iter().zip(&batched).enumerate() {
        // A fresh cache for every image: each is encoded by itself.
        let parts: Vec<Tensor> = it
            .images
            .iter()
            .map(|img| {
                let mut fresh = Packed::new(model());
                let one = item(&fresh.model, vec![img.clone()]);
                let e = fresh.embed(&one).unwrap();
                e.narrow(1, 1, e.dim(1).unwrap() - 2).unwrap()
            })
            .collect();
        let single = alone.embed(it).unwrap();
        let (t, h) = (single.dim(1).unwrap(), single.dim(2).unwrap());
        assert_eq!(b.dims(), &[1, t, h]);
        let image_rows = Tensor::cat(&parts, 1).unwrap();
        let diff = max_abs_diff(&b.narrow(1, 1, t - 2).unwrap(), &image_rows);
        eprintln!("item {i}: max abs(batched - one at a time) = {diff:e}");
        assert!(diff <= 1e-5, "item {i}: batched image rows differ from one-at-a-time by {diff}");
        assert!(max_abs_diff(b, &single) <= 1e-5, "item {i}: batched vs the item alone");
    }

    // Everything is cached now: the next call encodes nothing and gives the same embeddings.
    let again = together.embed_all(&items.iter().collect::<Vec<_>>());
    assert_eq!(again.images_encoded, 0);
    for (a, b) in again.embeds.into_iter().zip(&batched) {
        assert_eq!(max_abs_diff(&a.unwrap(), b), 0.0);
    }
}

/// A bad item (a placeholder count its images do not fill) fails alone; the others are embedded.
#[test]
fn a_bad_item_fails_alone() {
    let m = model();
    let good = item(&m, vec![screenshot(&m, 200, 150, 1)]);
    let mut bad = item(&m, vec![screenshot(&m, 120, 260, 2)]);
    bad.ids.insert(1, m.cfg.image_token_id);
    bad.positions.push([0; 3]);
    let mut packed = Packed::new(m);
    let embedded = packed.embed_all(&[&good, &bad, &good]);
    let ok: Vec<bool> = embedded.embeds.iter().map(|e| e.is_ok()).collect();
    assert_eq!(ok, [true, false, true]);
    let message = embedded.embeds[1].as_ref().err().unwrap().to_string();
    assert!(message.contains("image tokens"), "{message}");
}
