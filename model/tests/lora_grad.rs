//! Trainable LoRA against PyTorch + PEFT (fixtures from `scripts/fixtures/make_lora_grad_fixtures.py`): every LoRA
//! `Var` gets a gradient, no base weight does, loss and gradients match PEFT's, and optimiser steps change
//! the adapter only.
//!
//! Tolerances (f32 on CPU): the loss within 1e-5 relative, each gradient within 1e-4 of its own largest
//! magnitude (the reference's), as for logits in `tests/parity.rs`: different summation orders through a
//! few layers forward and backward; a wrong scale, shift, mask or transposed factor is off by 1e-1 or more.

mod common;

use askgui_model::{LoraConfig, Qwen2Vl, StepOptions, StepOutput, TrainExample};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use common::*;

const TARGETS: [&str; 7] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];
const REGENERATE_GRAD: &str =
    "regenerate with `python scripts/fixtures/make_lora_grad_fixtures.py` (needs torch, transformers, peft)";

struct Case {
    model: Qwen2Vl,
    ids: Vec<u32>,
    pv: Tensor,
    grid: Vec<[usize; 3]>,
    mask: Vec<bool>,
}

/// The families whose PEFT gradients are fixtures: `(checkpoint, fixture folder)`. Qwen3-VL's adapter
/// also targets the vision blocks' `linear_fc1/2` and `attn.proj`, which reach the main and the DeepStack
/// mergers too.
const KINDS: [(&str, &str); 2] = [("tiny-qwen2_5_vl", "lora/grad"), ("tiny-qwen3_vl", "lora/grad-qwen3_vl")];

fn case() -> anyhow::Result<Case> {
    case_in(KINDS[0])
}

fn case_in((ckpt, grad): (&str, &str)) -> anyhow::Result<Case> {
    let st = load_st(&format!("{ckpt}/case.safetensors"));
    let g = load_st(&format!("{grad}/grads.safetensors"));
    let model = Qwen2Vl::load(fixtures().join(ckpt).to_str().unwrap(), &Device::Cpu, DType::F32)?;
    let mask = to_u32(get(&g, "labels_mask")).iter().map(|&m| m != 0).collect();
    Ok(Case {
        model,
        ids: to_u32(get(&st, "input_ids")),
        pv: get(&st, "pixel_values").clone(),
        grid: grids(get(&st, "image_grid_thw")),
        mask,
    })
}

impl Case {
    fn example(&self) -> TrainExample {
        TrainExample {
            ids: self.ids.clone(),
            labels_mask: self.mask.clone(),
            pixel_values: Some(self.pv.clone()),
            grid_thw: self.grid.clone(),
            region_targets: vec![],
        }
    }

    /// The loss as one candle graph: its `backward` is candle's whole `GradStore`.
    fn loss(&self) -> anyhow::Result<Tensor> {
        Ok(self.model.loss(&[self.example()], 0)?)
    }

    fn step(&self, checkpointing: bool, dropout_seed: u64) -> anyhow::Result<StepOutput> {
        Ok(self
            .model
            .loss_and_grads(&[self.example()], &StepOptions { checkpointing, dropout_seed, ..Default::default() })?)
    }
}

fn abs_max(t: &Tensor) -> f32 {
    t.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
}

fn assert_no_base_grads(model: &Qwen2Vl, grads: &GradStore) {
    let base = model.base_tensors();
    assert!(base.len() > 50, "only {} base tensors listed", base.len());
    for (name, t) in &base {
        assert!(grads.get(t).is_none(), "base tensor `{name}` has a gradient");
    }
}

#[test]
fn new_adapter_has_the_lora_gradient_pattern() -> anyhow::Result<()> {
    let mut c = case()?;
    c.model.add_trainable_adapter("t", LoraConfig::new(4, 8.0, &TARGETS), 7)?;
    c.model.set_active_adapter(Some("t"))?;
    let vars = c.model.trainable_vars("t")?;
    // 7 text linears x 2 layers + vision gate/up/down x 4 blocks, A and B each (what PEFT wraps)
    assert_eq!(vars.len(), 2 * (7 * 2 + 3 * 4));
    assert!(vars.iter().any(|(n, _)| n.starts_with("visual.")), "no vision target");
    for (name, v) in &vars {
        if name.ends_with("lora_A") {
            let inp = v.dim(1)? as f32;
            let m = abs_max(v.as_tensor());
            assert!(m > 0.5 / inp.sqrt() && m <= 1.0 / inp.sqrt(), "{name}: A max {m} is not U(+-1/sqrt({inp}))");
        } else {
            assert_eq!(abs_max(v.as_tensor()), 0.0, "{name}: B must start at zero");
        }
    }
    let grads = c.loss()?.backward()?;
    for (name, v) in &vars {
        let g = grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{name}: no gradient"));
        let m = abs_max(g);
        if name.ends_with("lora_A") {
            assert_eq!(m, 0.0, "{name}: with B = 0 the gradient of A must be 0");
        } else {
            assert!(m > 0.0, "{name}: zero gradient");
        }
    }
    assert_no_base_grads(&c.model, &grads);
    Ok(())
}

