//! The CUDA path, executed on the CPU: every op's launch plan run by the CPU executor (`askgui_kernels::emu`,
//! the `cuda/*.cu` kernels compiled by the host C++ compiler) and compared with the CPU ops, which are
//! tested against the plain-candle references and finite differences in `tests/grad_*.rs`.
//!
//! Each plan is built for a device's capabilities; attention runs with sm_90's (232,448 bytes of opt-in
//! shared memory) and with sm_86/sm_89's (101,376), so both variants a plan can choose run. Threads run in
//! forward, reverse and seeded random order between barriers. `planted` applies one bug of each kind the
//! executor must catch to a copy of the kernels or to a plan, and checks the message.
//!
//! Run: `cargo test -p askgui-kernels --features cpu-exec --test emu -- --nocapture` (one line per
//! comparison); under AddressSanitizer and UBSan: `ASKGUI_EMU_SANITIZE=1` in the environment of the same
//! command (`.ci/emu-check` runs both).

#[path = "../common/mod.rs"]
mod common;

mod adamw;
mod attention;
mod checks;
mod cross_entropy;
mod dropout;
mod norm;
mod paged_attention;
mod planted;
mod qwen3_vl;
mod rope;
mod tiling;

use askgui_kernels::emu::{self, Options, Order};
use askgui_kernels::plan::{Caps, Elem, Plan};

/// The three thread orders, for the cases that run in all of them.
pub const ORDERS: [Order; 3] = [Order::Forward, Order::Reverse, Order::Random(0x5eed)];

/// Bytes of `v` as a device buffer of `elem` (f32 or bf16 rounded to nearest even).
pub fn to_bytes(v: &[f64], elem: Elem) -> Vec<u8> {
    match elem {
        Elem::F32 => v.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect(),
        Elem::Bf16 => v.iter().flat_map(|&x| half::bf16::from_f64(x).to_le_bytes()).collect(),
        other => panic!("to_bytes: not a float element type: {other:?}"),
    }
}

/// The values of a float device buffer.
pub fn from_bytes(b: &[u8], elem: Elem) -> Vec<f64> {
    match elem {
        Elem::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64).collect(),
        Elem::Bf16 => b.chunks_exact(2).map(|c| half::bf16::from_le_bytes(c.try_into().unwrap()).to_f64()).collect(),
        other => panic!("from_bytes: not a float element type: {other:?}"),
    }
}

/// `v` rounded to what a buffer of `elem` holds.
pub fn rounded(v: &[f64], elem: Elem) -> Vec<f64> {
    from_bytes(&to_bytes(v, elem), elem)
}

/// A CPU tensor of `v` in `elem`'s dtype (f32 or bf16): the CPU ops in bf16 are the reference the
/// executor's bf16 runs are held to (they compute in f32 and round once, like the kernels).
pub fn cpu_tensor(v: &[f64], dims: &[usize], elem: Elem) -> candle_core::Tensor {
    let dtype = if elem == Elem::Bf16 { candle_core::DType::BF16 } else { candle_core::DType::F32 };
    candle_core::Tensor::from_vec(v.to_vec(), dims, &candle_core::Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

/// The values of a CPU tensor of any float dtype.
pub fn values(t: &candle_core::Tensor) -> Vec<f64> {
    t.to_dtype(candle_core::DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

/// Runs `plan` on the CPU executor; panics with the executor's message (the test's failure) on error.
pub fn run(plan: &Plan, inputs: &[Vec<u8>], caps: Caps, order: Order) -> Vec<Vec<u8>> {
    let opts = Options { order, ..Options::new(caps) };
    let refs: Vec<&[u8]> = inputs.iter().map(|v| v.as_slice()).collect();
    match emu::run(plan, &refs, &opts) {
        Ok(out) => out,
        Err(e) => panic!("{} with {} ({order:?}): {e}", plan.op, caps.name),
    }
}

/// Collects comparison failures of one test and fails it once, with all of them.
#[derive(Default)]
pub struct Failures(Vec<String>);

impl Failures {
    pub fn check(&mut self, r: Result<(), String>) {
        if let Err(e) = r {
            self.0.push(e);
        }
    }

    pub fn finish(self, test: &str) {
        assert!(self.0.is_empty(), "{test}: {} comparison(s) failed:\n{}", self.0.len(), self.0.join("\n"));
    }
}
