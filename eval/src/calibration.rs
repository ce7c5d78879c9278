//! How well the agent's `ask_probability` says when a step needs an ask: the reliability table (equal-width
//! bins over the probability), expected calibration error, Brier score, and temperature scaling of the ask
//! logit fitted on the same decisions.
//!
//! A decision is one step's first answer with ground-truth history in the +ASK evaluation (the prediction
//! ASK timing counts, `eval/README.md`); its label is whether the step is an annotated ASK step. ECE is
//! `sum_b n_b / N * |mean p_b - positive rate_b|` over the bins (the reliability diagram of a binary
//! event; Guo et al. 2017 §2 take the same gap per bin), Brier `mean (p - y)^2`. Temperature scaling
//! maps `p` to `sigmoid(logit(p) / T)`, `T` minimising the log loss. It is monotone, so a threshold on the
//! scaled probability makes the same decisions as the matching threshold on `p`: it changes how well the
//! number reads as a probability, never which steps ask.

use serde::Serialize;

/// One ask decision: the model's probability of `ask` and whether the step needed one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    pub p: f64,
    pub needed: bool,
}

/// One bin of the reliability table: decisions with `lo <= p < hi` (the last bin includes 1).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Bin {
    pub lo: f64,
    pub hi: f64,
    pub count: usize,
    pub mean_p: Option<f64>,
    /// Fraction of the bin's steps that needed an ask.
    pub rate: Option<f64>,
}

/// The reliability table and its summaries.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Reliability {
    pub bins: Vec<Bin>,
    pub ece: Option<f64>,
    pub brier: Option<f64>,
    pub decisions: usize,
    pub positives: usize,
}

/// The reliability table of `decisions` over `bins` equal-width bins of `[0, 1]`.
pub fn reliability(decisions: &[Decision], bins: usize) -> Reliability {
    let bins = bins.max(1);
    let mut sums = vec![(0usize, 0.0f64, 0usize); bins];
    for d in decisions {
        let b = ((d.p * bins as f64) as usize).min(bins - 1);
        sums[b].0 += 1;
        sums[b].1 += d.p;
        sums[b].2 += usize::from(d.needed);
    }
    let n = decisions.len();
    let table: Vec<Bin> = sums
        .iter()
        .enumerate()
        .map(|(b, &(count, sum_p, pos))| Bin {
            lo: b as f64 / bins as f64,
            hi: (b + 1) as f64 / bins as f64,
            count,
            mean_p: (count > 0).then(|| sum_p / count as f64),
            rate: (count > 0).then(|| pos as f64 / count as f64),
        })
        .collect();
    let ece = (n > 0).then(|| {
        table.iter().filter_map(|b| Some(b.count as f64 / n as f64 * (b.mean_p? - b.rate?).abs())).sum::<f64>()
    });
    let brier = (n > 0)
        .then(|| decisions.iter().map(|d| (d.p - f64::from(u8::from(d.needed))).powi(2)).sum::<f64>() / n as f64);
    Reliability { bins: table, ece, brier, decisions: n, positives: decisions.iter().filter(|d| d.needed).count() }
}

/// Probabilities are kept this far from 0 and 1 so that their logits are finite.
const EPS: f64 = 1e-12;

/// `p` with its logit divided by `t`.
pub fn scale(p: f64, t: f64) -> f64 {
    let p = p.clamp(EPS, 1.0 - EPS);
    let z = (p / (1.0 - p)).ln() / t;
    1.0 / (1.0 + (-z).exp())
}

/// Mean log loss of `decisions` with every probability scaled by `t`.
pub fn log_loss(decisions: &[Decision], t: f64) -> f64 {
    let n = decisions.len().max(1) as f64;
    decisions
        .iter()
        .map(|d| {
            let q = scale(d.p, t).clamp(EPS, 1.0 - EPS);
            if d.needed {
                -q.ln()
            } else {
                -(1.0 - q).ln()
            }
        })
        .sum::<f64>()
        / n
}

