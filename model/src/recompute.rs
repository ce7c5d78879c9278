//! Recomputation (gradient checkpointing): the training forward as a chain of stages, each recomputed in
//! the backward.
//!
//! candle has no gradient checkpointing: its backward keeps every intermediate alive, gigabytes for a VLM
//! on a screenshot. The forward here is a chain `x_0 -> stage_0 -> x_1 -> ... -> loss` (one stage per
//! transformer block). Key choice: the forward keeps only the stage inputs `x_i`; the backward recomputes
//! stage `i` from `x_i` as a fresh leaf and backpropagates `sum(stage_i(x_i) * g_{i+1})` plus the stage's
//! side loss (e.g. an auxiliary loss on an intermediate layer), which gives `g_i` and the stage's parameter
//! gradients. Peak memory is the stage inputs plus one stage's graph; the cost, one more forward of every
//! stage but the last. A stage that maps row ranges of its input independently ([`Stage::rowwise`], a
//! vision block over several images) runs range by range in the forward and in the recomputation, so its
//! graph is one range's, not the whole batch's. Without checkpointing the same chain runs as one graph,
//! so the two modes are tested against each other. Stages before the first with parameters run once,
//! without a graph. The returned [`GradStore`] holds the parameters' gradients only (candle's own also
//! keeps those of constants such as rotary tables). The stages' attention forwards are kept from the
//! forward and replayed in the recomputation when the caller passes an [`AttentionMemo`] (this module
//! tells it which stage runs, and whether it records or replays). Reference: Chen et al. 2016, "Training
//! Deep Nets with Sublinear Memory Cost".

use std::ops::Range;
use std::rc::Rc;

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use crate::attention_memo::{AttentionMemo, Phase};
use crate::error::{ModelError, Result};

/// A stage's function: the previous stage's output to this stage's, and its side loss if it has one.
type StageFn<'a> = Box<dyn Fn(&Tensor) -> Result<(Tensor, Option<Tensor>)> + 'a>;

/// A row-wise stage's function of one range: `(range, x rows of that range) -> output rows`.
type RowsFn<'a> = Rc<dyn Fn(&Range<usize>, &Tensor) -> Result<Tensor> + 'a>;

/// One link of the chain.
pub(crate) struct Stage<'a> {
    /// Whether the function reads any trainable parameter.
    pub has_params: bool,
    pub f: StageFn<'a>,
    /// For [`Self::rowwise`]: the ranges of dim 0 and the function of one.
    rows: Option<(Vec<Range<usize>>, RowsFn<'a>)>,
}

impl<'a> Stage<'a> {
    pub fn new(has_params: bool, f: impl Fn(&Tensor) -> Result<Tensor> + 'a) -> Self {
        Self { has_params, f: Box::new(move |x: &Tensor| Ok((f(x)?, None))), rows: None }
    }

    /// A stage whose output rows in each of `ranges` (consecutive, covering dim 0 of its input) depend on
    /// that range's input rows alone: `f(range, x.narrow(0, range))`, concatenated. No side loss.
    pub fn rowwise(
        has_params: bool,
        ranges: Vec<Range<usize>>,
        f: impl Fn(&Range<usize>, &Tensor) -> Result<Tensor> + 'a,
    ) -> Self {
        let f: RowsFn<'a> = Rc::new(f);
        let (whole, ranges_whole) = (f.clone(), ranges.clone());
        Self {
            has_params,
            f: Box::new(move |x: &Tensor| Ok((by_rows((&ranges_whole, &whole), x, Rows::Graph)?, None))),
            rows: Some((ranges, f)),
        }
    }

    /// The stage's output without a graph; a row-wise stage keeps one range's graph at a time. With
    /// `record = (memo, i)` (this is stage `i`, to be recomputed) its attention forwards are kept.
    fn detached(&self, x: &Tensor, record: Option<(&AttentionMemo, usize)>) -> Result<(Tensor, Option<Tensor>)> {
        match &self.rows {
            Some((ranges, f)) => {
                let keep = record.map_or(Rows::Detached, |(memo, i)| Rows::Recording(memo, i));
                Ok((by_rows((ranges, f), x, keep)?, None))
            }
            None => {
                if let Some((memo, i)) = record {
                    memo.enter(Phase::Record, i, 0);
                }
                let (y, side) = (self.f)(x)?;
                Ok((y.detach(), side.map(|t| t.detach())))
            }
        }
    }