#[test]
fn loss_and_gradients_match_peft() -> anyhow::Result<()> {
    for kind in KINDS {
        loss_and_gradients_match_peft_in(kind)?;
    }
    Ok(())
}

fn loss_and_gradients_match_peft_in(kind: (&str, &str)) -> anyhow::Result<()> {
    let c = peft_case_in(kind)?;
    let want = load_st(&format!("{}/grads.safetensors", kind.1));
    eprintln!("{}:", kind.0);
    let loss = c.loss()?;
    let (got_l, want_l) = (loss.to_scalar::<f32>()? as f64, get(&want, "loss").to_scalar::<f32>()? as f64);
    let rel = (got_l - want_l).abs() / want_l.abs();
    eprintln!("loss {got_l:.7} vs PEFT {want_l:.7}: relative diff {rel:.3e}");
    assert!(rel <= 1e-5, "loss {got_l} vs PEFT {want_l}; {REGENERATE_GRAD}");

    let grads = loss.backward()?;
    assert_no_base_grads(&c.model, &grads);
    let vars = c.model.trainable_vars("peft")?;
    assert_eq!(vars.len(), want.len() - 2, "PEFT has {} LoRA gradients", want.len() - 2);
    let (mut worst, mut worst_name) = (0f64, String::new());
    for (name, v) in &vars {
        let g = grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{name}: no gradient"));
        let (max, _, scale) = diff(g, get(&want, name));
        assert!(scale > 0.0 && abs_max(g) > 0.0, "{name}: zero gradient");
        assert!(max <= 1e-4 * scale, "{name}: gradient differs by {max} (scale {scale}); {REGENERATE_GRAD}");
        if max / scale > worst {
            (worst, worst_name) = (max / scale, name.clone());
        }
    }
    eprintln!("{} gradients: largest diff / max magnitude {worst:.3e} ({worst_name})", vars.len());
    Ok(())
}

#[test]
fn sgd_steps_change_only_the_adapter() -> anyhow::Result<()> {
    let c = peft_case()?;
    let base: Vec<(String, Vec<f32>)> = c
        .model
        .base_tensors()
        .into_iter()
        .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    let vars: Vec<(String, Var)> = c.model.trainable_vars("peft")?;
    let before: Vec<Tensor> = vars.iter().map(|(_, v)| v.as_tensor().copy().unwrap()).collect();
    let mut losses = vec![];
    for step in 0..3 {
        let out = c.step(true, step)?;
        losses.push(out.loss as f32);
        for (name, v) in &vars {
            let g = out.grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{name}: no gradient"));
            v.set(&(v.as_tensor() - (g * 0.05)?)?)?;
        }
    }
    losses.push(c.model.eval_loss(&[c.example()])?.0 as f32);
    eprintln!("SGD losses {losses:?}");
    assert!(losses[3] < losses[0], "SGD did not lower the loss: {losses:?}");
    for ((name, v), b) in vars.iter().zip(&before) {
        assert!(abs_max(&(v.as_tensor() - b)?) > 0.0, "{name} did not change");
    }
    for ((name, t), (_, old)) in c.model.base_tensors().iter().zip(&base) {
        let now = t.flatten_all()?.to_vec1::<f32>()?;
        assert!(now.iter().zip(old).all(|(a, b)| a.to_bits() == b.to_bits()), "base tensor `{name}` changed");
    }
    Ok(())
}

#[test]
fn dropout_is_seeded() -> anyhow::Result<()> {
    let mut c = case()?;
    let mut cfg = LoraConfig::new(4, 8.0, &["q_proj", "v_proj"]);
    cfg.lora_dropout = 0.5;
    c.model.add_trainable_adapter("d", cfg, 1)?;
    // Give B a non-zero value so dropout changes the output.
    for (name, v) in c.model.trainable_vars("d")? {
        if name.ends_with("lora_B") {
            v.set(&(v.ones_like()? * 0.1)?)?;
        }
    }
    c.model.set_active_adapter(Some("d"))?;
    let l = |seed: u64| -> f32 { c.model.loss(&[c.example()], seed).unwrap().to_scalar::<f32>().unwrap() };
    let (a, b, a2) = (l(1), l(2), l(1));
    eprintln!("dropout losses: seed 1 {a}, seed 2 {b}, seed 1 again {a2}");
    assert_eq!(a.to_bits(), a2.to_bits(), "same seed, different dropout");
    assert_ne!(a, b, "different seeds, same dropout");
    Ok(())
}

