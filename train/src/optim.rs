//! AdamW with decoupled weight decay, the learning-rate schedule (linear warmup + cosine) and global
//! gradient-norm clipping.
//!
//! Why our own AdamW and not candle-nn's: resuming needs the optimiser state (first and second moments
//! and the step count of every parameter) saved and loaded by name, which candle-nn's does not expose.
//! The update is torch.optim.AdamW's single-tensor formula, operation for operation (Loshchilov & Hutter,
//! "Decoupled Weight Decay Regularization", 2019):
//! ```text
//! p <- p * (1 - lr * wd)
//! m <- lerp(m, g, 1 - b1)            v <- b2 v + (1 - b2) g^2
//! p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
//! ```
//! The update is one fused op a parameter (`askgui_kernels::ops::adamw_step`, one pass on the CPU, one
//! kernel launch on a GPU, in place of about 15 candle ops), the formula above in that order, bit for bit
//! the candle ops it replaced (the test `the_fused_step_is_the_candle_update_bitwise` keeps that twin).
//! The moments are kept in f32 whatever the parameters' dtype, and so is the parameter itself: a bf16
//! parameter (full training on a GPU) gets an f32 master copy that takes the updates, and the bf16 weight
//! is its rounding after each step, so that updates below a bf16 ulp still add up (mixed precision,
//! Micikevicius et al. 2018). As in torch, a parameter without a gradient this step is left alone (no
//! decay, no moment update, its step count unchanged).
//!
//! The schedule is transformers' `get_cosine_schedule_with_warmup` (with an optional floor, as its
//! `cosine_with_min_lr`): the lr of optimiser step `i` (0-based) is `peak * i / warmup` during warmup,
//! so the first step of a warmed-up run has lr 0, exactly as a transformers Trainer run.

use std::collections::HashMap;
use std::path::Path;

use askgui_kernels::adamw::AdamWStep;
use askgui_kernels::ops;
use candle_core::{DType, Device, Tensor, Var};

use crate::error::{Result, TrainError};

/// AdamW's hyper-parameters except the learning rate, which the schedule gives each step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWParams {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWParams {
    /// torch.optim.AdamW's defaults.
    fn default() -> Self {
        Self { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 1e-2 }
    }
}

/// One parameter's state.
struct Slot {
    name: String,
    var: Var,
    /// First and second moments, f32, as one `(2, N)` tensor `[m; v]` (the fused step's layout).
    state: Tensor,
    /// The f32 master of a parameter kept in another dtype (bf16): the updates go here.
    master: Option<Tensor>,
    /// Updates applied to this parameter.
    step: u64,
}

pub struct AdamW {
    params: AdamWParams,
    slots: Vec<Slot>,
}