    /// A stage that also returns a side loss (a scalar) added to the chain's loss.
    pub fn with_side_loss(has_params: bool, f: impl Fn(&Tensor) -> Result<(Tensor, Tensor)> + 'a) -> Self {
        Self {
            has_params,
            f: Box::new(move |x: &Tensor| {
                let (y, side) = f(x)?;
                Ok((y, Some(side)))
            }),
            rows: None,
        }
    }
}

/// What [`by_rows`] keeps of each range's run.
#[derive(Clone, Copy)]
enum Rows<'m> {
    /// Every range's graph: one graph over the whole stage.
    Graph,
    /// No graph: each range's is dropped before the next range runs.
    Detached,
    /// No graph, and each range's attention forwards recorded as those of stage `.1`.
    Recording(&'m AttentionMemo, usize),
}

/// A row-wise stage's output: `f` over each range of `x`'s rows, concatenated.
fn by_rows((ranges, f): (&[Range<usize>], &RowsFn), x: &Tensor, keep: Rows) -> Result<Tensor> {
    let mut parts = Vec::with_capacity(ranges.len());
    for r in ranges {
        if let Rows::Recording(memo, i) = keep {
            memo.enter(Phase::Record, i, r.start);
        }
        let y = f(r, &x.narrow(0, r.start, r.len())?)?;
        parts.push(if matches!(keep, Rows::Graph) { y } else { y.detach() });
    }
    Ok(Tensor::cat(&parts, 0)?)
}

/// `a + b` where either may be absent.
fn add(a: Option<Tensor>, b: Option<Tensor>) -> Result<Option<Tensor>> {
    Ok(match (a, b) {
        (Some(a), Some(b)) => Some((a + b)?),
        (a, b) => a.or(b),
    })
}

/// Runs the chain without any gradient: each stage's output is detached, so its graph (built when
/// parameters are `Var`s) is dropped as soon as the next stage has run. Returns the last stage's output
/// and the sum of the side losses (detached), if any.
pub(crate) fn forward(x0: &Tensor, stages: &[Stage]) -> Result<(Tensor, Option<Tensor>)> {
    let mut x = x0.detach();
    let mut sides = None;
    for s in stages {
        let (y, side) = s.detached(&x, None)?;
        x = y;
        sides = add(sides, side)?;
    }
    Ok((x, sides))
}

/// The loss of a chain whose last stage returns a scalar: that scalar plus the side losses.
pub(crate) fn forward_loss(x0: &Tensor, stages: &[Stage]) -> Result<Tensor> {
    let (x, sides) = forward(x0, stages)?;
    Ok(add(Some(x), sides)?.expect("present"))
}

/// Runs the chain as one graph (no checkpointing) and returns its output plus its side losses, for a
/// caller that runs candle's `backward` itself.
pub(crate) fn graph(x0: &Tensor, stages: &[Stage]) -> Result<Tensor> {
    let mut x = x0.detach();
    let mut sides = None;
    for s in stages {
        let (y, side) = (s.f)(&x)?;
        x = y;
        sides = add(sides, side)?;
    }
    Ok(add(Some(x), sides)?.expect("present"))
}

/// Runs the chain and its backward. The last stage must return a scalar (the loss); `params` are the
/// `Var`s to return gradients for. With checkpointing and a `memo` (the one the stages' attention reads),
/// the recomputation replays the forward's attention. Returns the (detached) loss and the parameters'
/// gradients.
pub(crate) fn forward_backward(
    x0: &Tensor,
    stages: &[Stage],
    params: &[Var],
    (checkpointing, memo): (bool, Option<&AttentionMemo>),
) -> Result<(Tensor, GradStore)> {
    let out = run_backward(x0, stages, params, (checkpointing, memo));
    if let Some(memo) = memo {
        memo.clear();
    }
    out
}

