//! `--kernels askgui` (the kernels' CustomOps) against `--kernels reference` (their plain-candle twins
//! through candle's autograd) on the tiny fixtures, both architectures: prompt logits and a decode step
//! with a KV cache, the loss and every gradient of a LoRA step (with dropout and checkpointing, as the
//! trainer runs) and of a full-training step. Also that the choice reaches the training path.
//!
//! Tolerances (f32 on the CPU): the loss within 1e-5 relative, logits and each gradient within 1e-5 of
//! their own largest magnitude (the reference side's). Both sides compute the same function in f32 from
//! the same weights; they differ only in summation order (the ops' blocked GEMMs and f64 row statistics
//! against candle's matmuls and f32 reductions) through a few layers forward and backward. Measured
//! (`--nocapture` prints it): logits 2e-7 to 6e-7, gradients up to 1.6e-6, the loss 1.2e-7 or equal. A
//! wrong mask, scale or missing term is off by 1e-2 or more. bf16 on the CPU is checked against f32.

mod common;

use askgui_model::model::positions_tensor;
use askgui_model::{
    mrope_positions, DTypeChoice, DeviceKind, KernelChoice, LoadOptions, LoraConfig, Qwen2Vl, StepOptions, TrainExample,
};
use candle_core::{DType, Device, Tensor, Var};
use common::*;

const REL_LOSS: f64 = 1e-5;
const REL_TENSOR: f64 = 1e-5;
const GRAD_FLOOR: f64 = 1e-3;
const FIXTURES: [&str; 2] = ["tiny-qwen2_5_vl", "tiny-qwen2_vl"];

/// One fixture's prompt: token ids, pixel values, image grid.
struct Prompt {
    ids: Vec<u32>,
    pv: Tensor,
    grid: Vec<[usize; 3]>,
}

fn load(dir: &str, kernels: KernelChoice) -> anyhow::Result<(Qwen2Vl, Prompt)> {
    let st = load_st(&format!("{dir}/case.safetensors"));
    let path = fixtures().join(dir);
    let model = Qwen2Vl::load_with(path.to_str().unwrap(), &Device::Cpu, DType::F32, kernels)?;
    assert_eq!(model.kernels(), kernels);
    let prompt = Prompt {
        ids: to_u32(get(&st, "input_ids")),
        pv: get(&st, "pixel_values").clone(),
        grid: grids(get(&st, "image_grid_thw")),
    };
    Ok((model, prompt))
}

/// `max |a - b| / max(max |b|, floor)`, failing above `tol`.
fn check(what: &str, a: &Tensor, b: &Tensor, tol: f64, floor: f64) -> f64 {
    let (max, _, scale) = diff(a, b);
    let rel = max / scale.max(floor).max(f64::MIN_POSITIVE);
    assert!(scale > 0.0 && rel <= tol, "{what}: askgui vs reference differ by {max:e} (scale {scale:e})");
    rel
}

/// Whether two tensors differ in at least one bit: the two paths are different code, so identical bits
/// everywhere would mean that the choice did not take effect.
fn bits_differ(a: &Tensor, b: &Tensor) -> bool {
    let bits = |t: &Tensor| -> Vec<u32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
    };
    bits(a) != bits(b)
}

/// Logits of the whole prompt, and of its last token decoded alone over the cache of the others.
fn logits(model: &Qwen2Vl, p: &Prompt) -> anyhow::Result<(Tensor, Tensor)> {
    let full = model.forward_prompt(&p.ids, Some(&p.pv), &p.grid)?;
    let t = p.ids.len();
    let feats = model.image_features(&p.pv, &p.grid)?;
    let ids = Tensor::from_slice(&p.ids, (1, t), &Device::Cpu)?;
    let embeds = model.embed(&ids, Some(&feats))?;
    let (pos, _) = mrope_positions(&p.ids, &p.grid, &model.cfg)?;
    let positions = positions_tensor(&[pos], t)?;
    let mut cache = model.new_cache();
    model.decode(&embeds.narrow(1, 0, t - 1)?, &positions.narrow(2, 0, t - 1)?, None, &mut cache)?;
    let last = model.decode(&embeds.narrow(1, t - 1, 1)?, &positions.narrow(2, t - 1, 1)?, None, &mut cache)?;
    Ok((full, model.logits(&last)?.squeeze(0)?))
}

