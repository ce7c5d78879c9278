//! `--device auto|cpu|cuda`, `--dtype auto|f32|bf16` and `--kernels askgui|reference`: where a binary
//! (trainer, server, evaluator) runs the model, in which weight dtype, and through which ops, chosen once
//! at start ([`LoadOptions`]). By default the CPU runs f32 weights and a CUDA GPU bf16 weights with f32
//! math in the kernels (trainable adapters keep f32 masters, [`crate::master_dtype`]); `--dtype` overrides
//! that. `--kernels reference` runs the plain-candle twins of askgui's CustomOps everywhere (as
//! transformers' `attn_implementation="eager"`): slower and hungrier, but independent of our CUDA code,
//! so a lab whose GPU trips a kernel is not blocked. One place, so that every binary picks alike.

use candle_core::{DType, Device};
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// The device option of the binaries.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    /// The first CUDA GPU when the binary is built with `--features cuda` and one is present, else the CPU.
    #[default]
    Auto,
    Cpu,
    /// The first CUDA GPU; an error when the binary has no CUDA support or the machine no GPU.
    Cuda,
}

impl DeviceKind {
    /// The device and the dtype its weights are kept in. `Auto` falls back to the CPU with a warning that
    /// says why; `Cuda` fails with an error that says what to do.
    pub fn pick(self) -> Result<(Device, DType)> {
        self.pick_with(DTypeChoice::Auto)
    }

    /// [`Self::pick`] with the weight dtype `dtype` instead of the device's default where it names one.
    pub fn pick_with(self, dtype: DTypeChoice) -> Result<(Device, DType)> {
        self.pick_on(dtype, 0)
    }

    /// [`Self::pick_with`] on the CUDA GPU `ordinal` (a data-parallel rank's own GPU) instead of the first.
    pub fn pick_on(self, dtype: DTypeChoice, ordinal: usize) -> Result<(Device, DType)> {
        let device = match self {
            DeviceKind::Cpu => Device::Cpu,
            DeviceKind::Cuda => Device::new_cuda(ordinal).map_err(|e| {
                ModelError::Device(format!(
                    "cuda:{ordinal}: {e} (use a binary built with `--features cuda`, on a machine with an NVIDIA GPU)"
                ))
            })?,
            DeviceKind::Auto => match Device::cuda_if_available(ordinal) {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!("no usable CUDA device ({e}); running on the CPU");
                    Device::Cpu
                }
            },
        };
        let dtype = match dtype {
            DTypeChoice::Auto if device.is_cuda() => DType::BF16,
            DTypeChoice::Auto | DTypeChoice::F32 => DType::F32,
            DTypeChoice::Bf16 => DType::BF16,
        };
        Ok((device, dtype))
    }
}

/// Makes `device`'s CUDA context current on this thread; nothing on the CPU. cudarc binds it before it
/// allocates or copies, but not before every kernel launch or cuBLAS call, so a thread other than the one
/// that opened the device fails those with `CUDA_ERROR_INVALID_CONTEXT` (seen on an H100: the server's job
/// threads). Every thread that computes on a model it did not load calls this first; it is cheap (one
/// driver query when the context is already current).
pub fn bind_thread(device: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        d.cuda_stream()
            .context()
            .bind_to_thread()
            .map_err(|e| ModelError::Device(format!("making the CUDA context current on this thread: {e:?}")))?;
    }
    #[cfg(not(feature = "cuda"))]
    let _ = device;
    Ok(())
}

/// The weight dtype option of the binaries.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum DTypeChoice {
    /// bf16 on a CUDA GPU, f32 on the CPU.
    #[default]
    Auto,
    F32,
    Bf16,
}

/// Weight-only quantisation of the linear layers (serve's `--quantize`).
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Quantize {
    /// The weights in `--dtype`.
    #[default]
    None,
    /// Every linear of the vision tower and the decoder in int8 with one f32 scale per output row (a
    /// quarter of f32's bytes), f32 accumulation; embeddings, norms and `lm_head` stay in `--dtype`. CPU only.
    Int8,
}

/// Which implementation of the model's ops runs (transformers' `attn_implementation`, for every op).
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum KernelChoice {
    /// askgui's CustomOps (CPU and CUDA kernels with explicit backward) where they take the device and
    /// dtype, the plain-candle references elsewhere.
    #[default]
    Askgui,
    /// The plain-candle references everywhere, inference and training (candle's autograd): slower and
    /// more memory, independent of askgui's kernels.
    Reference,
}

impl KernelChoice {
    /// How the choice reads in the log and in error messages.
    pub fn describe(self) -> &'static str {
        match self {
            KernelChoice::Askgui => "askgui (CustomOps)",
            KernelChoice::Reference => "reference (plain candle)",
        }
    }
}

/// How a binary loads its model: the three options, resolved together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoadOptions {
    pub device: DeviceKind,
    pub dtype: DTypeChoice,
    pub kernels: KernelChoice,
}

impl LoadOptions {
    /// The device and weight dtype ([`DeviceKind::pick_with`]).
    pub fn resolve(&self) -> Result<(Device, DType)> {
        self.device.pick_with(self.dtype)
    }
}

/// Fixes the CPU thread count for the whole process: sets `RAYON_NUM_THREADS` to candle's own default
/// (the physical cores) unless it already holds a positive count, and returns the count. Call it first
/// thing in `main`, before any thread starts.
///
/// Why: candle 0.11 counts its threads at every CPU matmul and, without that variable, counts the
/// physical cores by reading and parsing `/proc/cpuinfo` (about 30 µs, hundreds of times per generated
/// action of a small model). Measured on a 2-core CPU: evaluating the demo's agent on 40 episodes took
/// 3.8 s without the variable and 1.6 s with it, with the same predictions. Rayon's pool, which runs
/// the matmuls' and the attention's parallel work, then has the size candle's matmuls ask for.
pub fn pin_cpu_threads() -> usize {
    let set = std::env::var("RAYON_NUM_THREADS").ok().and_then(|v| v.parse::<usize>().ok()).filter(|&n| n > 0);
    if set.is_none() {
        std::env::set_var("RAYON_NUM_THREADS", candle_core::utils::get_num_threads().to_string());
    }
    candle_core::utils::get_num_threads()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_is_f32_and_auto_falls_back_without_a_gpu() {
        let (d, t) = DeviceKind::Cpu.pick().unwrap();
        assert!(matches!(d, Device::Cpu) && t == DType::F32);
        if !cfg!(feature = "cuda") {
            let (d, t) = DeviceKind::Auto.pick().unwrap();
            assert!(matches!(d, Device::Cpu) && t == DType::F32);
            let e = DeviceKind::Cuda.pick().unwrap_err().to_string();
            assert!(e.contains("--features cuda"), "{e}");
        }
    }

    #[test]
    fn an_explicit_dtype_overrides_the_device_default() {
        let (_, t) = DeviceKind::Cpu.pick_with(DTypeChoice::Bf16).unwrap();
        assert_eq!(t, DType::BF16);
        let o = LoadOptions { device: DeviceKind::Cpu, dtype: DTypeChoice::F32, ..Default::default() };
        assert_eq!(o.resolve().unwrap().1, DType::F32);
        assert_eq!(o.kernels, KernelChoice::Askgui);
    }
}