fn run_backward(
    x0: &Tensor,
    stages: &[Stage],
    params: &[Var],
    (checkpointing, memo): (bool, Option<&AttentionMemo>),
) -> Result<(Tensor, GradStore)> {
    let Some(last) = stages.len().checked_sub(1) else {
        return Err(ModelError::Train("an empty chain has no loss".into()));
    };
    // Stages before the first with parameters: no graph, no recompute.
    let first = stages.iter().position(|s| s.has_params).unwrap_or(last);
    // Side losses of the leading stages are constants: they count in the loss, not in the gradients.
    let (mut x, lead) = forward(x0, &stages[..first])?;
    let mut out = GradStore::default();
    if !checkpointing {
        let loss = graph(&x, &stages[first..])?;
        let grads = loss.backward()?;
        collect(&grads, params, &mut out)?;
        return Ok((add(Some(loss.detach()), lead)?.expect("present"), out));
    }
    let mut inputs = Vec::with_capacity(last - first + 1);
    for (i, s) in (first..last).zip(&stages[first..last]) {
        inputs.push(x.clone());
        x = s.detached(&x, memo.map(|m| (m, i)))?.0;
    }
    inputs.push(x);
    let mut loss = lead;
    let mut g: Option<Tensor> = None;
    for (i, input) in (first..last + 1).zip(inputs).rev() {
        // The last stage ran no forward before: nothing to replay.
        let phase = if i < last { Phase::Replay } else { Phase::Off };
        if let (Some((ranges, f)), Some(gy)) = (&stages[i].rows, &g) {
            let replay = memo.map(|m| (m, i));
            g = rowwise_backward((ranges, f), (&input, gy), (i > first, replay), params, &mut out)?;
            continue;
        }
        if let Some(memo) = memo {
            memo.enter(phase, i, 0);
        }
        // The first differentiable stage's input needs no gradient: it stays a constant.
        let leaf = if i > first { Some(Var::from_tensor(&input)?) } else { None };
        let (y, side) = (stages[i].f)(leaf.as_ref().map(|v| v.as_tensor()).unwrap_or(&input))?;
        let mut objective = match &g {
            None => {
                // The last stage: its output is the loss.
                loss = add(loss, Some(y.detach()))?;
                y
            }
            Some(g) => (y * g)?.sum_all()?,
        };
        if let Some(side) = side {
            loss = add(loss, Some(side.detach()))?;
            objective = (objective + side)?;
        }
        let grads = objective.backward()?;
        collect(&grads, params, &mut out)?;
        if let Some(leaf) = leaf {
            g = Some(match grads.get(leaf.as_tensor()) {
                // Detached: candle leaves a leaf's gradient attached to the graph that made it (e.g.
                // `grad * w` for `x * w`), and the next backward must not run through it.
                Some(gi) => gi.detach(),
                None => leaf.zeros_like()?,
            });
        }
    }
    Ok((loss.expect("the last stage always runs"), out))
}

/// The recomputation of a row-wise stage, one range at a time: each range's parameter gradients go to
/// `out`, and (when `need_input_grad`) its input rows' gradients are concatenated into the returned one.
/// With `replay = (memo, i)` each range replays the attention forwards stage `i` recorded for it.
fn rowwise_backward(
    (ranges, f): (&[Range<usize>], &RowsFn),
    (input, gy): (&Tensor, &Tensor),
    (need_input_grad, replay): (bool, Option<(&AttentionMemo, usize)>),
    params: &[Var],
    out: &mut GradStore,
) -> Result<Option<Tensor>> {
    let mut gx = Vec::with_capacity(ranges.len());
    for r in ranges {
        if let Some((memo, i)) = replay {
            memo.enter(Phase::Replay, i, r.start);
        }
        let rows = input.narrow(0, r.start, r.len())?;
        let leaf = if need_input_grad { Some(Var::from_tensor(&rows)?) } else { None };
        let y = f(r, leaf.as_ref().map(|v| v.as_tensor()).unwrap_or(&rows))?;
        let grads = (y * gy.narrow(0, r.start, r.len())?)?.sum_all()?.backward()?;
        collect(&grads, params, out)?;
        if let Some(leaf) = leaf {
            gx.push(match grads.get(leaf.as_tensor()) {
                Some(g) => g.detach(),
                None => leaf.zeros_like()?,
            });
        }
    }
    Ok(if need_input_grad { Some(Tensor::cat(&gx, 0)?) } else { None })
}