impl AdamW {
    /// An optimiser over named variables (names must be unique: they key the saved state).
    pub fn new(vars: Vec<(String, Var)>, params: AdamWParams) -> Result<Self> {
        let mut seen = std::collections::HashSet::new();
        let mut slots = Vec::with_capacity(vars.len());
        for (name, var) in vars {
            if !seen.insert(name.clone()) {
                return Err(TrainError::Data(format!("parameter `{name}` is given twice to the optimiser")));
            }
            let state = Tensor::zeros((2, var.elem_count()), DType::F32, var.device())?;
            let master = (var.dtype() != DType::F32).then(|| var.as_tensor().to_dtype(DType::F32)).transpose()?;
            slots.push(Slot { name, state, master, var, step: 0 });
        }
        Ok(Self { params, slots })
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The variables in optimiser order.
    pub fn vars(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.slots.iter().map(|s| (s.name.as_str(), &s.var))
    }

    /// Whether every parameter is finite: `0 * x` is 0 for a finite `x` and NaN otherwise, so its sum
    /// cannot overflow on large but finite weights.
    pub fn all_finite(&self) -> Result<bool> {
        for s in &self.slots {
            let t = s.var.as_tensor().to_dtype(DType::F32)?;
            if t.affine(0.0, 0.0)?.sum_all()?.to_scalar::<f32>()? != 0.0 {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// One update with learning rate `lr`; `grads[i]` is the gradient of the `i`-th variable (None: no
    /// gradient this step).
    pub fn step(&mut self, grads: &[Option<Tensor>], lr: f64) -> Result<()> {
        if grads.len() != self.slots.len() {
            return Err(TrainError::Data(format!("{} gradients for {} parameters", grads.len(), self.slots.len())));
        }
        let AdamWParams { beta1, beta2, eps, weight_decay } = self.params;
        for (s, g) in self.slots.iter_mut().zip(grads) {
            let Some(g) = g else { continue };
            s.step += 1;
            let g = g.to_dtype(DType::F32)?;
            let p = match &s.master {
                Some(master) => master.clone(),
                None => s.var.as_tensor().to_dtype(DType::F32)?,
            };
            let hp = AdamWStep { lr, beta1, beta2, eps, weight_decay, step: s.step };
            // (3, N): [p; m; v]; the moments and a master stay views of it (no copy).
            let out = ops::adamw_step(&p, &g, &s.state, &hp)?;
            let p = out.get(0)?.reshape(s.var.shape())?;
            s.state = out.narrow(0, 1, 2)?;
            s.var.set(&p.to_dtype(s.var.dtype())?)?;
            if s.master.is_some() {
                s.master = Some(p);
            }
        }
        Ok(())
    }

    /// Writes the state (`<name>.exp_avg`, `<name>.exp_avg_sq`, `<name>.step`, and `<name>.master` for a
    /// parameter with an f32 master) as safetensors.
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut t = HashMap::new();
        for s in &self.slots {
            let moment = |i: usize| s.state.get(i)?.reshape(s.var.shape())?.to_device(&Device::Cpu);
            t.insert(format!("{}.exp_avg", s.name), moment(0)?);
            t.insert(format!("{}.exp_avg_sq", s.name), moment(1)?);
            t.insert(format!("{}.step", s.name), Tensor::new(&[s.step as i64], &Device::Cpu)?);
            if let Some(master) = &s.master {
                t.insert(format!("{}.master", s.name), master.to_device(&Device::Cpu)?);
            }
        }
        candle_core::safetensors::save(&t, path)
            .map_err(|e| TrainError::Checkpoint { path: path.into(), reason: format!("cannot write: {e}") })
    }

    /// Reads a state written by [`Self::save`] for the same parameters (names and shapes must match).
    pub fn load(&mut self, path: &Path) -> Result<()> {
        let err = |reason: String| TrainError::Checkpoint { path: path.into(), reason };
        let t = candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| err(format!("cannot read: {e}")))?;
        let want = 3 * self.slots.len() + self.slots.iter().filter(|s| s.master.is_some()).count();
        if t.len() != want {
            return Err(err(format!(
                "{} tensors for {} parameters (3 each, and an f32 master for each of another dtype): {want} expected",
                t.len(),
                self.slots.len()
            )));
        }
        for s in &mut self.slots {
            let get = |k: &str| t.get(&format!("{}.{k}", s.name)).ok_or_else(|| err(format!("no `{}.{k}`", s.name)));
            let (m, v) = (get("exp_avg")?, get("exp_avg_sq")?);
            if m.dims() != s.var.dims() || v.dims() != s.var.dims() {
                return Err(err(format!(
                    "`{}` has moments of shape {:?} but the parameter is {:?}",
                    s.name,
                    m.dims(),
                    s.var.dims()
                )));
            }
            let dev = s.var.device();
            s.state = Tensor::stack(&[m.flatten_all()?, v.flatten_all()?], 0)?.to_dtype(DType::F32)?.to_device(dev)?;
            s.step = get("step")?.to_vec1::<i64>()?.first().copied().unwrap_or(0) as u64;
            if s.master.is_some() {
                s.master = Some(get("master")?.to_dtype(DType::F32)?.to_device(dev)?);
            }
        }
        Ok(())
    }
}

/// Linear warmup then cosine decay to `peak * min_ratio`, over `total` optimiser steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Schedule {
    pub peak: f64,
    pub warmup: usize,
    pub total: usize,
    pub min_ratio: f64,
}

impl Schedule {
    /// The learning rate of optimiser step `step` (0-based).
    pub fn lr(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.peak * step as f64 / self.warmup.max(1) as f64;
        }
        let progress = (step - self.warmup) as f64 / self.total.saturating_sub(self.warmup).max(1) as f64;
        let cosine = (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0);
        self.peak * (self.min_ratio + (1.0 - self.min_ratio) * cosine)
    }
}

