//! One LoRA step of the tiny Qwen2.5-VL on the CPU in bf16 (f32 adapter masters, `master_dtype`) against
//! the same step in f32, from the same adapter values and inputs: the loss, every adapter gradient, and
//! the masters after one AdamW step. The inference forward's logits are compared too.
//! Run: `cargo test -p askgui-model --test bf16_step -- --nocapture` (prints the measured differences).
//!
//! The adapter is PEFT's init (the same seed in both dtypes) with `B` set to small values (|B| <= 0.02, the
//! scale a trained adapter reaches) so that `A` gets a gradient too. Not the PEFT fixture adapter of
//! `lora_grad.rs`: its `B A` is of order 1 against base weights of order 0.02 and amplifies any
//! perturbation (rounding only the base weights to bf16 moves its gradients by 10%), which would measure
//! that adapter's conditioning, not the bf16 path.
//!
//! Tolerances. Each bf16 rounding (weights once, then every activation an op writes) moves a value by up to
//! 2^-8 of itself, about half that on average, with independent signs. The tiny model has 4 vision blocks, the
//! merger and 2 decoder layers, each with ~13 rounded activations on the way forward and as many
//! gradients on the way back: ~150 roundings between the input and an adapter gradient. Added at random
//! they give ~sqrt(150) * 2^-9 = 2.4% of a tensor's scale; added in one direction, 150 * 2^-9 = 29%. So:
//! - loss: 2% relative (the loss averages 31 per-token losses, so their errors average out; the final bf16
//!   rounding of the loss alone is up to 2^-8 = 0.4%);
//! - each gradient, and the logits: 10% of the f32 tensor's largest magnitude: 4x the random-walk
//!   estimate, a third of the worst case. A wrong factor, sign or missing term is off by 30% to 100%+.
//! - masters after one AdamW step from the same values: the first step moves each element by
//!   `lr * g / (|g| + eps)`, i.e. `lr * sign(g)`, so the two runs agree where the sign of the gradient is
//!   certain (|g_f32| above the gradient tolerance): within 1e-3 lr (f32 rounding of the update);
//!   elsewhere a flipped sign costs at most 2 lr.

mod common;

use askgui_model::{LoraConfig, Qwen2Vl, StepOptions, StepOutput, TrainExample};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use common::*;

const LOSS_RTOL: f64 = 0.02;
/// Of each tensor's largest f32 magnitude.
const GRAD_TOL: f64 = 0.10;
const LOGITS_TOL: f64 = 0.10;
const LR: f64 = 1e-3;

const TARGETS: [&str; 7] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

/// The tiny model in `dtype` with a new trainable adapter (PEFT init, seed 7; `B` set to small fixed
/// values), active; its `Var`s by name.
fn model(dtype: DType) -> anyhow::Result<(Qwen2Vl, Vec<(String, Var)>)> {
    let mut m = Qwen2Vl::load(fixtures().join("tiny-qwen2_5_vl").to_str().unwrap(), &Device::Cpu, dtype)?;
    m.add_trainable_adapter("t", LoraConfig::new(4, 8.0, &TARGETS), 7)?;
    m.set_active_adapter(Some("t"))?;
    let vars = m.trainable_vars("t")?;
    for (i, (name, v)) in vars.iter().enumerate() {
        if name.ends_with("lora_B") {
            let b: Vec<f32> =
                (0..v.elem_count()).map(|j| 0.02 * ((j as f32 * 0.731 + i as f32) * 1.37).sin()).collect();
            v.set(&Tensor::from_vec(b, v.shape(), &Device::Cpu)?)?;
        }
    }
    Ok((m, vars))
}

/// The fixture's image prompt with its supervised tokens.
fn example() -> TrainExample {
    let (st, g) = (load_st("tiny-qwen2_5_vl/case.safetensors"), load_st("lora/grad/grads.safetensors"));
    TrainExample {
        ids: to_u32(get(&st, "input_ids")),
        labels_mask: to_u32(get(&g, "labels_mask")).iter().map(|&m| m != 0).collect(),
        pixel_values: Some(get(&st, "pixel_values").clone()),
        grid_thw: grids(get(&st, "image_grid_thw")),
        region_targets: vec![],
    }
}

/// One `loss_and_grads` (checkpointing on, as the trainer runs) and one AdamW step.
fn step(m: &Qwen2Vl, vars: &[(String, Var)], e: &TrainExample) -> anyhow::Result<StepOutput> {
    let out = m.loss_and_grads(std::slice::from_ref(e), &StepOptions::default())?;
    let params = ParamsAdamW { lr: LR, ..Default::default() };
    let mut opt = AdamW::new(vars.iter().map(|(_, v)| v.clone()).collect(), params)?;
    opt.step(&out.grads)?;
    Ok(out)
}