/// Gradient checkpointing recomputes every block in the backward; with LoRA dropout on (the masks are
/// seeded per layer, so the recomputation draws the same ones) it must give the one-graph loss and
/// gradients up to summation order: 1e-5 of each gradient's largest magnitude, 1e-6 relative on the loss.
#[test]
fn checkpointing_gives_the_one_graph_gradients() -> anyhow::Result<()> {
    let mut c = peft_case()?;
    c.model.set_adapter_dropout("peft", 0.3)?;
    let vars = c.model.trainable_vars("peft")?;
    let full = c.step(false, 5)?;
    let ckpt = c.step(true, 5)?;
    let other_seed = c.step(true, 6)?;
    eprintln!(
        "loss one graph {:.7}, checkpointed {:.7}, other dropout seed {:.7}",
        full.loss, ckpt.loss, other_seed.loss
    );
    assert!((full.loss - ckpt.loss).abs() <= 1e-6 * full.loss.abs(), "{} vs {}", full.loss, ckpt.loss);
    assert_ne!(full.loss, other_seed.loss, "dropout had no effect");
    let mut worst = 0f64;
    for (name, v) in &vars {
        let a = full.grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{name}: no gradient (one graph)"));
        let b = ckpt.grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{name}: no gradient (checkpointed)"));
        let (max, _, scale) = diff(b, a);
        assert!(scale > 0.0 && max <= 1e-5 * scale, "{name}: differs by {max} (scale {scale})");
        worst = worst.max(max / scale);
    }
    eprintln!("{} gradients: largest diff / max magnitude {worst:.3e}", vars.len());
    // Only the adapter's gradients are returned, in both modes.
    assert_eq!(full.grads.get_ids().count(), vars.len());
    assert_eq!(ckpt.grads.get_ids().count(), vars.len());
    Ok(())
}

/// Loads the PEFT fixture adapter as a trainable one and activates it.
fn peft_case() -> anyhow::Result<Case> {
    peft_case_in(KINDS[0])
}

fn peft_case_in(kind: (&str, &str)) -> anyhow::Result<Case> {
    let mut c = case_in(kind)?;
    c.model.load_adapter("peft", fixtures().join(kind.1).join("adapter"))?;
    c.model.make_adapter_trainable("peft")?;
    c.model.set_active_adapter(Some("peft"))?;
    Ok(c)
}

/// A right-padded batch of two sequences of different lengths and images (three images: the first
/// sequence has two) against PEFT: one mean over the 13 supervised tokens of the batch. Same tolerances
/// as for one sequence; checkpointing on, as the trainer runs.
#[test]
fn batched_loss_and_gradients_match_peft() -> anyhow::Result<()> {
    for kind in KINDS {
        batched_loss_and_gradients_match_peft_in(kind)?;
    }
    Ok(())
}

fn batched_loss_and_gradients_match_peft_in(kind: (&str, &str)) -> anyhow::Result<()> {
    let c = peft_case_in(kind)?;
    let want = load_st(&format!("{}/batch.safetensors", kind.1));
    eprintln!("{}:", kind.0);
    let batch = peft_batch(&want, c.model.cfg.vision_start_token_id);
    let sup = to_u32(get(&want, "labels_mask"));
    assert_eq!((batch.len(), batch[0].grid_thw.len()), (2, 2), "fixture layout; {REGENERATE_GRAD}");
    assert!(batch[0].ids.len() != batch[1].ids.len(), "the fixture's sequences should differ in length");

    // The vision blocks over the three images at once (the default here), and image by image
    // (`vision_rows` 1: every frame a range of its own).
    for vision_rows in [StepOptions::default().vision_rows, 1] {
        let out = c.model.loss_and_grads(&batch, &StepOptions { vision_rows, ..Default::default() })?;
        let want_l = get(&want, "loss").to_scalar::<f32>()? as f64;
        let rel = (out.loss - want_l).abs() / want_l.abs();
        eprintln!(
            "vision_rows {vision_rows}: batched loss {:.7} vs PEFT {want_l:.7}: relative diff {rel:.3e}",
            out.loss
        );
        assert!(rel <= 1e-5, "loss {} vs PEFT {want_l}; {REGENERATE_GRAD}", out.loss);
        assert_eq!(out.supervised_tokens, sup.iter().filter(|&&m| m != 0).count());
        let mut worst = 0f64;
        for (name, v) in c.model.trainable_vars("peft")? {
            let g = out.grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{name}: no gradient"));
            let (max, _, scale) = diff(g, get(&want, &name));
            assert!(scale > 0.0 && max <= 1e-4 * scale, "{name}: gradient differs by {max} (scale {scale})");
            worst = worst.max(max / scale);
        }
        eprintln!("vision_rows {vision_rows}: batched gradients: largest diff / max magnitude {worst:.3e}");
    }
    Ok(())
}

