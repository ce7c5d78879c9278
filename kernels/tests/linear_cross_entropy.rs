//! The fused LM-head loss (`ops::linear_cross_entropy`) against the full logits and the reference
//! cross-entropy: the loss and every gradient, at several chunk sizes, and the peak memory of both paths
//! on the CPU (this binary counts its heap allocations; its tests run one at a time so that the count is
//! one path's).

mod common;

use anyhow::{ensure, Result};
use askgui_kernels::ops::linear_cross_entropy::chunk_rows;
use askgui_kernels::ops::{cross_entropy_masked, frozen_linear, linear_cross_entropy, linear_cross_entropy_reference};
use candle_core::{DType, Device, Tensor, Var};
use common::tensor;
use common::tol::{compare_tensors, Tol, BF16, REF_F32};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;

/// The system allocator, counting the bytes it holds and their peak.
struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            PEAK.fetch_max(LIVE.fetch_add(layout.size(), Relaxed) + layout.size(), Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        System.dealloc(p, layout);
        LIVE.fetch_sub(layout.size(), Relaxed);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// One test at a time: the peak count must be one path's alone.
static SERIAL: Mutex<()> = Mutex::new(());

/// f64 on both sides: the same products summed in other orders (GEMM blocking, chunk partial sums), about
/// 1e-16 relative per operation over sums of at most a few hundred terms.
const F64_REF: Tol = Tol { atol: 1e-12, rtol: 1e-12 };

/// `(h (N, H), w (V, H), labels (N))`, logits of a few units so that the softmax is far from uniform.
fn inputs(n: usize, d: usize, v: usize, dtype: DType) -> Result<(Tensor, Tensor, Tensor)> {
    let labels: Vec<u32> = (0..n).map(|i| (i * 7919 % v) as u32).collect();
    Ok(((tensor(&[n, d], 3, dtype)? * 2.0)?, (tensor(&[v, d], 4, dtype)? * 2.0)?, Tensor::new(labels, &Device::Cpu)?))
}

#[test]
fn loss_and_gradients_equal_the_full_logits_at_every_chunk_size() -> Result<()> {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (n, d, v) = (37, 16, 203);
    for (dtype, tol) in [(DType::F64, F64_REF), (DType::F32, REF_F32)] {
        let (h, w, labels) = inputs(n, d, v, dtype)?;
        let (hv, wv) = (Var::from_tensor(&h)?, Var::from_tensor(&w)?);
        let want = linear_cross_entropy_reference(&hv, &wv, &labels)?;
        let grads = (&want * 1.7)?.backward()?;
        // Chunks of one row, uneven, the default (a power of two), and wider than the batch.
        for chunk in [Some(1), Some(5), None, Some(64)] {
            let label = format!("{dtype:?} chunk {chunk:?}");
            let got = linear_cross_entropy(&hv, &wv, &labels, chunk)?;
            compare_tensors(&format!("{label} loss"), &got, &want, tol)?;
            let g = (&got * 1.7)?.backward()?;
            for (name, var) in [("dh", &hv), ("dw", &wv)] {
                let (a, b) = (g.get(var).expect("a gradient"), grads.get(var).expect("a gradient"));
                compare_tensors(&format!("{label} {name}"), a, b, tol)?;
            }
        }
        // A frozen head: the gradient of h alone, and none kept for w.
        let got = linear_cross_entropy(&hv, &w, &labels, Some(5))?;
        let g = got.backward()?;
        ensure!(g.get(&w).is_none(), "a frozen w got a gradient");
        compare_tensors(&format!("{dtype:?} frozen dh"), g.get(&hv).unwrap(), &(grads.get(&hv).unwrap() / 1.7)?, tol)?;
        // Without any gradient to track, the value alone.
        let plain = linear_cross_entropy(&h, &w, &labels, Some(5))?;
        ensure!(!plain.track_op(), "nothing to differentiate, yet the loss has a graph");
        compare_tensors(&format!("{dtype:?} no-grad loss"), &plain, &want, tol)?;
    }
    Ok(())
}

/// In bf16 the fused path is the unfused bf16 path (`frozen_linear`, then the masked cross-entropy) chunk
/// by chunk: the same logits rounded once, the same `(softmax - onehot) / N` rounded once. The chunk losses
/// are bf16 values summed in f32, one more rounding of at most 2^-9 relative: [`BF16`] covers both.
#[test]
fn bf16_equals_the_unfused_bf16_path() -> Result<()> {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (h, w, labels) = inputs(29, 32, 301, DType::BF16)?;
    let hv = Var::from_tensor(&h)?;
    let ones = Tensor::ones(29, DType::BF16, &Device::Cpu)?;
    let want = cross_entropy_masked(&frozen_linear(&hv, &w)?, &labels, &ones)?;
    let got = linear_cross_entropy(&hv, &w, &labels, Some(4))?;
    compare_tensors("bf16 loss", &got, &want, BF16)?;
    let (g, g_ref) = (got.backward()?, want.backward()?);
    compare_tensors("bf16 dh", g.get(&hv).unwrap(), g_ref.get(&hv).unwrap(), BF16)
}

/// The peak heap bytes of `f` above what was live before it.
fn peak_of(f: impl FnOnce() -> Result<()>) -> Result<usize> {
    let base = LIVE.load(Relaxed);
    PEAK.store(base, Relaxed);
    f()?;
    Ok(PEAK.load(Relaxed) - base)
}

/// The unfused path must hold the `(N, V)` logits (and their gradient). The fused one holds, besides its
/// inputs: one weight-sized buffer (the CPU GEMM packs `w`), `dh` twice (kept, then scaled by the upstream
/// gradient) and at most four chunk-sized `(C, V)` buffers (logits, gradient, and the two ops' scratch).
/// That bound is derived from the shapes, and these shapes put it under a quarter of the logits.
#[test]
fn the_fused_path_never_holds_the_logits() -> Result<()> {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (n, d, v) = (1024, 32, 4096);
    let (h, w, labels) = inputs(n, d, v, DType::F32)?;
    let hv = Var::from_tensor(&h)?;
    let ones = Tensor::ones(n, DType::F32, &Device::Cpu)?;
    let logits_bytes = n * v * 4;
    let chunk = chunk_rows(n, d, v);
    let bound = v * d * 4 + 2 * n * d * 4 + 4 * chunk * v * 4;
    ensure!(bound < logits_bytes / 4, "the shapes do not separate the paths: bound {bound} B");
    let unfused = || {
        let loss = cross_entropy_masked(&frozen_linear(&hv, &w)?, &labels, &ones)?;
        drop(loss.backward()?);
        Ok(())
    };
    let fused = || {
        let loss = linear_cross_entropy(&hv, &w, &labels, None)?;
        drop(loss.backward()?);
        Ok(())
    };
    // A process's first GEMMs also allocate buffers that live on (several MB, once): each path runs once
    // before it is measured.
    let (_, unfused) = (peak_of(unfused)?, peak_of(unfused)?);
    let (_, fused) = (peak_of(fused)?, peak_of(fused)?);
    eprintln!(
        "peak heap above the inputs, forward + backward, h ({n}, {d}) w ({v}, {d}) f32, chunk {chunk}: \
         unfused {unfused} B, fused {fused} B (logits {logits_bytes} B)"
    );
    ensure!(unfused >= logits_bytes, "the unfused path peaked at {unfused} B, under its logits' {logits_bytes} B");
    ensure!(fused <= bound, "the fused path peaked at {fused} B, over its bound of {bound} B");
    Ok(())
}

#[test]
fn bad_inputs_are_refused_with_their_shapes() -> Result<()> {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (h, w, labels) = inputs(4, 8, 10, DType::F32)?;
    let err = |r: candle_core::Result<Tensor>| r.err().map(|e| e.to_string()).unwrap_or_default();
    let e = err(linear_cross_entropy(&h, &w.narrow(1, 0, 7)?, &labels, None));
    ensure!(e.contains("[4, 8]") && e.contains("[10, 7]"), "mismatched widths: {e}");
    let e = err(linear_cross_entropy(&h.narrow(0, 0, 0)?, &w, &labels.narrow(0, 0, 0)?, None));
    ensure!(e.contains("no row"), "no rows: {e}");
    let bad = Tensor::new(&[0u32, 1, 10, 2], &Device::Cpu)?;
    let e = err(linear_cross_entropy(&h, &w, &bad, None));
    ensure!(e.contains("label 10") && e.contains("vocabulary of 10"), "label past the vocabulary: {e}");
    Ok(())
}
