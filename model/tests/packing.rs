//! Padding-free packing (`StepOptions::pack`): several sequences back to back in one row, attention
//! block-diagonal over them and causal inside each, every sequence at its own M-RoPE positions.
//!
//! On the PEFT batch fixtures of Qwen2.5-VL and Qwen3-VL (two sequences, three images of two sizes) plus a
//! text-only sequence (for Qwen3-VL its DeepStack features travel with each sequence's image rows):
//! - the packed loss and every LoRA gradient equal the right-padded batch's, and PEFT's own padded batch,
//!   within the tolerances of `tests/lora_grad.rs` (loss 1e-5 relative, each gradient 1e-4 of its largest
//!   magnitude): the two layouts differ only in GEMM row counts, so in float reassociation;
//! - each sequence's logits in a pack equal its logits alone and the inference forward's, within 1e-5 of
//!   the largest logit (as `tests/packed.rs`);
//! - full training with the region loss gets the padded batch's gradients for every base weight.
//!
//! A pack whose attention leaked across sequences, or whose positions ran on from the previous sequence,
//! moves these by 1e-2 or more (the last test shows the size of such a leak).

mod common;

use askgui_model::{Qwen2Vl, StepOptions, TrainExample};
use candle_core::{DType, Device, Tensor};
use common::*;

const LOSS_REL: f64 = 1e-5;
const GRAD_REL: f64 = 1e-4;
const LOGIT_REL: f64 = 1e-5;

/// `(checkpoint, PEFT gradient fixture folder)` of each family the tests run on.
const KINDS: [(&str, &str); 2] = [("tiny-qwen2_5_vl", "lora/grad"), ("tiny-qwen3_vl", "lora/grad-qwen3_vl")];

fn tiny((ckpt, _): (&str, &str)) -> Qwen2Vl {
    Qwen2Vl::load(fixtures().join(ckpt).to_str().unwrap(), &Device::Cpu, DType::F32).unwrap()
}

/// The PEFT fixture's model with its adapter trainable and active.
fn peft_model(kind: (&str, &str)) -> anyhow::Result<Qwen2Vl> {
    let mut m = tiny(kind);
    m.load_adapter("peft", fixtures().join(kind.1).join("adapter"))?;
    m.make_adapter_trainable("peft")?;
    m.set_active_adapter(Some("peft"))?;
    Ok(m)
}

/// A text-only sequence: the first sequence's text after its last image, the second half supervised.
fn text_only(first: &TrainExample, vision_end: u32) -> TrainExample {
    let after = first.ids.iter().rposition(|&t| t == vision_end).expect("the fixture has images") + 1;
    let ids = first.ids[after..].to_vec();
    let n = ids.len();
    assert!(n >= 4, "the fixture's text after its images has {n} tokens");
    TrainExample {
        ids,
        labels_mask: (0..n).map(|j| j >= n / 2).collect(),
        pixel_values: None,
        grid_thw: vec![],
        region_targets: vec![],
    }
}

/// The fixture batch (PEFT's two sequences) and the same plus a text-only sequence in the middle.
fn batches(m: &Qwen2Vl, (_, grad): (&str, &str)) -> (Vec<TrainExample>, Vec<TrainExample>) {
    let want = load_st(&format!("{grad}/batch.safetensors"));
    let two = peft_batch(&want, m.cfg.vision_start_token_id);
    let sizes: Vec<[usize; 3]> = two.iter().flat_map(|e| e.grid_thw.clone()).collect();
    assert!(sizes.iter().any(|g| g != &sizes[0]), "the fixture's images should differ in size: {sizes:?}");
    let three = vec![two[0].clone(), text_only(&two[0], m.cfg.vision_end_token_id), two[1].clone()];
    (two, three)
}

/// Asserts `got` is within `rel` of `want`'s largest magnitude; returns that relative difference.
fn close(what: &str, got: &Tensor, want: &Tensor, rel: f64) -> f64 {
    let (max, _, scale) = diff(got, want);
    assert!(scale > 0.0 && max <= rel * scale, "{what}: differs by {max:.3e} (largest magnitude {scale:.3e})");
    max / scale
}

fn opts(pack: bool, checkpointing: bool) -> StepOptions {
    StepOptions { pack, checkpointing, ..Default::default() }
}

#[test]
fn packed_loss_and_lora_gradients_equal_the_padded_batch_and_peft() -> anyhow::Result<()> {
    KINDS.into_iter().try_for_each(packed_equals_padded_and_peft)
}

fn packed_equals_padded_and_peft(kind: (&str, &str)) -> anyhow::Result<()> {
    eprintln!("{}:", kind.0);
    let m = peft_model(kind)?;
    let (two, three) = batches(&m, kind);
    let want = load_st(&format!("{}/batch.safetensors", kind.1));
    let peft_loss = get(&want, "loss").to_scalar::<f32>()? as f64;
    let vars = m.trainable_vars("peft")?;

    // PEFT's right-padded batch against our pack of the same two sequences.
    let packed = m.loss_and_grads(&two, &opts(true, true))?;
    let rel = (packed.loss - peft_loss).abs() / peft_loss.abs();
    assert!(rel <= LOSS_REL, "packed loss {} vs PEFT's padded {peft_loss}", packed.loss);
    let mut worst = 0f64;
    for (name, v) in &vars {
        let g = packed.grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{name}: no gradient"));
        worst = worst.max(close(&format!("{name} against PEFT"), g, get(&want, name), GRAD_REL));
    }
    eprintln!("pack of 2 vs PEFT: loss rel diff {rel:.2e}, gradients {worst:.2e}");

    // Three sequences (one text-only), with and without checkpointing.
    for ckpt in [true, false] {
        let padded = m.loss_and_grads(&three, &opts(false, ckpt))?;
        let packed = m.loss_and_grads(&three, &opts(true, ckpt))?;
        assert_eq!(packed.supervised_tokens, padded.supervised_tokens);
        let rel = (packed.loss - padded.loss).abs() / padded.loss.abs();
        assert!(rel <= LOSS_REL, "checkpointing {ckpt}: packed loss {} vs padded {}", packed.loss, padded.loss);
        let mut worst = 0f64;
        for (name, v) in &vars {
            let (g, w) = (packed.grads.get(v.as_tensor()), padded.grads.get(v.as_tensor()));
            let (g, w) = (g.unwrap_or_else(|| panic!("{name}: no packed gradient")), w.expect("padded gradient"));
            worst = worst.max(close(name, g, w, GRAD_REL));
        }
        eprintln!("pack of 3 vs padded (checkpointing {ckpt}): loss rel diff {rel:.2e}, gradients {worst:.2e}");
    }
    Ok(())
}

