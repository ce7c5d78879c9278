//! Parity with Hugging Face transformers on tiny random checkpoints of every family (fixtures from
//! `scripts/fixtures/make_fixtures.py`): preprocessing, prompt ids, vision tower output (with Qwen3-VL's
//! DeepStack features), prompt logits, greedy tokens, and batched generation against one-at-a-time
//! generation; and, for Qwen3-VL, a real screenshot at two pixel budgets.
//!
//! Tolerances (f32 on CPU): the model is compared at 1e-4 of the reference's largest magnitude, which
//! allows for different summation orders in matmuls and softmax over a few layers (observed error is
//! around 1e-6 relative) while catching any real mistake (a wrong mask, rotary section or norm shows up at
//! 1e-2 or more). Preprocessing is compared at 1e-5 absolute: the resize is bit-exact, only the f32
//! normalisation may round differently.

mod common;

use askgui_model::{
    generate, load_image, preprocess, render_chat, render_chat_with, Content, ImageProcessorConfig, Message,
    ModelConfig, Prompt, Qwen2Vl, QwenTokenizer, SamplingParams,
};
use candle_core::{DType, Device, Tensor};
use common::*;

struct Case {
    dir: &'static str,
}

const CASES: [Case; 4] = [
    Case { dir: "tiny-qwen2_5_vl" },
    Case { dir: "tiny-qwen2_vl" },
    // Untied head, GQA, head_dim 32 of a 64-wide decoder, DeepStack at two blocks, 6x6 position table.
    Case { dir: "tiny-qwen3_vl" },
    // Tied head, DeepStack at three blocks (the last one among them), 8x8 position table.
    Case { dir: "tiny-qwen3_vl-tied" },
];

/// The image processor a case was made with: the checkpoint's, with the pixel bounds the case records
/// (the Qwen2 cases: transformers' class defaults).
fn case_processor(model: &Qwen2Vl, case: &serde_json::Value) -> ImageProcessorConfig {
    let bound = |k: &str, d: usize| case[k].as_u64().map_or(d, |x| x as usize);
    ImageProcessorConfig {
        min_pixels: bound("min_pixels", 56 * 56),
        max_pixels: bound("max_pixels", 28 * 28 * 1280),
        ..model.image_config.clone()
    }
}

/// Checks the vision tower's `(N, H * (1 + k))` features: the main merger's against `vision_out`, each
/// DeepStack merger's against `deepstack_out.{j}`.
fn check_vision(dir: &str, vis: &Tensor, st: &std::collections::HashMap<String, Tensor>) -> anyhow::Result<()> {
    let want = get(st, "vision_out");
    let h = want.dim(1)?;
    let sets = vis.dim(1)? / h;
    for j in 0..sets {
        let name = if j == 0 { "vision_out".to_string() } else { format!("deepstack_out.{}", j - 1) };
        let (max, mean, scale) = diff(&vis.narrow(1, j * h, h)?, get(st, &name));
        eprintln!("{dir}: {name} max abs diff {max:.3e} (mean {mean:.3e}, scale {scale:.3})");
        assert!(max <= 1e-4 * scale, "{dir}: {name} differs by {max} (scale {scale})");
    }
    assert!(!st.contains_key(&format!("deepstack_out.{}", sets - 1)), "{dir}: a DeepStack set is missing");
    Ok(())
}

fn messages(case: &serde_json::Value) -> Vec<Message> {
    case["messages"]
        .as_array()
        .expect("case.json messages")
        .iter()
        .map(|m| {
            // A content list, or one text as a plain string.
            let content = match m["content"].as_str() {
                Some(text) => vec![Content::Text(text.to_string())],
                None => m["content"]
                    .as_array()
                    .expect("content list or string")
                    .iter()
                    .map(|c| match c["type"].as_str() {
                        Some("image") => Content::Image,
                        _ => Content::Text(c["text"].as_str().expect("text").to_string()),
                    })
                    .collect(),
            };
            Message::new(m["role"].as_str().expect("role"), content)
        })
        .collect()
}