/// The global L2 norm of all gradients (per-tensor f32 sums of squares, added in f64), and, when
/// `max_norm > 0` and the norm exceeds it, every gradient scaled by `max_norm / (norm + 1e-6)` as
/// torch's `clip_grad_norm_` does. Returns the norm before clipping. The sums stay on the gradients'
/// device until the one read of their total: a single host sync per step, not one per tensor.
pub fn clip_grad_norm(grads: &mut [Option<Tensor>], max_norm: f64) -> Result<f64> {
    // (n_tensors) f64: each tensor's sum of squares, in f32 as before, widened for the total.
    let sums = grads
        .iter()
        .flatten()
        .map(|g| g.to_dtype(DType::F32)?.sqr()?.sum_all()?.to_dtype(DType::F64)?.reshape(1))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let sq = match sums.is_empty() {
        true => 0.0,
        false => Tensor::cat(&sums, 0)?.sum_all()?.to_scalar::<f64>()?,
    };
    let norm = sq.sqrt();
    if max_norm > 0.0 && norm.is_finite() {
        let coef = max_norm / (norm + 1e-6);
        if coef < 1.0 {
            for g in grads.iter_mut().flatten() {
                *g = (&*g * coef)?;
            }
        }
    }
    Ok(norm)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_nn::Optimizer;

    fn var(v: &[f64]) -> Var {
        Var::from_tensor(&Tensor::new(v, &Device::Cpu).unwrap()).unwrap()
    }

    fn values(v: &Var) -> Vec<f64> {
        v.as_tensor().to_dtype(DType::F64).unwrap().to_vec1().unwrap()
    }

    #[test]
    fn one_step_matches_the_hand_computed_update() {
        let p = AdamWParams { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };
        let x = var(&[1.0, -2.0]);
        let mut opt = AdamW::new(vec![("x".into(), x.clone())], p).unwrap();
        let g = Tensor::new(&[0.5f64, -0.25], &Device::Cpu).unwrap();
        opt.step(&[Some(g)], 0.01).unwrap();
        // Step 1: m = 0.1 g, v = 0.001 g^2, m_hat = g, v_hat = g^2, so the update is lr * g / (|g| + eps)
        // = lr * sign(g) (up to eps), after the decay p (1 - lr wd).
        let want = |p0: f64, g: f64| p0 * (1.0 - 0.01 * 0.1) - 0.01 * g / (g.abs() + 1e-8);
        let got = values(&x);
        for (i, (p0, g)) in [(1.0, 0.5), (-2.0, -0.25)].into_iter().enumerate() {
            // f32 arithmetic inside: 1e-6 absolute is a few ulps at these magnitudes.
            assert!((got[i] - want(p0, g)).abs() < 1e-6, "{i}: {} vs {}", got[i], want(p0, g));
        }
    }

    #[test]
    fn matches_candle_nn_adamw_over_several_steps() {
        let p = AdamWParams { beta1: 0.8, beta2: 0.95, eps: 1e-6, weight_decay: 0.05 };
        let init = [0.3, -1.2, 2.5, 0.0, -0.7];
        let (ours, theirs) = (var(&init), var(&init));
        let mut a = AdamW::new(vec![("w".into(), ours.clone())], p).unwrap();
        let params = candle_nn::ParamsAdamW { lr: 0.03, beta1: 0.8, beta2: 0.95, eps: 1e-6, weight_decay: 0.05 };
        let mut b = candle_nn::AdamW::new(vec![theirs.clone()], params).unwrap();
        for step in 0..5 {
            // A quadratic loss sum((w - c)^2) with gradient 2 (w - c), the same for both.
            let c = Tensor::new(&[1.0f64, 0.5, -0.5, 2.0, 0.1], &Device::Cpu).unwrap();
            let loss_b = theirs.as_tensor().sub(&c).unwrap().sqr().unwrap().sum_all().unwrap();
            let grads = loss_b.backward().unwrap();
            let g = ((ours.as_tensor() - &c).unwrap() * 2.0).unwrap();
            a.step(&[Some(g)], 0.03).unwrap();
            b.step(&grads).unwrap();
            // Ours runs in f32 (the moments are f32), candle-nn in f64: 1e-6 covers f32 rounding at |w| < 3.
            for (x, y) in values(&ours).iter().zip(values(&theirs)) {
                assert!((x - y).abs() < 1e-6, "step {step}: {x} vs {y}");
            }
        }
    }

    /// The update as candle ops, as the optimiser ran it before the fused op: the twin it must equal.
    fn unfused_step(p: &Tensor, g: &Tensor, m: &mut Tensor, v: &mut Tensor, hp: &AdamWStep) -> Tensor {
        let p = if hp.weight_decay != 0.0 { p.affine(1.0 - hp.lr * hp.weight_decay, 0.0).unwrap() } else { p.clone() };
        // lerp(m, g, 1 - b1) = m + (1 - b1) (g - m), as torch's `exp_avg.lerp_`.
        *m = (&*m + ((g - &*m).unwrap() * (1.0 - hp.beta1)).unwrap()).unwrap();
        *v = ((&*v * hp.beta2).unwrap() + (g.sqr().unwrap() * (1.0 - hp.beta2)).unwrap()).unwrap();
        let bc1 = 1.0 - hp.beta1.powi(hp.step as i32);
        let bc2_sqrt = (1.0 - hp.beta2.powi(hp.step as i32)).sqrt();
        let denom = ((v.sqrt().unwrap() / bc2_sqrt).unwrap() + hp.eps).unwrap();
        (p - ((&*m / denom).unwrap() * (hp.lr / bc1)).unwrap()).unwrap()
    }

    /// Fusing changes no bit: ten steps of the optimiser equal ten steps of the candle ops it replaced, with
    /// and without weight decay, on f32 values of mixed signs and sizes.
    #[test]
    fn the_fused_step_is_the_candle_update_bitwise() {
        for weight_decay in [0.0, 0.05] {
            let params = AdamWParams { beta1: 0.9, beta2: 0.98, eps: 1e-7, weight_decay };
            let init: Vec<f32> = (0..37).map(|i| ((i * 7919 % 101) as f32 - 50.0) * 0.03).collect();
            let x = Var::from_tensor(&Tensor::new(init.as_slice(), &Device::Cpu).unwrap()).unwrap();
            let mut opt = AdamW::new(vec![("x".into(), x.clone())], params).unwrap();
            let (mut p, mut m, mut v) =
                (x.as_tensor().copy().unwrap(), x.zeros_like().unwrap(), x.zeros_like().unwrap());
            for step in 1..=10u64 {
                // A gradient that changes with the parameter: sin(3 p) + 0.1.
                let g = ((p.clone() * 3.0).unwrap().sin().unwrap() + 0.1).unwrap();
                let lr = 1e-2 / step as f64;
                opt.step(&[Some(g.clone())], lr).unwrap();
                let hp = AdamWStep { lr, beta1: 0.9, beta2: 0.98, eps: 1e-7, weight_decay, step };
                p = unfused_step(&p, &g, &mut m, &mut v, &hp);
                let bits = |t: &Tensor| t.to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(x.as_tensor()), bits(&p), "wd {weight_decay} step {step}: the parameter");
                assert_eq!(bits(&opt.slots[0].state.get(0).unwrap()), bits(&m), "wd {weight_decay} step {step}: m");
                assert_eq!(bits(&opt.slots[0].state.get(1).unwrap()), bits(&v), "wd {weight_decay} step {step}: v");
            }
        }
    }

    #[test]
    fn a_parameter_without_gradient_is_untouched() {
        let (x, y) = (var(&[1.0]), var(&[1.0]));
        let mut opt =
            AdamW::new(vec![("x".into(), x.clone()), ("y".into(), y.clone())], AdamWParams::default()).unwrap();
        opt.step(&[Some(Tensor::new(&[1.0f64], &Device::Cpu).unwrap()), None], 0.1).unwrap();
        assert_eq!(values(&y), [1.0]);
        assert!(values(&x)[0] < 1.0);
        assert_eq!(opt.slots[1].step, 0);
    }

    /// A bf16 parameter follows the f32 run through its master: the master is the f32 run's parameter
    /// bitwise (the same f32 arithmetic on the same values), and the weight is its bf16 rounding. The
    /// updates (about lr = 1e-4 each) are far below half a bf16 ulp at 1.0 (2^-8), so a weight updated
    /// in bf16 itself would never move.
    #[test]
    fn a_bf16_parameter_keeps_an_f32_master() {
        let p = AdamWParams::default();
        let init = Tensor::new(&[1.0f32, -0.5, 2.0], &Device::Cpu).unwrap();
        let (f32_var, bf16_var) =
            (Var::from_tensor(&init).unwrap(), Var::from_tensor(&init.to_dtype(DType::BF16).unwrap()).unwrap());
        let mut a = AdamW::new(vec![("w".into(), f32_var.clone())], p).unwrap();
        let mut b = AdamW::new(vec![("w".into(), bf16_var.clone())], p).unwrap();
        let g = Tensor::new(&[0.3f32, -0.2, 0.1], &Device::Cpu).unwrap();
        for _ in 0..100 {
            a.step(&[Some(g.clone())], 1e-4).unwrap();
            b.step(&[Some(g.to_dtype(DType::BF16).unwrap())], 1e-4).unwrap();
        }
        let master = b.slots[0].master.as_ref().unwrap().to_vec1::<f32>().unwrap();
        // g is not bf16-exact: the bf16 run's gradient differs, but Adam's update is nearly sign(g) lr.
        let ours: Vec<f32> = f32_var.as_tensor().to_vec1().unwrap();
        for (m, w) in master.iter().zip(&ours) {
            assert!((m - w).abs() < 1e-6, "master {m} vs f32 run {w}");
        }
        assert!((master[0] - (1.0 - 100.0 * 1e-4 * (1.0 + 1e-2))).abs() < 1e-4, "moved by the steps: {master:?}");
        let weight = bf16_var.as_tensor().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        let rounded = b.slots[0].master.as_ref().unwrap().to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
        assert_eq!(weight, rounded.to_vec1::<f32>().unwrap(), "the weight is the master's rounding");
        assert_ne!(weight[0], 1.0, "a hundred updates of 1e-4 moved the bf16 weight");
        // The master travels with the saved state.
        let path = std::env::temp_dir().join(format!("askgui-train-master-{}.safetensors", std::process::id()));
        b.save(&path).unwrap();
        let mut c = AdamW::new(vec![("w".into(), bf16_var.clone())], p).unwrap();
        c.load(&path).unwrap();
        assert_eq!(c.slots[0].master.as_ref().unwrap().to_vec1::<f32>().unwrap(), master);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn schedule_values_at_known_points() {
        let s = Schedule { peak: 1e-3, warmup: 10, total: 110, min_ratio: 0.0 };
        let close = |a: f64, b: f64| (a - b).abs() < 1e-15;
        assert!(close(s.lr(0), 0.0));
        assert!(close(s.lr(5), 5e-4));
        assert!(close(s.lr(10), 1e-3));
        assert!(close(s.lr(60), 5e-4), "half way through the cosine: {}", s.lr(60));
        assert!(close(s.lr(110), 0.0));
        let floor = Schedule { min_ratio: 0.1, ..s };
        assert!(close(floor.lr(60), 1e-3 * (0.1 + 0.9 * 0.5)));
        assert!(close(floor.lr(110), 1e-4));
        let flat = Schedule { peak: 2.0, warmup: 0, total: 4, min_ratio: 0.0 };
        let want = [2.0, 2.0 * (0.5 + 0.5 * std::f64::consts::FRAC_PI_4.cos()), 1.0];
        for (i, w) in want.into_iter().enumerate() {
            assert!(close(flat.lr(i), w), "{i}: {} vs {w}", flat.lr(i));
        }
    }

    #[test]
    fn finiteness_of_the_parameters() {
        let x = var(&[1e30, -3.0]);
        let opt = AdamW::new(vec![("x".into(), x.clone())], AdamWParams::default()).unwrap();
        assert!(opt.all_finite().unwrap(), "large is not infinite");
        for bad in [f64::NAN, f64::INFINITY] {
            x.set(&Tensor::new(&[bad, 0.0], &Device::Cpu).unwrap()).unwrap();
            assert!(!opt.all_finite().unwrap());
        }
    }

    #[test]
    fn clipping_scales_to_the_max_norm() {
        let t = |v: &[f32]| Some(Tensor::new(v, &Device::Cpu).unwrap());
        let mut g = vec![t(&[3.0]), None, t(&[0.0, 4.0])];
        let n = clip_grad_norm(&mut g, 1.0).unwrap();
        assert!((n - 5.0).abs() < 1e-6);
        let after = clip_grad_norm(&mut g, 0.0).unwrap();
        assert!((after - 1.0).abs() < 1e-5, "{after}");
        let mut small = vec![t(&[0.3])];
        clip_grad_norm(&mut small, 1.0).unwrap();
        assert_eq!(small[0].as_ref().unwrap().to_vec1::<f32>().unwrap(), [0.3]);
    }

    #[test]
    fn state_round_trips_through_safetensors() {
        let dir = std::env::temp_dir().join(format!("askgui-train-optim-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("optimizer.safetensors");
        let run = |resume_at: Option<usize>| -> Vec<f64> {
            let x = var(&[0.5, -0.5, 1.5]);
            let mut opt = AdamW::new(vec![("x".into(), x.clone())], AdamWParams::default()).unwrap();
            for i in 0..6 {
                if resume_at == Some(i) {
                    opt.save(&path).unwrap();
                    let snapshot = x.as_tensor().copy().unwrap();
                    let x2 = Var::from_tensor(&snapshot).unwrap();
                    let mut fresh = AdamW::new(vec![("x".into(), x2.clone())], AdamWParams::default()).unwrap();
                    fresh.load(&path).unwrap();
                    opt = fresh;
                }
                let g = (opt.slots[0].var.as_tensor() * 2.0).unwrap();
                opt.step(&[Some(g)], 0.05).unwrap();
            }
            values(&opt.slots[0].var)
        };
        assert_eq!(run(None), run(Some(3)), "a saved and reloaded state continues bitwise identically");
        let mut other = AdamW::new(vec![("y".into(), var(&[1.0, 2.0, 3.0]))], AdamWParams::default()).unwrap();
        assert!(other.load(&path).unwrap_err().to_string().contains("no `y.exp_avg`"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