#[test]
fn each_sequence_of_a_pack_has_its_logits_alone() -> anyhow::Result<()> {
    KINDS.into_iter().try_for_each(each_sequence_alone)
}

fn each_sequence_alone(kind: (&str, &str)) -> anyhow::Result<()> {
    eprintln!("{}:", kind.0);
    let m = tiny(kind);
    let (_, three) = batches(&m, kind);
    let packed = m.train_logits(&three, true)?;
    let padded = m.train_logits(&three, false)?;
    for (i, e) in three.iter().enumerate() {
        let alone = &m.train_logits(std::slice::from_ref(e), false)?[0];
        // The inference forward: the path that the parity tests hold to transformers.
        let inference = m.forward_prompt(&e.ids, e.pixel_values.as_ref(), &e.grid_thw)?;
        let a = close(&format!("sequence {i} packed vs alone"), &packed[i], alone, LOGIT_REL);
        let b = close(&format!("sequence {i} padded vs alone"), &padded[i], alone, LOGIT_REL);
        let c = close(&format!("sequence {i} packed vs inference"), &packed[i], &inference, LOGIT_REL);
        eprintln!("sequence {i} ({} tokens): packed {a:.2e}, padded {b:.2e}, inference {c:.2e}", e.ids.len());
    }
    Ok(())
}

/// Full training (every base weight a `Var`) with the region loss on image tokens: the pack gets the
/// padded batch's loss and gradients, checkpointing on.
#[test]
fn packing_holds_for_full_training_and_the_region_loss() -> anyhow::Result<()> {
    KINDS.into_iter().try_for_each(full_training_packed)
}

/// For Qwen3-VL the region loss reads decoder layer 1, whose rows still carry a DeepStack set, and
/// full training reaches the position table, the patch bias and the q/k norms.
fn full_training_packed(kind: (&str, &str)) -> anyhow::Result<()> {
    eprintln!("{}:", kind.0);
    let mut m = tiny(kind);
    m.make_base_trainable()?;
    let (_, mut three) = batches(&m, kind);
    for e in three.iter_mut().filter(|e| !e.grid_thw.is_empty()) {
        let pads: Vec<usize> = (0..e.ids.len()).filter(|&p| e.ids[p] == m.cfg.image_token_id).collect();
        e.region_targets = pads.iter().step_by(3).enumerate().map(|(k, &p)| (p, 40 + k as u32)).collect();
    }
    let o = |pack| StepOptions { pack, region_weight: 0.5, region_layer: 1, ..Default::default() };
    let padded = m.loss_and_grads(&three, &o(false))?;
    let packed = m.loss_and_grads(&three, &o(true))?;
    let rel = (packed.loss - padded.loss).abs() / padded.loss.abs();
    assert!(rel <= LOSS_REL, "packed loss {} vs padded {}", packed.loss, padded.loss);
    let vars = m.base_vars()?;
    let mut worst = 0f64;
    for (name, v) in &vars {
        let w = padded.grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{name}: no padded gradient"));
        let g = packed.grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{name}: no packed gradient"));
        worst = worst.max(close(name, g, w, GRAD_REL));
    }
    eprintln!(
        "full training + region loss, {} base tensors: loss rel diff {rel:.2e}, gradients {worst:.2e}",
        vars.len()
    );
    Ok(())
}

/// The control: the same three sequences concatenated into ONE sequence (attention and positions run on
/// across the boundaries) are far from the pack, so the checks above can tell a leak.
#[test]
fn a_pack_differs_from_one_long_concatenated_sequence() -> anyhow::Result<()> {
    let m = tiny(KINDS[0]);
    let (_, three) = batches(&m, KINDS[0]);
    let packed = m.train_logits(&three, true)?;
    let joined = TrainExample {
        ids: three.iter().flat_map(|e| e.ids.clone()).collect(),
        labels_mask: three.iter().flat_map(|e| e.labels_mask.clone()).collect(),
        pixel_values: Some(Tensor::cat(&three.iter().filter_map(|e| e.pixel_values.clone()).collect::<Vec<_>>(), 0)?),
        grid_thw: three.iter().flat_map(|e| e.grid_thw.clone()).collect(),
        region_targets: vec![],
    };
    let long = &m.train_logits(&[joined], false)?[0];
    let (n0, n1) = (three[0].ids.len(), three[1].ids.len());
    let (max, _, scale) = diff(&long.narrow(0, n0, n1)?, &packed[1]);
    eprintln!("text-only sequence after another vs alone: {:.2e} of the largest logit", max / scale);
    assert!(max > 1e2 * LOGIT_REL * scale, "a leak across sequences would go unseen: {max} vs scale {scale}");
    Ok(())
}
