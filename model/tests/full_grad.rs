//! Full training (`make_base_trainable`): every base weight gets a gradient, the gradients equal central
//! finite differences of the loss, and checkpointing gives the one-graph gradients.
//!
//! In f64 on the tiny fixture with an image. The vision tower rotates q and k in f32 whatever the model
//! dtype (as transformers does), which leaves ~1e-10 of rounding noise in the loss: with a step of 1e-5
//! that was 1% of a vision-block gradient (~5e-4), so the step is 1e-3 (noise ~5e-8 on the derivative;
//! truncation ~1e-6 * |f'''|). Tolerance 1e-7 absolute + 1e-3 relative; a missing term (a frozen path, a
//! dropped bias or norm gradient) is off by the whole gradient.

mod common;

use askgui_model::{Qwen2Vl, StepOptions, TrainExample};
use candle_core::{DType, Device, IndexOp, Tensor};
use common::*;

fn model_and_example() -> anyhow::Result<(Qwen2Vl, TrainExample)> {
    let st = load_st("tiny-qwen2_5_vl/case.safetensors");
    let mut model = Qwen2Vl::load(fixtures().join("tiny-qwen2_5_vl").to_str().unwrap(), &Device::Cpu, DType::F64)?;
    model.make_base_trainable()?;
    let ids = to_u32(get(&st, "input_ids"));
    // Supervise the last third of the sequence (text after the image).
    let n = ids.len();
    let labels_mask = (0..n).map(|i| i >= 2 * n / 3).collect();
    let ex = TrainExample {
        ids,
        labels_mask,
        pixel_values: Some(get(&st, "pixel_values").to_dtype(DType::F64)?),
        grid_thw: grids(get(&st, "image_grid_thw")),
        region_targets: vec![],
    };
    Ok((model, ex))
}

#[test]
fn full_gradients_match_finite_differences() -> anyhow::Result<()> {
    let (model, ex) = model_and_example()?;
    let batch = [ex];
    let out = model.loss_and_grads(&batch, &StepOptions { checkpointing: true, ..Default::default() })?;
    let vars = model.base_vars()?;
    assert!(vars.len() > 50, "only {} base vars", vars.len());
    for (name, v) in &vars {
        let g = out.grads.get(v.as_tensor()).unwrap_or_else(|| panic!("`{name}` has no gradient"));
        assert_eq!(g.dims(), v.dims(), "{name}");
        let m = g.abs()?.max_all()?.to_scalar::<f64>()?;
        assert!(m > 0.0, "`{name}`'s gradient is zero");
    }
    assert_eq!(out.grads.get_ids().count(), vars.len(), "only the base weights' gradients are kept");

    // One entry of one tensor of every kind: patch embedding, vision norm, attention and MLP linears and
    // biases, merger, embedding (a token of the prompt), decoder norms, lm_head.
    let probes = [
        ("visual.patch_embed.proj.weight", vec![1, 5]),
        ("visual.blocks.0.norm1.weight", vec![3]),
        ("visual.blocks.1.attn.qkv.bias", vec![7]),
        ("visual.blocks.0.mlp.down_proj.weight", vec![2, 9]),
        ("visual.merger.ln_q.weight", vec![4]),
        ("visual.merger.mlp.0.weight", vec![10, 20]),
        ("visual.merger.mlp.2.bias", vec![11]),
        ("model.embed_tokens.weight", vec![batch[0].ids[batch[0].ids.len() - 3] as usize, 6]),
        ("model.layers.0.input_layernorm.weight", vec![5]),
        ("model.layers.1.self_attn.k_proj.bias", vec![3]),
        ("model.layers.1.self_attn.o_proj.weight", vec![8, 2]),
        ("model.layers.0.mlp.gate_proj.weight", vec![17, 30]),
        ("model.norm.weight", vec![12]),
        ("lm_head.weight", vec![batch[0].ids[batch[0].ids.len() - 1] as usize, 13]),
    ];
    let eps = 1e-3;
    let mut failures = Vec::new();
    for (name, idx) in probes {
        let v = &vars.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no var `{name}`")).1;
        let g = out.grads.get(v.as_tensor()).unwrap();
        let analytic = match idx.as_slice() {
            [i] => g.i(*i)?.to_scalar::<f64>()?,
            [i, j] => g.i((*i, *j))?.to_scalar::<f64>()?,
            _ => unreachable!(),
        };
        let orig = v.as_tensor().copy()?;
        // The row-major offset of the probed entry.
        let flat = if idx.len() == 2 { idx[0] * v.dim(1)? + idx[1] } else { idx[0] };
        let loss_at = |delta: f64| -> anyhow::Result<f64> {
            let mut w = orig.flatten_all()?.to_vec1::<f64>()?;
            w[flat] += delta;
            v.set(&Tensor::from_vec(w, v.dims(), &Device::Cpu)?)?;
            Ok(model.eval_loss(&batch)?.0)
        };
        let numeric = (loss_at(eps)? - loss_at(-eps)?) / (2.0 * eps);
        v.set(&orig)?;
        let tol = 1e-7 + 1e-3 * numeric.abs();
        if (analytic - numeric).abs() > tol {
            failures.push(format!("{name}{idx:?}: analytic {analytic:e}, finite difference {numeric:e}"));
        }
    }
    assert!(failures.is_empty(), "gradients differ from finite differences:\n{}", failures.join("\n"));
    Ok(())
}

