//! Parity with Hugging Face transformers on tiny random checkpoints (fixtures from
//! `scripts/fixtures/make_fixtures.py`): preprocessing, prompt ids, vision tower output, prompt logits, greedy
//! tokens, and batched generation against one-at-a-time generation.
//!
//! Tolerances (f32 on CPU): the model is compared at 1e-4 of the reference's largest magnitude, which
//! allows for different summation orders in matmuls and softmax over a few layers (observed error is
//! around 1e-6 relative) while catching any real mistake (a wrong mask, rotary section or norm shows up at
//! 1e-2 or more). Preprocessing is compared at 1e-5 absolute: the resize is bit-exact, only the f32
//! normalisation may round differently.

mod common;

use askgui_model::{
    generate, load_image, preprocess, render_chat, Content, ImageProcessorConfig, Message, ModelConfig, Prompt,
    Qwen2Vl, QwenTokenizer, SamplingParams,
};
use candle_core::{DType, Device, Tensor};
use common::*;

struct Case {
    dir: &'static str,
}

const CASES: [Case; 2] = [Case { dir: "tiny-qwen2_5_vl" }, Case { dir: "tiny-qwen2_vl" }];

fn messages(case: &serde_json::Value) -> Vec<Message> {
    case["messages"]
        .as_array()
        .expect("case.json messages")
        .iter()
        .map(|m| {
            let content = m["content"]
                .as_array()
                .expect("content list")
                .iter()
                .map(|c| match c["type"].as_str() {
                    Some("image") => Content::Image,
                    _ => Content::Text(c["text"].as_str().expect("text").to_string()),
                })
                .collect();
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

        // Config: the hub's flat layout reads to the same config as transformers 5's nested one.
        let flat = ModelConfig::from_file(&dir.join("config_flat.json"))?;
        assert_eq!(flat, model.cfg, "{}: flat and nested config.json differ", case.dir);

        // Preprocessing of the case images.
        let icfg = ImageProcessorConfig { min_pixels: 56 * 56, max_pixels: 28 * 28 * 1280, ..Default::default() };
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
        let text = render_chat(&messages(&meta), true);
        assert_eq!(text, meta["prompt_text"].as_str().unwrap(), "{}: rendered template differs", case.dir);
        let ids = tok.encode_prompt(&text, &tokens)?;
        assert_eq!(ids, to_u32(get(&st, "input_ids")), "{}: input_ids differ", case.dir);

        // Vision tower.
        let grid = grids(get(&st, "image_grid_thw"));
        let ref_pv = get(&st, "pixel_values");
        let vis = model.image_features(ref_pv, &grid)?;
        let (max, mean, scale) = diff(&vis, get(&st, "vision_out"));
        eprintln!("{}: vision max abs diff {max:.3e} (mean {mean:.3e}, scale {scale:.3})", case.dir);
        assert!(max <= 1e-4 * scale, "{}: vision output differs by {max} (scale {scale})", case.dir);

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

        // Batched: the case, a text-only prompt and the second image alone, decoded together, give what
        // each gives alone (left padding and per-sequence positions must not leak).
        let short = tok.encode_prompt(&render_chat(&[Message::text("user", "Hello there")], true), &[])?;
        let one_img = tok.encode_prompt(
            &render_chat(&[Message::new("user", vec![Content::Image, Content::Text("What is this?".into())])], true),
            &[tokens[1]],
        )?;
        let batch = vec![
            Prompt { ids: short, images: vec![] },
            prompt,
            Prompt { ids: one_img, images: vec![images[1].clone()] },
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
