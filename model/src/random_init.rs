//! Random initialisation: a checkpoint with random weights for a config, for training from scratch.
//!
//! [`random_weights`] lists every tensor the loader reads for a config (hub names and shapes, the same
//! layout `Qwen2_5_VLForConditionalGeneration.save_pretrained` writes) and fills it as transformers'
//! `_init_weights` does: linear, patch-embedding and embedding weights ~ N(0, 0.02) (`initializer_range`),
//! biases 0, norm weights 1 (LayerNorm biases 0), deterministic in the seed. [`write_checkpoint`] writes
//! such tensors as `model.safetensors`, so that [`crate::Qwen2Vl::load`] reads the folder back (with a
//! config.json beside it); after full training [`crate::Qwen2Vl::save_base`] writes a model's base weights
//! the same way. `askgui-train --init-config` builds its random model with these two.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::config::{MlpKind, ModelConfig, NormKind};
use crate::error::{ModelError, Result};

/// transformers' default `initializer_range`.
pub const INIT_STD: f64 = 0.02;

/// What a tensor is filled with.
#[derive(Clone, Copy)]
enum Fill {
    Normal,
    Zeros,
    Ones,
}

/// Every tensor of a checkpoint for `cfg`, hub names, in load order: `(name, shape, fill)`.
fn layout(cfg: &ModelConfig) -> Vec<(String, Vec<usize>, Fill)> {
    let mut out = Vec::new();
    let linear = |out: &mut Vec<_>, name: &str, inp: usize, outp: usize, bias: bool| {
        out.push((format!("{name}.weight"), vec![outp, inp], Fill::Normal));
        if bias {
            out.push((format!("{name}.bias"), vec![outp], Fill::Zeros));
        }
    };
    let norm = |out: &mut Vec<(String, Vec<usize>, Fill)>, name: &str, dim: usize| {
        out.push((format!("{name}.weight"), vec![dim], Fill::Ones));
        if cfg.arch.vision_norm() == NormKind::Layer {
            out.push((format!("{name}.bias"), vec![dim], Fill::Zeros));
        }
    };
    let v = &cfg.vision;
    let (h, i) = (v.hidden_size, v.intermediate_size);
    out.push((
        "visual.patch_embed.proj.weight".to_string(),
        vec![h, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size],
        Fill::Normal,
    ));
    if cfg.arch.patch_bias() {
        out.push(("visual.patch_embed.proj.bias".to_string(), vec![h], Fill::Zeros));
    }
    if let Some(n) = v.num_position_embeddings {
        out.push(("visual.pos_embed.weight".to_string(), vec![n, h], Fill::Normal));
    }
    for b in 0..v.depth {
        let n = format!("visual.blocks.{b}");
        norm(&mut out, &format!("{n}.norm1"), h);
        norm(&mut out, &format!("{n}.norm2"), h);
        linear(&mut out, &format!("{n}.attn.qkv"), h, 3 * h, true);
        linear(&mut out, &format!("{n}.attn.proj"), h, h, true);
        match cfg.arch.vision_mlp() {
            MlpKind::Glu => {
                linear(&mut out, &format!("{n}.mlp.gate_proj"), h, i, true);
                linear(&mut out, &format!("{n}.mlp.up_proj"), h, i, true);
                linear(&mut out, &format!("{n}.mlp.down_proj"), i, h, true);
            }
            MlpKind::Plain { fc1, fc2 } => {
                linear(&mut out, &format!("{n}.mlp.{fc1}"), h, i, true);
                linear(&mut out, &format!("{n}.mlp.{fc2}"), i, h, true);
            }
        }
    }
    let merged = h * v.spatial_merge_size * v.spatial_merge_size;
    let [mn, m1, m2] = cfg.arch.merger_names();
    let mergers = std::iter::once(("visual.merger".to_string(), h))
        .chain((0..cfg.deepstack()).map(|j| (format!("visual.deepstack_merger_list.{j}"), merged)));
    for (prefix, norm_dim) in mergers {
        norm(&mut out, &format!("{prefix}.{mn}"), norm_dim);
        linear(&mut out, &format!("{prefix}.{m1}"), merged, merged, true);
        linear(&mut out, &format!("{prefix}.{m2}"), merged, v.out_hidden_size, true);
    }

    let t = &cfg.text;
    let (h, i, hd) = (t.hidden_size, t.intermediate_size, t.head_dim());
    let (nq, nkv) = (t.num_attention_heads * hd, t.num_key_value_heads * hd);
    out.push(("model.embed_tokens.weight".to_string(), vec![t.vocab_size, h], Fill::Normal));
    for l in 0..t.num_hidden_layers {
        let n = format!("model.layers.{l}");
        norm_text(&mut out, &format!("{n}.input_layernorm"), h);
        norm_text(&mut out, &format!("{n}.post_attention_layernorm"), h);
        linear(&mut out, &format!("{n}.self_attn.q_proj"), h, nq, t.qkv_bias);
        linear(&mut out, &format!("{n}.self_attn.k_proj"), h, nkv, t.qkv_bias);
        linear(&mut out, &format!("{n}.self_attn.v_proj"), h, nkv, t.qkv_bias);
        if t.qk_norm {
            norm_text(&mut out, &format!("{n}.self_attn.q_norm"), hd);
            norm_text(&mut out, &format!("{n}.self_attn.k_norm"), hd);
        }
        linear(&mut out, &format!("{n}.self_attn.o_proj"), nq, h, false);
        linear(&mut out, &format!("{n}.mlp.gate_proj"), h, i, false);
        linear(&mut out, &format!("{n}.mlp.up_proj"), h, i, false);
        linear(&mut out, &format!("{n}.mlp.down_proj"), i, h, false);
    }
    norm_text(&mut out, "model.norm", h);
    if !cfg.tie_word_embeddings {
        linear(&mut out, "lm_head", h, t.vocab_size, false);
    }
    out
}