#[test]
fn full_checkpointing_gives_the_one_graph_gradients() -> anyhow::Result<()> {
    let (model, ex) = model_and_example()?;
    let batch = [ex];
    let a = model.loss_and_grads(&batch, &StepOptions { checkpointing: true, ..Default::default() })?;
    let b = model.loss_and_grads(&batch, &StepOptions { checkpointing: false, ..Default::default() })?;
    assert!((a.loss - b.loss).abs() < 1e-12);
    for (name, v) in model.base_vars()? {
        let (ga, gb) = (a.grads.get(v.as_tensor()).unwrap(), b.grads.get(v.as_tensor()).unwrap());
        let d = (ga - gb)?.abs()?.max_all()?.to_scalar::<f64>()?;
        assert!(d < 1e-10, "`{name}`: checkpointed and one-graph gradients differ by {d}");
    }
    Ok(())
}

/// The region loss ([`TrainExample::region_targets`]): off at weight 0, linear in its weight, read from
/// the chosen decoder layer (at the last layer it is the inference logits' cross-entropy at those
/// positions), with gradients that match finite differences and do not depend on checkpointing.
#[test]
fn region_loss_is_a_weighted_side_loss_with_exact_gradients() -> anyhow::Result<()> {
    let (model, mut ex) = model_and_example()?;
    let plain = model.loss_and_grads(&[ex.clone()], &StepOptions::default())?.loss;
    let pads: Vec<usize> = (0..ex.ids.len()).filter(|&i| ex.ids[i] == model.cfg.image_token_id).collect();
    assert!(pads.len() >= 4, "the fixture's image has {} tokens", pads.len());
    ex.region_targets = pads.iter().enumerate().map(|(k, &p)| (p, 17 + 3 * k as u32)).collect();
    let batch = [ex.clone()];
    let depth = model.cfg.text.num_hidden_layers;
    let opts = |w: f64, layer: usize, checkpointing: bool| StepOptions {
        checkpointing,
        dropout_seed: 0,
        region_weight: w,
        region_layer: layer,
        ..Default::default()
    };
    assert_eq!(model.loss_and_grads(&batch, &opts(0.0, 1, true))?.loss, plain, "weight 0 leaves it out");

    // At the last layer the region loss is the inference logits' cross-entropy at the targets.
    let logits = model.forward_prompt(&ex.ids, ex.pixel_values.as_ref(), &ex.grid_thw)?;
    let logp = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F64)?, 1)?;
    let mut want = 0.0;
    for &(p, tok) in &ex.region_targets {
        want -= logp.i((p, tok as usize))?.to_scalar::<f64>()?;
    }
    want /= ex.region_targets.len() as f64;
    let at_last = model.loss_and_grads(&batch, &opts(1.0, depth, true))?.loss - plain;
    assert!((at_last - want).abs() < 1e-8, "region loss at the last layer {at_last}, inference logits {want}");

    // Linear in the weight, and another value at layer 1.
    let r1 = model.loss_and_grads(&batch, &opts(1.0, 1, true))?.loss - plain;
    let r_half = model.loss_and_grads(&batch, &opts(0.5, 1, true))?.loss - plain;
    assert!((r_half - 0.5 * r1).abs() < 1e-10 && (r1 - at_last).abs() > 1e-6, "{r1} {r_half} {at_last}");

    // Gradients: checkpointing agrees, and finite differences of the loss with the region term.
    let a = model.loss_and_grads(&batch, &opts(0.5, 1, true))?;
    let b = model.loss_and_grads(&batch, &opts(0.5, 1, false))?;
    assert!((a.loss - b.loss).abs() < 1e-12);
    let vars = model.base_vars()?;
    for (name, v) in &vars {
        let d = (a.grads.get(v.as_tensor()).unwrap() - b.grads.get(v.as_tensor()).unwrap())?;
        let d = d.abs()?.max_all()?.to_scalar::<f64>()?;
        assert!(d < 1e-10, "`{name}`: checkpointed and one-graph gradients differ by {d}");
    }
    // Layer 0's MLP feeds the region head at layer 1; the final norm and the head are shared with it.
    let probes = [("model.layers.0.mlp.gate_proj.weight", [17, 30]), ("model.norm.weight", [0, 12])];
    let eps = 1e-3;
    for (name, [i, j]) in probes {
        let v = &vars.iter().find(|(n, _)| n == name).unwrap().1;
        let (analytic, flat) = match v.rank() {
            1 => (a.grads.get(v.as_tensor()).unwrap().i(j)?.to_scalar::<f64>()?, j),
            _ => (a.grads.get(v.as_tensor()).unwrap().i((i, j))?.to_scalar::<f64>()?, i * v.dim(1)? + j),
        };
        let orig = v.as_tensor().copy()?;
        let loss_at = |delta: f64| -> anyhow::Result<f64> {
            let mut w = orig.flatten_all()?.to_vec1::<f64>()?;
            w[flat] += delta;
            v.set(&Tensor::from_vec(w, v.dims(), &Device::Cpu)?)?;
            Ok(model.loss_and_grads(&batch, &opts(0.5, 1, true))?.loss)
        };
        let numeric = (loss_at(eps)? - loss_at(-eps)?) / (2.0 * eps);
        v.set(&orig)?;
        assert!(
            (analytic - numeric).abs() <= 1e-7 + 1e-3 * numeric.abs(),
            "{name}[{i}, {j}]: analytic {analytic:e}, finite difference {numeric:e}"
        );
    }
    Ok(())
}
