//! One planted bug of each kind the executor must catch, with the message it prints. Kernel bugs are
//! mutants: copies of the `.cu` sources with one edit, compiled by build.rs (`emu/build.rs`, `MUTANTS`)
//! into modules of their own and run by redirecting a plan's module to them. Plan bugs are edits of a
//! plan built by the real builders.

use crate::common::uniform;
use crate::{rounded, to_bytes, ORDERS};
use askgui_kernels::emu::{self, Options, Order};
use askgui_kernels::plan::attention::{backward, forward, Mask, Problem};
use askgui_kernels::plan::{norm, Arg, Caps, Elem, Module, Plan};

fn problem() -> Problem {
    Problem { b: 1, hq: 2, hkv: 1, tq: 70, tk: 70, d: 64, mask: Mask::Causal, keep: None, scale: 0.125 }
}

fn inputs(p: &Problem, elem: Elem) -> Vec<Vec<u8>> {
    let (nq, nk) = (p.b * p.hq * p.tq * p.d, p.b * p.hkv * p.tk * p.d);
    [nq, nk, nk].iter().enumerate().map(|(i, &n)| to_bytes(&rounded(&uniform(n, i as u64), elem), elem)).collect()
}

fn exec(plan: &Plan, ins: &[Vec<u8>], opts: &Options) -> Result<Vec<Vec<u8>>, emu::EmuError> {
    let refs: Vec<&[u8]> = ins.iter().map(|v| v.as_slice()).collect();
    emu::run(plan, &refs, opts)
}

/// Expects the run to fail with a message containing `needle`; prints it.
fn expect_error(what: &str, r: Result<Vec<Vec<u8>>, emu::EmuError>, needle: &str) {
    match r {
        Ok(_) => panic!("{what}: the executor did not catch it"),
        Err(e) => {
            eprintln!("{what}: caught: {e}");
            assert!(e.0.contains(needle), "{what}: expected a message containing {needle:?}, got: {e}");
        }
    }
}

/// The backward's dV loop and the dS store without the barrier between them: in some thread order the
/// gradients differ from the real kernel's (the executor runs threads only up to barriers, so a missing
/// one shows as other threads' writes read too early).
#[test]
fn planted_missing_barrier() {
    let p = problem();
    let caps = Caps::SM90;
    let fwd = exec(&forward(&p, Elem::F32, &caps).unwrap(), &inputs(&p, Elem::F32), &Options::new(caps)).unwrap();
    let d = p.d;
    let ins = inputs(&p, Elem::F32);
    let q = crate::from_bytes(&ins[0], Elem::F32);
    let o = crate::from_bytes(&fwd[0], Elem::F32);
    let g = uniform(q.len(), 9);
    let qod: Vec<f64> =
        (0..q.len() / d).flat_map(|r| [&q[r * d..][..d], &o[r * d..][..d], &g[r * d..][..d]].concat()).collect();
    let bins = vec![to_bytes(&qod, Elem::F32), ins[1].clone(), ins[2].clone(), fwd[1].clone()];
    let plan = backward(&p, Elem::F32, &caps, true).unwrap();
    let mut caught = 0;
    for order in ORDERS {
        let opts = Options { order, ..Options::new(caps) };
        let real = crate::from_bytes(&exec(&plan, &bins, &opts).unwrap()[0], Elem::F32);
        let opts = Options { redirect: Some((Module::Attention, "attention_missing_barrier")), ..opts };
        let mutant = crate::from_bytes(&exec(&plan, &bins, &opts).unwrap()[0], Elem::F32);
        let worst = real.iter().zip(&mutant).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        eprintln!("planted_missing_barrier ({order:?}): max |real - mutant| over [dq, dk, dv] = {worst:.3e}");
        caught += usize::from(worst > 1e-3);
    }
    assert!(caught > 0, "no thread order exposed the missing barrier");
}

#[test]
fn planted_shuffle_mask_excludes_lane() {
    let p = problem();
    let opts = Options { redirect: Some((Module::Attention, "attention_shfl_mask")), ..Options::new(Caps::SM90) };
    let r = exec(&forward(&p, Elem::F32, &Caps::SM90).unwrap(), &inputs(&p, Elem::F32), &opts);
    expect_error("planted_shuffle_mask_excludes_lane", r, "excludes the calling lane 31");
}

#[test]
fn planted_misaligned_wmma_pointer() {
    let p = problem();
    let opts = Options { redirect: Some((Module::AttentionTc, "attention_tc_misaligned")), ..Options::new(Caps::SM90) };
    let plan = forward(&p, Elem::Bf16, &Caps::SM90).unwrap();
    assert_eq!(plan.launches[0].module, Module::AttentionTc, "bf16 at D 64 runs on tensor cores with sm_90");
    let r = exec(&plan, &inputs(&p, Elem::Bf16), &opts);
    expect_error("planted_misaligned_wmma_pointer", r, "is not 256-bit (32-byte) aligned");
}

#[test]
fn planted_argument_of_wrong_size() {
    let mut plan = norm::forward(norm::Kind::Rms, 4, 64, 1e-6, Elem::F32).unwrap();
    // The row length as a 64-bit integer where the kernel takes an `int`.
    plan.launches[0].args[3] = Arg::I64(64);
    let ins = vec![vec![0u8; 4 * 64 * 4], vec![0u8; 64 * 4]];
    let r = exec(&plan, &ins, &Options::new(Caps::SM86));
    expect_error(
        "planted_argument_of_wrong_size",
        r,
        "argument 3: the plan passes i64 (8 bytes), the kernel's C signature takes i32 (4 bytes)",
    );
}

/// The LayerNorm backward keeps its partial sums (2 d floats) in dynamic shared memory; a plan that
/// launches it with 4 bytes fewer makes the last column's sum land past the block's allocation. Without
/// AddressSanitizer the canary after the allocation catches the write; with it, ASan reports the overflow
/// and aborts, so that case runs in a child process and reads its report.
#[test]
fn planted_shared_memory_past_launch_size() {
    let (rows, d) = (3, 64);
    let mut plan = norm::backward(norm::Kind::Layer, rows, d, 1e-6, true, Elem::F32).unwrap();
    assert_eq!(plan.launches[0].shared_bytes, 2 * 64 * 4, "the partial sums live in shared memory here");
    plan.launches[0].shared_bytes -= 4;
    let ins = vec![vec![0u8; rows * d * 4], vec![0u8; d * 4], vec![0u8; rows * d * 4]];
    let opts = Options { order: Order::Forward, ..Options::new(Caps::SM86) };
    if std::env::var_os("ASKGUI_EMU_PLANTED_CHILD").is_some() {
        let _ = exec(&plan, &ins, &opts);
        return;
    }
    if !emu::sanitized() {
        expect_error("planted_shared_memory_past_launch_size", exec(&plan, &ins, &opts), "past the launch's 508 bytes");
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["planted::planted_shared_memory_past_launch_size", "--exact", "--nocapture", "--test-threads", "1"])
        .env("ASKGUI_EMU_PLANTED_CHILD", "1")
        .output()
        .expect("run the test binary as a child");
    let err = String::from_utf8_lossy(&out.stderr);
    let report: Vec<&str> =
        err.lines().filter(|l| l.contains("AddressSanitizer") || l.contains("is located")).take(3).collect();
    eprintln!(
        "planted_shared_memory_past_launch_size (AddressSanitizer, child exit {:?}):\n{}",
        out.status.code(),
        report.join("\n")
    );
    assert!(!out.status.success() && err.contains("heap-buffer-overflow"), "ASan did not report the overrun:\n{err}");
}