/// The linear layers a LoRA adapter can target in a `cfg` model, hub names -> `(out, in)`: what
/// [`crate::Qwen2Vl::linears`] holds, from the config alone (no weight is read). The token embedding
/// and `lm_head` are not among them, as in the model.
pub fn linear_shapes(cfg: &ModelConfig) -> BTreeMap<String, (usize, usize)> {
    layout(cfg)
        .into_iter()
        .filter_map(|(name, shape, _)| {
            let module = name.strip_suffix(".weight")?;
            match shape.as_slice() {
                [out, inp] if module != "model.embed_tokens" && module != "lm_head" => {
                    Some((module.to_string(), (*out, *inp)))
                }
                _ => None,
            }
        })
        .collect()
}

/// The decoder's RMSNorms have no bias in either architecture.
fn norm_text(out: &mut Vec<(String, Vec<usize>, Fill)>, name: &str, dim: usize) {
    out.push((format!("{name}.weight"), vec![dim], Fill::Ones));
}

/// A random initialisation of every tensor of a `cfg` checkpoint (f32, CPU), deterministic in `seed`.
pub fn random_weights(cfg: &ModelConfig, seed: u64) -> Result<Vec<(String, Tensor)>> {
    let mut rng = StdRng::seed_from_u64(seed);
    // Box-Muller: two uniforms give one standard normal (the second one is dropped for simplicity).
    let mut normal = move || {
        let (u1, u2): (f64, f64) = (1.0 - rng.random::<f64>(), rng.random::<f64>());
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos() * INIT_STD) as f32
    };
    let dev = Device::Cpu;
    layout(cfg)
        .into_iter()
        .map(|(name, shape, fill)| (cfg.arch.checkpoint_key(&name), shape, fill))
        .map(|(name, shape, fill)| {
            let t = match fill {
                Fill::Zeros => Tensor::zeros(shape, DType::F32, &dev)?,
                Fill::Ones => Tensor::ones(shape, DType::F32, &dev)?,
                Fill::Normal => {
                    let n: usize = shape.iter().product();
                    Tensor::from_vec((0..n).map(|_| normal()).collect::<Vec<f32>>(), shape, &dev)?
                }
            };
            Ok((name, t))
        })
        .collect()
}

/// Writes `tensors` as `dir/model.safetensors` (f32, CPU copies).
pub fn write_checkpoint(tensors: &[(String, Tensor)], dir: &Path) -> Result<()> {
    let map = tensors
        .iter()
        .map(|(n, t)| Ok((n.clone(), t.detach().to_dtype(DType::F32)?.to_device(&Device::Cpu)?)))
        .collect::<Result<HashMap<String, Tensor>>>()?;
    let path = dir.join("model.safetensors");
    candle_core::safetensors::save(&map, &path)
        .map_err(|e| ModelError::Checkpoint { dir: dir.to_path_buf(), reason: format!("cannot write: {e}") })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> ModelConfig {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-qwen2_5_vl/config.json");
        ModelConfig::from_file(&p).unwrap()
    }

    /// The fills follow transformers: N(0, 0.02) weights, zero biases, unit norms; and the seed decides.
    #[test]
    fn fills_and_seed() {
        let cfg = tiny();
        let w = random_weights(&cfg, 7).unwrap();
        let get = |n: &str| w.iter().find(|(k, _)| k == n).unwrap().1.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let q = get("model.layers.0.self_attn.q_proj.weight");
        let mean = q.iter().sum::<f32>() / q.len() as f32;
        let std = (q.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / q.len() as f32).sqrt();
        assert!(mean.abs() < 0.003 && (std - 0.02).abs() < 0.002, "mean {mean} std {std}");
        assert!(get("model.layers.0.self_attn.q_proj.bias").iter().all(|&x| x == 0.0));
        assert!(get("model.norm.weight").iter().all(|&x| x == 1.0));
        let again = random_weights(&cfg, 7).unwrap();
        let other = random_weights(&cfg, 8).unwrap();
        let e = |w: &[(String, Tensor)]| w[0].1.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(e(&w), e(&again));
        assert_ne!(e(&w), e(&other));
    }
}
