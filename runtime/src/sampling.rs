//! How a token or an option is picked: the one token sampler (greedy at temperature 0, else temperature
//! and nucleus sampling over the allowed tokens), softmax over log-probabilities, the greedy or sampled
//! pick over options, and one token's log-probability.
//!
//! Key choice: plain functions over slices on the host, seeded by the caller's [`StdRng`], so that an
//! answer is a function of the request's seed.

use rand::rngs::StdRng;
use rand::Rng;

/// Softmax of log-probabilities.
pub(crate) fn normalise(logp: &[f64]) -> Vec<f64> {
    let m = logp.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = logp.iter().map(|l| (l - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

/// The most likely index (temperature 0) or a sample at `temperature`; `exclude` is never picked.
pub(crate) fn pick(probs: &[f64], temperature: f64, rng: &mut StdRng, exclude: Option<usize>) -> usize {
    let w: Vec<f64> = probs
        .iter()
        .enumerate()
        .map(|(i, &p)| {
            if Some(i) == exclude {
                0.0
            } else if temperature > 0.0 {
                p.powf(1.0 / temperature)
            } else {
                p
            }
        })
        .collect();
    if temperature <= 0.0 {
        return w.iter().enumerate().fold(0, |b, (i, &x)| if x > w[b] { i } else { b });
    }
    weighted_pick(&w, rng).unwrap_or_else(|| w.iter().rposition(|&x| x > 0.0).unwrap_or(0))
}

/// Index `i` with probability `w[i] / sum(w)` (weights need not sum to one), from one
/// `rng.random::<f64>()`. `None` when the draw runs past the last weight (rounding, or a total that is
/// zero or not finite): each caller keeps its own fallback.
pub(crate) fn weighted_pick(w: &[f64], rng: &mut StdRng) -> Option<usize> {
    let total: f64 = w.iter().sum();
    let mut r = rng.random::<f64>() * total;
    for (i, &x) in w.iter().enumerate() {
        if r < x {
            return Some(i);
        }
        r -= x;
    }
    None
}

/// The best-scoring token among those `allowed`, with its logit.
pub(crate) fn best(logits: &[f32], allowed: impl Fn(usize) -> bool) -> Option<(u32, f32)> {
    let mut out: Option<(u32, f32)> = None;
    for (i, &v) in logits.iter().enumerate() {
        if allowed(i) && out.is_none_or(|(_, b)| v > b) {
            out = Some((i as u32, v));
        }
    }
    out
}

/// The next token among `allowed`: the best one at temperature 0, else a draw from the softmax of
/// `logits / temperature` over the allowed tokens, cut to the most likely ones whose mass reaches
/// `top_p` (1.0: no cut).
pub(crate) fn sample(
    logits: &[f32],
    allowed: impl Fn(usize) -> bool,
    temperature: f64,
    top_p: f64,
    rng: &mut StdRng,
) -> u32 {
    let greedy = || best(logits, &allowed).map(|(t, _)| t).unwrap_or(0);
    if temperature <= 0.0 {
        return greedy();
    }
    let m = logits.iter().enumerate().filter(|(i, _)| allowed(*i)).map(|(_, &v)| v).fold(f32::NEG_INFINITY, f32::max);
    let mut w: Vec<f64> = logits
        .iter()
        .enumerate()
        .map(|(i, &v)| if allowed(i) { (((v - m) as f64) / temperature).exp() } else { 0.0 })
        .collect();
    if top_p < 1.0 {
        let total: f64 = w.iter().sum();
        let mut order: Vec<usize> = (0..w.len()).filter(|&i| w[i] > 0.0).collect();
        order.sort_by(|&a, &b| w[b].total_cmp(&w[a]));
        let mut mass = 0.0;
        let keep = order.iter().position(|&i| {
            mass += w[i] / total;
            mass >= top_p
        });
        for &i in &order[keep.map_or(order.len(), |k| k + 1)..] {
            w[i] = 0.0;
        }
    }
    weighted_pick(&w, rng).map_or_else(greedy, |i| i as u32)
}

/// `log p(tok)` under the softmax of `logits`.
pub(crate) fn log_softmax_at(logits: &[f32], tok: u32) -> f64 {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let s: f64 = logits.iter().map(|&v| (v as f64 - m).exp()).sum();
    logits[tok as usize] as f64 - m - s.ln()
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn weighted_pick_never_picks_a_zero_weight_and_follows_the_weights() {
        let w = [0.0, 3.0, 0.0, 1.0, 0.0];
        let mut rng = StdRng::seed_from_u64(7);
        let mut counts = [0usize; 5];
        for _ in 0..4000 {
            counts[weighted_pick(&w, &mut rng).expect("a positive total")] += 1;
        }
        assert_eq!(counts[0] + counts[2] + counts[4], 0, "{counts:?}");
        // 3:1 within a loose margin (4000 draws: the 1/4 share's standard deviation is about 0.007).
        let share = counts[3] as f64 / 4000.0;
        assert!((share - 0.25).abs() < 0.04, "{counts:?}");
    }

    #[test]
    fn weighted_pick_takes_one_draw_and_leaves_the_fallback_to_the_caller() {
        let (mut a, mut b) = (StdRng::seed_from_u64(3), StdRng::seed_from_u64(3));
        assert_eq!(weighted_pick(&[0.0, 0.0], &mut a), None);
        b.random::<f64>();
        assert_eq!(a.random::<u64>(), b.random::<u64>(), "exactly one draw per pick");
        // Every weight excluded: `pick` falls back to the last positive weight, here none, so index 0.
        assert_eq!(pick(&[1.0], 0.7, &mut a, Some(0)), 0);
    }

    #[test]
    fn sample_is_greedy_at_zero_keeps_to_the_allowed_tokens_and_cuts_the_nucleus() {
        let mut rng = StdRng::seed_from_u64(1);
        let logits = [0.1, 3.0, 3.0, -1.0];
        assert_eq!(sample(&logits, |_| true, 0.0, 1.0, &mut rng), 1, "the first best token");
        assert_eq!(sample(&logits, |i| i != 1, 0.0, 1.0, &mut rng), 2);
        for _ in 0..200 {
            let t = sample(&[5.0, 0.0, 4.9, 4.8], |i| i != 0, 1.0, 1.0, &mut rng);
            assert_ne!(t, 0, "a token that is not allowed");
            // 10.0 holds all but ~1e-4 of the mass: a 0.5 nucleus is that token alone.
            assert_eq!(sample(&[10.0, 0.0, 0.0], |_| true, 1.0, 0.5, &mut rng), 0);
        }
    }
}
