//! Batched generation with a KV cache: several prompts of different lengths, each with its own images,
//! decoded together. Prompts are left-padded to a common length (padded keys masked out); every sequence
//! stops on its own stop tokens or at `max_new_tokens`. Greedy when `temperature == 0`, else temperature /
//! top-k / top-p sampling from a seeded generator, so a run is reproducible.

use std::time::Instant;

use candle_core::{DType, IndexOp, Tensor};
use rand::{Rng, SeedableRng};

use crate::error::{ModelError, Result};
use crate::image::ProcessedImage;
use crate::model::{mrope_positions, positions_tensor, Qwen2Vl};

/// One prompt: token ids with image pads already expanded, and its images in order.
#[derive(Debug, Clone)]
pub struct Prompt {
    pub ids: Vec<u32>,
    pub images: Vec<ProcessedImage>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub max_new_tokens: usize,
    /// 0 means greedy.
    pub temperature: f64,
    /// Nucleus mass kept (1.0: off).
    pub top_p: f64,
    /// Candidates kept (0: off).
    pub top_k: usize,
    pub seed: u64,
    /// A sequence ends when it emits one of these (the stop token is kept in its output).
    pub stop_tokens: Vec<u32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self { max_new_tokens: 64, temperature: 0.0, top_p: 1.0, top_k: 0, seed: 0, stop_tokens: vec![] }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    /// `(T, V)` f32 logits at every prompt position, when asked for.
    pub prompt_logits: Option<Tensor>,
}

/// Wall-clock seconds spent in each phase of a [`generate`] call.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timings {
    pub vision_s: f64,
    pub prefill_s: f64,
    pub decode_s: f64,
    pub decode_steps: usize,
}

/// Picks the next token from one row of logits.
pub fn sample(logits: &[f32], p: &SamplingParams, rng: &mut impl Rng) -> u32 {
    let argmax = || {
        let mut best = 0;
        for (i, &x) in logits.iter().enumerate() {
            if x > logits[best] {
                best = i;
            }
        }
        best as u32
    };
    if p.temperature <= 0.0 {
        return argmax();
    }
    let mut cand: Vec<(usize, f64)> = logits.iter().enumerate().map(|(i, &x)| (i, x as f64 / p.temperature)).collect();
    cand.sort_by(|a, b| b.1.total_cmp(&a.1));
    if p.top_k > 0 {
        cand.truncate(p.top_k);
    }
    let max = cand[0].1;
    let mut probs: Vec<f64> = cand.iter().map(|c| (c.1 - max).exp()).collect();
    let z: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|x| *x /= z);
    if p.top_p < 1.0 {
        let mut cum = 0.0;
        let keep = probs.iter().position(|&x| {
            cum += x;
            cum >= p.top_p
        });
        let keep = keep.map(|i| i + 1).unwrap_or(probs.len());
        probs.truncate(keep);
        let z: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= z);
    }
    let mut r: f64 = rng.random();
    for (i, &pr) in probs.iter().enumerate() {
        r -= pr;
        if r <= 0.0 {
            return cand[i].0 as u32;
        }
    }
    cand[probs.len() - 1].0 as u32
}