fn f64s(t: &Tensor) -> anyhow::Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
}

/// Max |a - b| over the elements of `b_grad` (the f32 gradient) whose sign is certain (|g| > `certain`),
/// and over the others.
fn master_diffs(a: &Tensor, b: &Tensor, b_grad: &Tensor, certain: f64) -> anyhow::Result<(f64, f64)> {
    let (a, b, g) = (f64s(a)?, f64s(b)?, f64s(b_grad)?);
    let (mut sure, mut unsure) = (0f64, 0f64);
    for ((x, y), g) in a.iter().zip(&b).zip(&g) {
        let d = (x - y).abs();
        if g.abs() > certain {
            sure = sure.max(d);
        } else {
            unsure = unsure.max(d);
        }
    }
    Ok((sure, unsure))
}

#[test]
fn a_bf16_lora_step_matches_the_f32_step() -> anyhow::Result<()> {
    let (m32, v32) = model(DType::F32)?;
    let (m16, v16) = model(DType::BF16)?;
    for ((n32, a), (n16, b)) in v32.iter().zip(&v16) {
        assert_eq!(n32, n16);
        assert_eq!(b.dtype(), DType::F32, "{n16}: the master of a bf16 model must be f32");
        let (max, _, _) = diff(b.as_tensor(), a.as_tensor());
        assert_eq!(max, 0.0, "{n16}: the two adapters must start from the same values");
    }
    let e = example();

    let (l32, l16) = (m32.forward_prompt(&e.ids, e.pixel_values.as_ref(), &e.grid_thw)?, {
        m16.forward_prompt(&e.ids, e.pixel_values.as_ref(), &e.grid_thw)?
    });
    assert_eq!(l16.dtype(), DType::BF16);
    let (max, _, scale) = diff(&l16, &l32);
    eprintln!("logits: max diff {max:.3e} of max |logit| {scale:.3e} ({:.2}%)", 100.0 * max / scale);
    assert!(max <= LOGITS_TOL * scale, "logits differ by {max} (scale {scale})");

    let before: Vec<Tensor> = v32.iter().map(|(_, v)| v.as_tensor().copy()).collect::<candle_core::Result<_>>()?;
    let (o32, o16) = (step(&m32, &v32, &e)?, step(&m16, &v16, &e)?);
    let rel = (o16.loss - o32.loss).abs() / o32.loss.abs();
    eprintln!("loss: bf16 {:.6} vs f32 {:.6}: relative diff {rel:.3e}", o16.loss, o32.loss);
    assert!(rel <= LOSS_RTOL, "loss {} vs {}", o16.loss, o32.loss);

    let (mut worst_g, mut worst_sure, mut worst_unsure) = ((0f64, String::new()), 0f64, 0f64);
    for (((name, a), (_, b)), start) in v32.iter().zip(&v16).zip(&before) {
        let g32 = o32.grads.get(a.as_tensor()).unwrap_or_else(|| panic!("{name}: no f32 gradient"));
        let g16 = o16.grads.get(b.as_tensor()).unwrap_or_else(|| panic!("{name}: no bf16 gradient"));
        let (max, _, scale) = diff(g16, g32);
        let (_, _, scale16) = diff(g16, g16);
        assert!(scale > 0.0 && scale16 > 0.0, "{name}: an all-zero gradient (f32 max {scale}, bf16 max {scale16})");
        assert!(max <= GRAD_TOL * scale, "{name}: gradient differs by {max} (scale {scale})");
        if max / scale > worst_g.0 {
            worst_g = (max / scale, name.clone());
        }
        let (sure, unsure) = master_diffs(b.as_tensor(), a.as_tensor(), g32, GRAD_TOL * scale)?;
        assert!(sure <= 1e-3 * LR, "{name}: masters differ by {sure} where the gradient sign is certain");
        assert!(unsure <= 2.0 * LR * (1.0 + 1e-3), "{name}: masters differ by {unsure}");
        let (moved, _, _) = diff(a.as_tensor(), start);
        assert!(moved > 0.5 * LR, "{name}: the AdamW step did not move the f32 master ({moved})");
        (worst_sure, worst_unsure) = (worst_sure.max(sure), worst_unsure.max(unsure));
    }
    eprintln!(
        "{} gradients: worst max diff / max magnitude {:.3e} ({}); masters after AdamW (lr {LR}): max diff \
         {worst_sure:.3e} where the gradient sign is certain, {worst_unsure:.3e} elsewhere",
        v32.len(),
        worst_g.0,
        worst_g.1
    );
    Ok(())
}