/// The temperature in `[1/20, 20]` that minimises the log loss (golden-section search on `ln T`; the loss
/// is convex in `1/T`, so unimodal here). 1 when there is nothing to fit (no decisions, or one class only).
pub fn fit_temperature(decisions: &[Decision]) -> f64 {
    let pos = decisions.iter().filter(|d| d.needed).count();
    if pos == 0 || pos == decisions.len() {
        return 1.0;
    }
    let f = |x: f64| log_loss(decisions, x.exp());
    let g = (5f64.sqrt() - 1.0) / 2.0;
    let (mut a, mut b) = (-(20f64.ln()), 20f64.ln());
    let (mut c, mut d) = (b - g * (b - a), a + g * (b - a));
    let (mut fc, mut fd) = (f(c), f(d));
    for _ in 0..80 {
        if fc < fd {
            (b, d, fd) = (d, c, fc);
            c = b - g * (b - a);
            fc = f(c);
        } else {
            (a, c, fc) = (c, d, fd);
            d = a + g * (b - a);
            fd = f(d);
        }
    }
    ((a + b) / 2.0).exp()
}

/// `decisions` with every probability scaled by `t`.
pub fn scaled(decisions: &[Decision], t: f64) -> Vec<Decision> {
    decisions.iter().map(|d| Decision { p: scale(d.p, t), needed: d.needed }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(p: f64, needed: bool) -> Decision {
        Decision { p, needed }
    }

    #[test]
    fn ece_and_brier_by_hand() {
        // Bin [0.1, 0.2): p 0.1, 0.1, labels 0, 1 -> mean 0.1, rate 0.5, gap 0.4.
        // Bin [0.9, 1.0]: p 0.9, 1.0, labels 1, 1 -> mean 0.95, rate 1, gap 0.05.
        // ECE = 2/4 * 0.4 + 2/4 * 0.05 = 0.225; Brier = (0.01 + 0.81 + 0.01 + 0) / 4 = 0.2075.
        let r = reliability(&[d(0.1, false), d(0.1, true), d(0.9, true), d(1.0, true)], 10);
        assert_eq!(r.bins.len(), 10);
        assert_eq!((r.bins[1].count, r.bins[9].count, r.decisions, r.positives), (2, 2, 4, 3));
        assert!((r.ece.unwrap() - 0.225).abs() < 1e-12, "{:?}", r.ece);
        assert!((r.brier.unwrap() - 0.2075).abs() < 1e-12, "{:?}", r.brier);
        assert_eq!(reliability(&[], 10).ece, None);
    }

    #[test]
    fn temperature_recovers_a_known_sharpening() {
        // Labels drawn so that the true probability is sigmoid(z); the model reports sigmoid(3 z), too
        // sharp by a temperature of 3. Exact frequencies: at each z, a share sigmoid(z) of 1000 steps is
        // positive, so the log loss is minimised at T = 3 up to the rounding of the counts.
        let mut ds = Vec::new();
        for k in -8..=8 {
            let z = k as f64 / 4.0;
            let truth = 1.0 / (1.0 + (-z).exp());
            let pos = (truth * 1000.0).round() as usize;
            let reported = 1.0 / (1.0 + (-3.0 * z).exp());
            ds.extend((0..1000).map(|i| d(reported, i < pos)));
        }
        let t = fit_temperature(&ds);
        assert!((t - 3.0).abs() < 0.02, "fitted T {t}");
        assert!(log_loss(&ds, t) < log_loss(&ds, 1.0));
        assert!(reliability(&scaled(&ds, t), 10).ece.unwrap() < reliability(&ds, 10).ece.unwrap());
        assert_eq!(fit_temperature(&[d(0.3, false)]), 1.0, "one class: nothing to fit");
    }

    #[test]
    fn scaling_keeps_the_order() {
        let ps = [0.0, 1e-9, 0.2, 0.5, 0.7, 1.0];
        for t in [0.3, 1.0, 4.0] {
            let q: Vec<f64> = ps.iter().map(|&p| scale(p, t)).collect();
            assert!(q.windows(2).all(|w| w[0] <= w[1]), "T {t}: {q:?}");
        }
        assert!((scale(0.7, 1.0) - 0.7).abs() < 1e-12);
    }
}