/// Generates for every prompt at once. Returns one [`Generation`] per prompt, in order.
pub fn generate(
    model: &Qwen2Vl,
    prompts: &[Prompt],
    params: &SamplingParams,
    return_prompt_logits: bool,
) -> Result<(Vec<Generation>, Timings)> {
    if prompts.is_empty() || prompts.iter().any(|p| p.ids.is_empty()) {
        return Err(ModelError::Generation("every prompt needs at least one token".into()));
    }
    let vocab = model.cfg.text.vocab_size;
    if let Some(bad) = prompts.iter().flat_map(|p| &p.ids).find(|&&t| t as usize >= vocab) {
        return Err(ModelError::Generation(format!("token id {bad} is outside the vocabulary of {vocab}")));
    }
    let dev = &model.device;
    let mut timings = Timings::default();

    // Vision: all images of all prompts in one block-diagonal pass.
    let t0 = Instant::now();
    let images: Vec<&ProcessedImage> = prompts.iter().flat_map(|p| &p.images).collect();
    let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid_thw).collect();
    let feats = if images.is_empty() { None } else { Some(model.images_features(&images)?) };
    timings.vision_s = t0.elapsed().as_secs_f64();

    // Left-pad to a common length; the pad id only has to differ from the image token.
    let t0 = Instant::now();
    let b = prompts.len();
    let t = prompts.iter().map(|p| p.ids.len()).max().unwrap_or(0);
    let pad_id = if model.cfg.image_token_id == 0 { 1 } else { 0 };
    let mut ids = Vec::with_capacity(b * t);
    let mut mask = Vec::with_capacity(b * t);
    let mut seq_pos = Vec::with_capacity(b);
    let mut next_pos = Vec::with_capacity(b);
    let mut img = 0;
    for p in prompts {
        let pad = t - p.ids.len();
        ids.extend(std::iter::repeat_n(pad_id, pad).chain(p.ids.iter().copied()));
        mask.extend(std::iter::repeat_n(0f32, pad).chain(std::iter::repeat_n(1f32, p.ids.len())));
        let (pos, next) = mrope_positions(&p.ids, &grids[img..img + p.images.len()], &model.cfg)?;
        img += p.images.len();
        seq_pos.push(pos);
        next_pos.push(next);
    }
    let padded = mask.contains(&0.0);
    let mut key_padding = Tensor::from_vec(mask, (b, t), dev)?;
    let ids_t = Tensor::from_vec(ids, (b, t), dev)?;
    let embeds = model.embed(&ids_t, feats.as_ref())?;
    let mut cache = model.new_cache();
    let hidden = model.decode(&embeds, &positions_tensor(&seq_pos, t)?, padded.then_some(&key_padding), &mut cache)?;
    let (mut last, prompt_logits) = if return_prompt_logits {
        let all = model.logits(&hidden)?.to_dtype(DType::F32)?;
        (all.i((.., t - 1))?, Some(all))
    } else {
        (model.logits(&hidden.i((.., t - 1..t))?)?.squeeze(1)?.to_dtype(DType::F32)?, None)
    };
    timings.prefill_s = t0.elapsed().as_secs_f64();

    let t0 = Instant::now();
    let mut rng = rand::rngs::StdRng::seed_from_u64(params.seed);
    let mut out: Vec<Vec<u32>> = vec![vec![]; b];
    let mut finish: Vec<Option<FinishReason>> = vec![None; b];
    for step in 0..params.max_new_tokens {
        let rows: Vec<Vec<f32>> = last.to_vec2()?;
        let mut next = Vec::with_capacity(b);
        for (i, row) in rows.iter().enumerate() {
            if finish[i].is_some() {
                next.push(pad_id);
                continue;
            }
            let tok = sample(row, params, &mut rng);
            out[i].push(tok);
            if params.stop_tokens.contains(&tok) {
                finish[i] = Some(FinishReason::Stop);
            }
            next.push(tok);
        }
        if finish.iter().all(Option::is_some) || step + 1 == params.max_new_tokens {
            break;
        }
        // One new position per sequence: (3, B, 1)
        let pos: Vec<Vec<[u32; 3]>> = next_pos.iter().map(|&n| vec![[n + step as u32; 3]]).collect();
        if padded {
            key_padding = Tensor::cat(&[&key_padding, &Tensor::ones((b, 1), DType::F32, dev)?], 1)?;
        }
        let emb = model.embed(&Tensor::from_vec(next, (b, 1), dev)?, None)?;
        let h = model.decode(&emb, &positions_tensor(&pos, 1)?, padded.then_some(&key_padding), &mut cache)?;
        last = model.logits(&h)?.squeeze(1)?.to_dtype(DType::F32)?;
        timings.decode_steps += 1;
    }
    timings.decode_s = t0.elapsed().as_secs_f64();

    let gens = out
        .into_iter()
        .zip(finish)
        .enumerate()
        .map(|(i, (tokens, f))| {
            let prompt_logits = match &prompt_logits {
                // drop the left padding: (T_i, V)
                Some(all) => Some(all.i(i)?.narrow(0, t - prompts[i].ids.len(), prompts[i].ids.len())?),
                None => None,
            };
            Ok(Generation { tokens, finish: f.unwrap_or(FinishReason::Length), prompt_logits })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((gens, timings))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_first_max_and_sampling_respects_top_k() {
        let p = SamplingParams::default();
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        assert_eq!(sample(&[0.1, 3.0, 3.0, -1.0], &p, &mut rng), 1);
        let p = SamplingParams { temperature: 1.0, top_k: 2, ..Default::default() };
        for _ in 0..200 {
            let t = sample(&[5.0, 0.0, 4.9, 4.8], &p, &mut rng);
            assert!(t == 0 || t == 2, "top-k 2 sampled {t}");
        }
        let p = SamplingParams { temperature: 1.0, top_p: 0.5, ..Default::default() };
        for _ in 0..200 {
            assert_eq!(sample(&[10.0, 0.0, 0.0], &p, &mut rng), 0);
        }
    }
}