#[test]
fn tiny_checkpoints_match_transformers() -> anyhow::Result<()> {
    let root = fixtures();
    for case in CASES {
        let dir = root.join(case.dir);
        let st = load_st(&format!("{}/case.safetensors", case.dir));
        let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("case.json"))?)?;
        let model = Qwen2Vl::load(dir.to_str().unwrap(), &Device::Cpu, DType::F32)?;

        // Config: the hub's layout (flat for Qwen2/2.5-VL; nested with `rope_scaling` and `rope_theta` for
        // Qwen3-VL) reads to the same config as transformers 5's nested one.
        let hub = ["config_flat.json", "config_hub.json"].map(|f| dir.join(f)).into_iter().find(|p| p.is_file());
        let hub = ModelConfig::from_file(&hub.expect("config_flat.json or config_hub.json"))?;
        assert_eq!(hub, model.cfg, "{}: the hub's config.json and transformers 5's differ", case.dir);

        // Preprocessing of the case images.
        let icfg = case_processor(&model, &meta);
        let mut pv = Vec::new();
        let mut tokens = Vec::new();
        for rel in meta["images"].as_array().unwrap() {
            let img = load_image(&root.join(rel.as_str().unwrap()), icfg.max_input_pixels)?;
            let p = preprocess(&img, &icfg)?;
            tokens.push(p.num_tokens(2));
            pv.push(p.pixel_tensor(&Device::Cpu)?);
        }
        let pv = Tensor::cat(&pv, 0)?;
        let (max, mean, _) = diff(&pv, get(&st, "pixel_values"));
        eprintln!("{}: pixel_values max abs diff {max:.3e}, mean {mean:.3e}", case.dir);
        assert!(max <= 1e-5, "{}: pixel_values differ by {max}", case.dir);

        // Prompt ids from our chat template and tokenizer.
        let tok = QwenTokenizer::from_file(&dir.join("tokenizer.json"), Some(&model.cfg))?;
        let text = render_chat_with(&messages(&meta), true, model.cfg.arch.default_system_prompt());
        assert_eq!(text, meta["prompt_text"].as_str().unwrap(), "{}: rendered template differs", case.dir);
        let ids = tok.encode_prompt(&text, &tokens)?;
        assert_eq!(ids, to_u32(get(&st, "input_ids")), "{}: input_ids differ", case.dir);

        // Vision tower.
        let grid = grids(get(&st, "image_grid_thw"));
        let ref_pv = get(&st, "pixel_values");
        check_vision(case.dir, &model.image_features(ref_pv, &grid)?, &st)?;

        // Prompt logits.
        let logits = model.forward_prompt(&ids, Some(ref_pv), &grid)?;
        let (max, mean, scale) = diff(&logits, get(&st, "logits"));
        eprintln!("{}: logits max abs diff {max:.3e} (mean {mean:.3e}, scale {scale:.3})", case.dir);
        assert!(max <= 1e-4 * scale, "{}: logits differ by {max} (scale {scale})", case.dir);

        // Greedy generation, no stop tokens (the fixture forced 8 new tokens).
        let params = SamplingParams { max_new_tokens: 8, ..Default::default() };
        let mut images = Vec::new();
        for rel in meta["images"].as_array().unwrap() {
            images.push(preprocess(&load_image(&root.join(rel.as_str().unwrap()), icfg.max_input_pixels)?, &icfg)?);
        }
        let prompt = Prompt { ids: ids.clone(), images: images.clone() };
        let (gens, _) = generate(&model, std::slice::from_ref(&prompt), &params, false)?;
        assert_eq!(gens[0].tokens, to_u32(get(&st, "greedy")), "{}: greedy tokens differ", case.dir);

        // Batched: the case, a text-only prompt and the last image alone, decoded together, give what
        // each gives alone (left padding and per-sequence positions must not leak).
        let short = tok.encode_prompt(&render_chat(&[Message::text("user", "Hello there")], true), &[])?;
        let one_img = tok.encode_prompt(
            &render_chat(&[Message::new("user", vec![Content::Image, Content::Text("What is this?".into())])], true),
            &[*tokens.last().unwrap()],
        )?;
        let batch = vec![
            Prompt { ids: short, images: vec![] },
            prompt,
            Prompt { ids: one_img, images: vec![images.last().unwrap().clone()] },
        ];
        let (together, _) = generate(&model, &batch, &params, true)?;
        for (i, p) in batch.iter().enumerate() {
            let (alone, _) = generate(&model, std::slice::from_ref(p), &params, true)?;
            assert_eq!(together[i].tokens, alone[0].tokens, "{}: batched prompt {i} generates differently", case.dir);
            let (max, _, scale) =
                diff(together[i].prompt_logits.as_ref().unwrap(), alone[0].prompt_logits.as_ref().unwrap());
            assert!(max <= 1e-4 * scale, "{}: batched prompt {i} logits differ by {max}", case.dir);
        }
    }
    Ok(())
}

fn screenshots_dir() -> Option<std::path::PathBuf> {
    let dir = std::env::var_os("ASKGUI_SCREENSHOTS").map(std::path::PathBuf::from).unwrap_or_else(|| {
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/screenagent-train-sample")
    });
    dir.is_dir().then_some(dir)
}