/// Image by image, with LoRA dropout on: each range draws masks of its own, and the recomputation draws
/// them again, so checkpointing gives the one-graph loss and gradients (tolerances of
/// `checkpointing_gives_the_one_graph_gradients`).
#[test]
fn image_by_image_checkpointing_gives_the_one_graph_gradients() -> anyhow::Result<()> {
    let mut c = peft_case()?;
    c.model.set_adapter_dropout("peft", 0.3)?;
    let batch = peft_batch(&load_st("lora/grad/batch.safetensors"), c.model.cfg.vision_start_token_id);
    let run = |checkpointing: bool| {
        c.model.loss_and_grads(
            &batch,
            &StepOptions { checkpointing, vision_rows: 1, dropout_seed: 3, ..Default::default() },
        )
    };
    let (full, ckpt) = (run(false)?, run(true)?);
    assert!((full.loss - ckpt.loss).abs() <= 1e-6 * full.loss.abs(), "{} vs {}", full.loss, ckpt.loss);
    for (name, v) in c.model.trainable_vars("peft")? {
        let a = full.grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{name}: no gradient (one graph)"));
        let b = ckpt.grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{name}: no gradient (checkpointed)"));
        let (max, _, scale) = diff(b, a);
        assert!(scale > 0.0 && max <= 1e-5 * scale, "{name}: differs by {max} (scale {scale})");
    }
    Ok(())
}

/// Five AdamW steps (candle-nn's `AdamW`, PyTorch's formula) from the PEFT adapter against
/// `torch.optim.AdamW` with the same hyperparameters: each loss within 1e-5 relative, the final LoRA
/// weights within 2e-5 of each tensor's largest magnitude. AdamW divides by `sqrt(v)`, so an element whose
/// gradient is near zero can take a step of up to `lr` on either side from gradient noise of 1e-6; the
/// weights are O(1e-1) and a wrong step would move many elements by `lr` (1e-3, 1e-2 relative).
#[test]
fn adamw_steps_match_pytorch() -> anyhow::Result<()> {
    let c = peft_case()?;
    let want = load_st("lora/grad/adamw.safetensors");
    let h = |k: &str| -> anyhow::Result<f64> { Ok(get(&want, k).to_dtype(DType::F64)?.to_scalar::<f64>()?) };
    let params = ParamsAdamW {
        lr: h("lr")?,
        beta1: h("beta1")?,
        beta2: h("beta2")?,
        eps: h("eps")?,
        weight_decay: h("weight_decay")?,
    };
    let vars = c.model.trainable_vars("peft")?;
    let mut opt = AdamW::new(vars.iter().map(|(_, v)| v.clone()).collect(), params)?;
    let want_losses: Vec<f32> = get(&want, "losses").to_vec1()?;
    let mut worst_loss = 0f64;
    for (step, &wl) in want_losses.iter().enumerate() {
        let out = c.step(true, step as u64)?;
        let rel = (out.loss - wl as f64).abs() / (wl as f64).abs();
        assert!(rel <= 1e-5, "step {step}: loss {} vs PyTorch {wl}; {REGENERATE_GRAD}", out.loss);
        worst_loss = worst_loss.max(rel);
        opt.step(&out.grads)?;
    }
    let mut worst = 0f64;
    for (name, v) in &vars {
        let (max, _, scale) = diff(v.as_tensor(), get(&want, &format!("final.{name}")));
        assert!(max <= 2e-5 * scale, "{name}: final weight differs by {max} (scale {scale})");
        worst = worst.max(max / scale);
    }
    eprintln!("AdamW losses {want_losses:?}: largest relative diff {worst_loss:.3e}; final weights: largest diff / max magnitude {worst:.3e}");
    Ok(())
}