#[test]
fn inference_logits_agree() -> anyhow::Result<()> {
    for dir in FIXTURES {
        let (mut model, p) = load(dir, KernelChoice::Askgui)?;
        let (full, step) = logits(&model, &p)?;
        model.set_kernels(KernelChoice::Reference);
        let (full_ref, step_ref) = logits(&model, &p)?;
        assert!(bits_differ(&full, &full_ref), "{dir}: the reference kernels gave the very same logits");
        let a = check(&format!("{dir} prompt logits"), &full, &full_ref, REL_TENSOR, 0.0);
        let b = check(&format!("{dir} decode-step logits"), &step, &step_ref, REL_TENSOR, 0.0);
        eprintln!("{dir}: logits askgui vs reference, max diff / max magnitude: prompt {a:.2e}, decode step {b:.2e}");
    }
    Ok(())
}

fn example(p: &Prompt) -> TrainExample {
    // The second half of the tokens supervised (the fixture's prompt ends in text).
    let n = p.ids.len();
    TrainExample {
        ids: p.ids.clone(),
        labels_mask: (0..n).map(|i| i >= n / 2).collect(),
        pixel_values: Some(p.pv.clone()),
        grid_thw: p.grid.clone(),
        region_targets: vec![],
    }
}

/// A LoRA adapter on the text and vision linears of both architectures, with B non-zero so that A gets
/// a gradient too, and dropout on.
fn add_adapter(model: &mut Qwen2Vl) -> anyhow::Result<Vec<(String, Var)>> {
    let targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv", "fc1", "proj"];
    let mut cfg = LoraConfig::new(4, 8.0, &targets);
    cfg.lora_dropout = 0.1;
    model.add_trainable_adapter("t", cfg, 3)?;
    let vars = model.trainable_vars("t")?;
    for (i, (name, v)) in vars.iter().enumerate() {
        if name.ends_with("lora_B") {
            v.set(&(v.ones_like()? * (0.05 + 0.01 * (i % 7) as f64))?)?;
        }
    }
    model.set_active_adapter(Some("t"))?;
    Ok(vars)
}

/// Runs one step with each kernel choice on the same model and compares loss and the gradients of `vars`.
fn compare_step(what: &str, model: &mut Qwen2Vl, batch: &[TrainExample], vars: &[(String, Var)]) -> anyhow::Result<()> {
    let opts = StepOptions { dropout_seed: 11, ..Default::default() };
    model.set_kernels(KernelChoice::Askgui);
    let ours = model.loss_and_grads(batch, &opts)?;
    model.set_kernels(KernelChoice::Reference);
    let reference = model.loss_and_grads(batch, &opts)?;
    let rel = (ours.loss - reference.loss).abs() / reference.loss.abs();
    assert!(rel <= REL_LOSS, "{what}: loss {} (askgui) vs {} (reference)", ours.loss, reference.loss);
    let pairs: Vec<(&String, &Tensor, &Tensor)> = vars
        .iter()
        .map(|(name, v)| {
            let g = ours.grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{what} {name}: no askgui gradient"));
            let r =
                reference.grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{what} {name}: no reference gradient"));
            (name, g, r)
        })
        .collect();
    assert!(
        pairs.iter().any(|(_, g, r)| bits_differ(g, r)),
        "{what}: the reference kernels gave the very same gradients"
    );
    // A gradient that nearly cancels (1e-10 next to 1e-2 elsewhere) carries the rounding of its terms,
    // which are of the step's scale: measure it against at least GRAD_FLOOR of the largest gradient.
    let largest = pairs.iter().map(|(_, _, r)| diff(r, r).2).fold(0f64, f64::max);
    let mut worst = (0f64, String::new());
    for (name, g, g_ref) in pairs {
        let r = check(&format!("{what} {name}"), g, g_ref, REL_TENSOR, GRAD_FLOOR * largest);
        if r > worst.0 {
            worst = (r, name.clone());
        }
    }
    eprintln!(
        "{what}: loss {:.7} vs {:.7} (relative diff {rel:.2e}); {} gradients, worst max diff / max magnitude {:.2e} ({})",
        ours.loss,
        reference.loss,
        vars.len(),
        worst.0,
        worst.1
    );
    Ok(())
}