/// Qwen3-VL on a real 1024x768 screenshot at two pixel budgets: one that downscales (to 416x576) and the
/// released default (no resize: both sides are multiples of 32). Pixel values at 1e-5 (as
/// `preprocess.rs`), the last 64 prompt rows' logits at 1e-4 of their largest, every row's argmax (the
/// whole prompt), and 8 greedy tokens. The fixture fed transformers the pixels askgui's own decoder reads
/// (PIL rounds some JPEG pixels otherwise; `preprocess.rs` measures that apart), so the decoded pixels'
/// sum must be the fixture's.
#[test]
fn qwen3_screenshot_matches_transformers() -> anyhow::Result<()> {
    let Some(shots) = screenshots_dir() else {
        eprintln!("SKIPPED qwen3_screenshot_matches_transformers: ../shared/data/screenagent-train-sample is absent (set ASKGUI_SCREENSHOTS to run it)");
        return Ok(());
    };
    let dir = fixtures().join("tiny-qwen3_vl");
    let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("screenshots.json"))?)?;
    let st = load_st("tiny-qwen3_vl/screenshots.safetensors");
    let model = Qwen2Vl::load(dir.to_str().unwrap(), &Device::Cpu, DType::F32)?;
    let tok = model.tokenizer()?;
    let text = render_chat_with(&messages(&meta), true, model.cfg.arch.default_system_prompt());
    assert_eq!(text, meta["prompt_text"].as_str().unwrap());
    for (i, shot) in meta["images"].as_array().expect("images").iter().enumerate() {
        let rel = shot["path"].as_str().expect("path");
        let img = load_image(&shots.join(rel), usize::MAX)?;
        let decoded_sum: u64 = img.as_raw().iter().map(|&x| x as u64).sum();
        let want_sum = shot["rgb_sum"].as_u64().expect("rgb_sum");
        assert_eq!(decoded_sum, want_sum, "{rel}: the decoder's pixels are not the ones the fixture was made from");
        for (budget, b) in shot["budgets"].as_object().expect("budgets") {
            let key = |k: &str| format!("s{i}_{budget}_{k}");
            let icfg = case_processor(&model, b);
            let p = preprocess(&img, &icfg)?;
            assert_eq!(vec![p.grid_thw], grids(get(&st, &key("grid_thw"))), "{budget}");
            let pv = p.pixel_tensor(&Device::Cpu)?;
            let flat: Vec<f32> = pv.flatten_all()?.to_vec1()?;
            let idx: Vec<i64> = get(&st, &key("sample_idx")).to_vec1()?;
            let sample = Tensor::new(idx.iter().map(|&j| flat[j as usize]).collect::<Vec<f32>>(), &Device::Cpu)?;
            let (smax, _, _) = diff(&sample, get(&st, &key("sample_val")));
            let (mmax, _, _) = diff(&pv.mean(1)?, get(&st, &key("patch_mean")));
            assert!(smax <= 1e-5 && mmax <= 1e-5, "{budget}: pixel values differ ({smax}, {mmax})");

            let ids = tok.encode_prompt(&text, &[p.num_tokens(2)])?;
            assert_eq!(ids, to_u32(get(&st, &key("input_ids"))), "{budget}: input_ids differ");
            let logits = model.forward_prompt(&ids, Some(&pv), &[p.grid_thw])?;
            let t = logits.dim(0)?;
            let (max, _, scale) = diff(&logits.narrow(0, t - 64, 64)?, get(&st, &key("logits_last")));
            eprintln!("{rel} at {budget}: grid {:?}, logits max abs diff {max:.3e} (scale {scale:.3})", p.grid_thw);
            assert!(max <= 1e-4 * scale, "{budget}: logits differ by {max} (scale {scale})");
            let argmax: Vec<u32> = logits.argmax(1)?.to_vec1()?;
            assert_eq!(argmax, to_u32(get(&st, &key("logits_argmax"))), "{budget}: a row's argmax differs");
            let params = SamplingParams { max_new_tokens: 8, ..Default::default() };
            let (gens, _) = generate(&model, &[Prompt { ids, images: vec![p] }], &params, false)?;
            assert_eq!(gens[0].tokens, to_u32(get(&st, &key("greedy"))), "{budget}: greedy tokens differ");
        }
    }
    Ok(())
}

/// The keys askgui writes a family's checkpoint under (full training's `save_base`, `merge`) are the keys
/// transformers saved the fixture under: the hub layout for Qwen2/2.5-VL, `model.language_model.*` and
/// `model.visual.*` for Qwen3-VL, whose loader in transformers 5.24 renames nothing.
#[test]
fn saved_checkpoint_keys_are_the_transformers_keys() -> anyhow::Result<()> {
    for case in CASES {
        let dir = fixtures().join(case.dir);
        let model = Qwen2Vl::load(dir.to_str().unwrap(), &Device::Cpu, DType::F32)?;
        let mut ours: Vec<String> = model.base_checkpoint_tensors()?.into_iter().map(|(k, _)| k).collect();
        let mut theirs: Vec<String> =
            candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)?.into_keys().collect();
        ours.sort();
        theirs.sort();
        assert_eq!(ours, theirs, "{}: the checkpoint keys differ", case.dir);
    }
    Ok(())
}
