//! The spec of the fused AdamW step: torch.optim.AdamW's single-tensor update in f32, operation for
//! operation in the order askgui's optimiser has always run it with candle ops (`askgui-train`'s
//! `optim.rs`, whose unfused twin is kept there and tested bitwise against this), so fusing changes no bit:
//!
//! ```text
//! p <- p * (1 - lr wd) + 0                       (skipped when wd = 0)
//! m <- m + ((g - m) * (1 - b1) + 0)
//! v <- (v * b2 + 0) + ((g * g) * (1 - b2) + 0)
//! p <- p - ((m / ((sqrt(v) * (1 / sqrt(1 - b2^t)) + 0) * 1 + eps)) * (lr / (1 - b1^t)) + 0)
//! ```
//!
//! Every constant is rounded to f32 once, as candle's `affine` rounds its scalars; each operation rounds
//! once (no fused multiply-add: the CUDA kernel uses the `__f*_rn` intrinsics). The `+ 0` terms are
//! candle's affine offsets: they turn a `-0` into `+0`, so they are kept. The op is `ops::adamw_step`, its
//! CUDA kernel `cuda/adamw.cu`.

/// The step's hyper-parameters, and the parameter's step count after this update (bias corrections).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// This update's number, from 1.
    pub step: u64,
}

/// The f32 constants of a step, as the kernels take them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConsts {
    /// `1 - lr wd`; `None` when `wd = 0` (no decay term at all).
    pub decay: Option<f32>,
    pub one_minus_b1: f32,
    pub b2: f32,
    pub one_minus_b2: f32,
    /// `1 / sqrt(1 - b2^t)`.
    pub inv_bc2_sqrt: f32,
    pub eps: f32,
    /// `lr / (1 - b1^t)`.
    pub step_size: f32,
}

impl AdamWStep {
    pub fn consts(&self) -> AdamWConsts {
        let t = self.step.min(i32::MAX as u64) as i32;
        let bc1 = 1.0 - self.beta1.powi(t);
        let bc2_sqrt = (1.0 - self.beta2.powi(t)).sqrt();
        AdamWConsts {
            decay: (self.weight_decay != 0.0).then_some((1.0 - self.lr * self.weight_decay) as f32),
            one_minus_b1: (1.0 - self.beta1) as f32,
            b2: self.beta2 as f32,
            one_minus_b2: (1.0 - self.beta2) as f32,
            inv_bc2_sqrt: (1.0 / bc2_sqrt) as f32,
            eps: self.eps as f32,
            step_size: (self.lr / bc1) as f32,
        }
    }
}

/// One element's update: `(p, m, v)` after the step with gradient `g`.
#[inline(always)]
pub fn adamw_element(c: &AdamWConsts, p: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
    let p = match c.decay {
        Some(d) => p * d + 0.0,
        None => p,
    };
    let m = m + ((g - m) * c.one_minus_b1 + 0.0);
    let v = (v * c.b2 + 0.0) + ((g * g) * c.one_minus_b2 + 0.0);
    let denom = (v.sqrt() * c.inv_bc2_sqrt + 0.0) * 1.0 + c.eps;
    let p = p - ((m / denom) * c.step_size + 0.0);
    (p, m, v)
}

/// The reference: the step over whole slices, element by element.
pub fn adamw_reference(c: &AdamWConsts, p: &[f32], g: &[f32], m: &[f32], v: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (mut po, mut mo, mut vo) =
        (Vec::with_capacity(p.len()), Vec::with_capacity(p.len()), Vec::with_capacity(p.len()));
    for i in 0..p.len() {
        let (a, b, d) = adamw_element(c, p[i], g[i], m[i], v[i]);
        po.push(a);
        mo.push(b);
        vo.push(d);
    }
    (po, mo, vo)
}
