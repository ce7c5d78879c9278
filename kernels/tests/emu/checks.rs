//! The executor's own checks, on kernels that break the execution model on purpose
//! (`emu/selftest/selftest.cu`): a divergent __syncthreads, a barrier after threads exited, a deadlock
//! between a warp collective and a block barrier, and a read of another lane's wmma store without the
//! __syncwarp a GPU needs (NaN, where the same kernel with the __syncwarp reads the stored values).

use crate::from_bytes;
use askgui_kernels::emu::{self, Options, Order};
use askgui_kernels::plan::{Arg, Caps, Elem, Init, Module, Plan};

/// A one-launch plan of selftest kernel `kernel` on `threads` threads writing `out (threads)` f32.
fn run(kernel: &str, threads: u32, order: Order) -> Result<Vec<f64>, emu::EmuError> {
    let mut p = Plan { op: "selftest", buffers: Vec::new(), launches: Vec::new(), outputs: vec![0] };
    p.buffers.push(askgui_kernels::plan::Buffer {
        name: "out",
        elem: Elem::F32,
        len: threads as usize,
        init: Init::Zeroed,
    });
    p.launches.push(askgui_kernels::plan::Launch {
        module: Module::Norm,
        kernel: kernel.into(),
        grid: [1, 1, 1],
        block: [threads, 1, 1],
        shared_bytes: 0,
        args: vec![Arg::Buf { buf: 0, offset: 0 }],
    });
    let opts = Options { order, redirect: Some((Module::Norm, "selftest")), ..Options::new(Caps::SM86) };
    Ok(from_bytes(&emu::run(&p, &[], &opts)?[0], Elem::F32))
}

fn expect(kernel: &str, threads: u32, needle: &str) {
    match run(kernel, threads, Order::Forward) {
        Ok(_) => panic!("{kernel}: not caught"),
        Err(e) => {
            eprintln!("{kernel}: caught: {e}");
            assert!(e.0.contains(needle), "{kernel}: expected {needle:?} in: {e}");
        }
    }
}

#[test]
fn divergent_barrier_barrier_after_exit_and_deadlock() {
    expect("divergent_syncthreads", 64, "divergent __syncthreads");
    expect("sync_after_exit", 64, "after block (0,0,0) thread (0,0,0) (warp 0 lane 0) exited");
    expect("warp_deadlock", 64, "deadlock");
}

#[test]
fn wmma_store_is_visible_only_after_syncwarp() {
    for order in [Order::Forward, Order::Reverse] {
        let stale = run("wmma_read_without_syncwarp", 32, order).unwrap();
        let nan = stale.iter().filter(|x| x.is_nan()).count();
        eprintln!("wmma_read_without_syncwarp ({order:?}): {nan} of 32 lanes read NaN");
        assert!(nan > 0, "a read before __syncwarp saw only stored values");
        let synced = run("wmma_read_with_syncwarp", 32, order).unwrap();
        assert!(synced.iter().all(|&x| x == 2.0), "with __syncwarp every lane reads 2: {synced:?}");
    }
}