#[test]
fn lora_step_agrees() -> anyhow::Result<()> {
    for dir in FIXTURES {
        let (mut model, p) = load(dir, KernelChoice::Askgui)?;
        let vars = add_adapter(&mut model)?;
        assert!(vars.iter().any(|(n, _)| n.starts_with("visual.")), "{dir}: no vision target");
        compare_step(&format!("{dir} LoRA step"), &mut model, &[example(&p)], &vars)?;
    }
    Ok(())
}

#[test]
fn full_step_agrees() -> anyhow::Result<()> {
    for dir in FIXTURES {
        let (mut model, p) = load(dir, KernelChoice::Askgui)?;
        model.make_base_trainable()?;
        let vars = model.base_vars()?;
        compare_step(&format!("{dir} full step"), &mut model, &[example(&p)], &vars)?;
    }
    Ok(())
}

/// `--dtype bf16` on the CPU: the model loads in bf16, and with either kernel choice a prompt's logits
/// and a LoRA step's loss stay within bf16 rounding of the f32 run (bf16 keeps 8 bits: 2^-8 relative per
/// rounding; the references round after every candle op, a dozen roundings deep: 5e-2 of the largest
/// logit, measured 2.7e-2; 2e-2 on the loss, measured 5e-3), and every gradient is finite.
#[test]
fn cpu_bf16_runs_with_both_kernels() -> anyhow::Result<()> {
    let dir = FIXTURES[0];
    let (mut f32_model, p) = load(dir, KernelChoice::Askgui)?;
    let (want_logits, _) = logits(&f32_model, &p)?;
    add_adapter(&mut f32_model)?;
    let want_loss = f32_model.loss_and_grads(&[example(&p)], &StepOptions::default())?.loss;
    for kernels in [KernelChoice::Askgui, KernelChoice::Reference] {
        let opts = LoadOptions { device: DeviceKind::Cpu, dtype: DTypeChoice::Bf16, kernels };
        let (dev, dtype) = opts.resolve()?;
        let mut model = Qwen2Vl::load_with(fixtures().join(dir).to_str().unwrap(), &dev, dtype, kernels)?;
        assert_eq!(model.dtype(), DType::BF16);
        let (got, _) = logits(&model, &p)?;
        let rel =
            check(&format!("{kernels:?} bf16 logits vs f32"), &got.to_dtype(DType::F32)?, &want_logits, 5e-2, 0.0);
        let vars = add_adapter(&mut model)?;
        let out = model.loss_and_grads(&[example(&p)], &StepOptions::default())?;
        let loss_rel = (out.loss - want_loss).abs() / want_loss;
        eprintln!("{kernels:?} bf16: logits max diff / max magnitude {rel:.2e}; loss {} vs f32 {want_loss:.5} ({loss_rel:.2e})", out.loss);
        assert!(loss_rel <= 2e-2, "{kernels:?} bf16 loss {} vs f32 {want_loss}", out.loss);
        for (name, v) in &vars {
            let g = out.grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{kernels:?} bf16 {name}: no gradient"));
            let g = g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            assert!(g.iter().all(|x| x.is_finite()), "{kernels:?} bf16 {name}: non-finite gradient");
        }
    }
    Ok(())
}