/// Adds the gradients of `params` found in `grads` to `out`, detached: candle does not detach the
/// gradients of leaves, and an attached one would keep the step's activations alive through its graph.
fn collect(grads: &GradStore, params: &[Var], out: &mut GradStore) -> Result<()> {
    for p in params {
        if let Some(g) = grads.get(p.as_tensor()) {
            let g = g.detach();
            let sum = match out.get(p.as_tensor()) {
                Some(prev) => (prev + g)?,
                None => g,
            };
            out.insert(p.as_tensor(), sum);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use std::cell::Cell;

    /// A toy chain `x -> tanh(x * w0) -> (x * w1).exp() -> sum(x * w2)` with `x` constant and one
    /// parameter per stage: both modes give the same loss and gradients, and checkpointing runs every
    /// stage but the last twice.
    #[test]
    fn both_modes_agree_and_checkpointing_recomputes() -> Result<()> {
        let dev = Device::Cpu;
        let x0 = Tensor::new(&[0.3f64, -1.2, 0.7], &dev)?;
        let w: Vec<Var> =
            [[0.5, 1.5, -0.5], [0.2, -0.1, 0.3], [1.0, 2.0, 3.0]].iter().map(|v| Var::new(v, &dev).unwrap()).collect();
        let calls: Vec<Cell<usize>> = (0..3).map(|_| Cell::new(0)).collect();
        let stages = vec![
            Stage::new(true, |x: &Tensor| {
                calls[0].set(calls[0].get() + 1);
                Ok((x * w[0].as_tensor())?.tanh()?)
            }),
            Stage::new(true, |x: &Tensor| {
                calls[1].set(calls[1].get() + 1);
                Ok((x * w[1].as_tensor())?.exp()?)
            }),
            Stage::new(true, |x: &Tensor| {
                calls[2].set(calls[2].get() + 1);
                Ok((x * w[2].as_tensor())?.sum_all()?)
            }),
        ];
        let (l1, g1) = forward_backward(&x0, &stages, &w, (false, None))?;
        assert_eq!(calls.iter().map(Cell::get).collect::<Vec<_>>(), [1, 1, 1]);
        let (l2, g2) = forward_backward(&x0, &stages, &w, (true, None))?;
        assert_eq!(calls.iter().map(Cell::get).collect::<Vec<_>>(), [3, 3, 2]);
        assert_eq!(l1.to_scalar::<f64>()?, l2.to_scalar::<f64>()?);
        for v in &w {
            let (a, b) = (g1.get(v.as_tensor()).unwrap(), g2.get(v.as_tensor()).unwrap());
            let d = (a - b)?.abs()?.max_all()?.to_scalar::<f64>()?;
            assert!(d < 1e-14, "gradients differ by {d}");
        }
        // The analytic gradient of the first parameter: dL/dw0 = w2 * w1 * e1 * (1 - t^2) * x0.
        let t = (&x0 * w[0].as_tensor())?.tanh()?;
        let e1 = (&t * w[1].as_tensor())?.exp()?;
        let one_minus = (1.0 - t.sqr()?)?;
        let want = (((w[2].as_tensor() * w[1].as_tensor())? * e1)? * one_minus)?.mul(&x0)?;
        let d = (g2.get(w[0].as_tensor()).unwrap() - want)?.abs()?.max_all()?.to_scalar::<f64>()?;
        assert!(d < 1e-12, "dL/dw0 differs from the analytic value by {d}");
        assert_eq!(g2.get_ids().count(), 3, "only the parameters' gradients are kept");
        Ok(())
    }

    /// A side loss on a middle stage: both modes give the loss `sum(x2 * w2) + k * sum(x1)` and its
    /// analytic gradients.
    #[test]
    fn side_losses_add_to_the_loss_and_its_gradients() -> Result<()> {
        let dev = Device::Cpu;
        let x0 = Tensor::new(&[0.3f64, -1.2, 0.7], &dev)?;
        let w: Vec<Var> = [[0.5, 1.5, -0.5], [1.0, 2.0, 3.0]].iter().map(|v| Var::new(v, &dev).unwrap()).collect();
        let k = 0.25;
        let stages = vec![
            Stage::with_side_loss(true, |x: &Tensor| {
                let y = (x * w[0].as_tensor())?.tanh()?;
                let side = (y.sum_all()? * k)?;
                Ok((y, side))
            }),
            Stage::new(true, |x: &Tensor| Ok((x * w[1].as_tensor())?.sum_all()?)),
        ];
        let t = (&x0 * w[0].as_tensor())?.tanh()?;
        let want_loss = ((&t * w[1].as_tensor())?.sum_all()? + (t.sum_all()? * k)?)?.to_scalar::<f64>()?;
        // dL/dw0 = (w1 + k) * (1 - t^2) * x0; dL/dw1 = t.
        let want_g0 = ((w[1].as_tensor() + k)? * (1.0 - t.sqr()?)?)?.mul(&x0)?;
        for checkpointing in [false, true] {
            let (loss, g) = forward_backward(&x0, &stages, &w, (checkpointing, None))?;
            assert!((loss.to_scalar::<f64>()? - want_loss).abs() < 1e-14, "loss, checkpointing {checkpointing}");
            for (v, want) in [(&w[0], &want_g0), (&w[1], &t)] {
                let d = (g.get(v.as_tensor()).unwrap() - want)?.abs()?.max_all()?.to_scalar::<f64>()?;
                assert!(d < 1e-14, "gradient off by {d}, checkpointing {checkpointing}");
            }
        }
        assert!((forward_loss(&x0, &stages)?.to_scalar::<f64>()? - want_loss).abs() < 1e-14);
        assert!((graph(&x0, &stages)?.to_scalar::<f64>()? - want_loss).abs() < 1e-14);
        Ok(())
    }

    /// Stages before the first with parameters run once, without a graph, in both modes.
    #[test]
    fn leading_stages_without_parameters_run_once() -> Result<()> {
        let dev = Device::Cpu;
        let x0 = Tensor::new(&[1.0f64, 2.0], &dev)?;
        let w = Var::new(&[3.0f64, 4.0], &dev)?;
        let calls = Cell::new(0);
        let stages = vec![
            Stage::new(false, |x: &Tensor| {
                calls.set(calls.get() + 1);
                Ok((x * 2.0)?)
            }),
            Stage::new(true, |x: &Tensor| Ok((x * w.as_tensor())?.sum_all()?)),
        ];
        for checkpointing in [false, true] {
            calls.set(0);
            let (loss, g) = forward_backward(&x0, &stages, std::slice::from_ref(&w), (checkpointing, None))?;
            assert_eq!(calls.get(), 1);
            assert_eq!(loss.to_scalar::<f64>()?, 22.0);
            assert_eq!(g.get(w.as_tensor()).unwrap().to_vec1::<f64>()?, [2.0, 4.0]);
        }
        Ok(())
    }

    /// A row-wise stage gives the plain stage's loss and gradients (its input's included) in both modes,
    /// and runs range by range, in the forward and again in the recomputation.
    #[test]
    fn rowwise_stage_matches_the_plain_one_range_by_range() -> Result<()> {
        let dev = Device::Cpu;
        let x0 = Tensor::new(&[[0.3f64, -1.2], [0.7, 0.1], [-0.4, 0.9]], &dev)?;
        let w: Vec<Var> = [[0.5, 1.5], [0.2, -0.1], [1.0, 2.0]].iter().map(|v| Var::new(v, &dev).unwrap()).collect();
        let seen = std::cell::RefCell::new(Vec::new());
        let mid = |x: &Tensor| Ok(x.broadcast_mul(w[1].as_tensor())?.exp()?);
        let chain = |rowwise: bool| {
            vec![
                Stage::new(true, |x: &Tensor| Ok(x.broadcast_mul(w[0].as_tensor())?.tanh()?)),
                match rowwise {
                    true => Stage::rowwise(true, vec![0..1, 1..3], |r: &Range<usize>, x: &Tensor| {
                        seen.borrow_mut().push(r.clone());
                        mid(x)
                    }),
                    false => Stage::new(true, mid),
                },
                Stage::new(true, |x: &Tensor| Ok(x.broadcast_mul(w[2].as_tensor())?.sum_all()?)),
            ]
        };
        let (plain, rowwise) = (chain(false), chain(true));
        for checkpointing in [false, true] {
            seen.borrow_mut().clear();
            let (l0, g0) = forward_backward(&x0, &plain, &w, (checkpointing, None))?;
            let (l1, g1) = forward_backward(&x0, &rowwise, &w, (checkpointing, None))?;
            assert!((l0.to_scalar::<f64>()? - l1.to_scalar::<f64>()?).abs() < 1e-14);
            for v in &w {
                let d = (g0.get(v.as_tensor()).unwrap() - g1.get(v.as_tensor()).unwrap())?;
                let d = d.abs()?.max_all()?.to_scalar::<f64>()?;
                assert!(d < 1e-14, "gradient off by {d}, checkpointing {checkpointing}");
            }
            let runs = if checkpointing { 2 } else { 1 };
            let want: Vec<Range<usize>> = [0..1, 1..3].iter().cycle().take(2 * runs).cloned().collect();
            assert_eq!(*seen.borrow(), want, "checkpointing {checkpointing}");
        }
        Ok(())
    }
}
