//! Data-parallel training under `mpirun -np 2` against one process: the same losses and the same final
//! adapter, bitwise. With one sequence per micro-batch, one process sums the step's two weighted
//! micro-batch gradients `a + b` in order, and the two ranks' all-reduce sums the same two tensors; a sum of
//! two floats does not depend on its order, and the dropout masks are numbered across ranks as one
//! process numbers its micro-batches. Then a resume with another world size is refused. Needs
//! `--features mpi` and OpenMPI's `mpirun`; says SKIPPED without mpirun.
#![cfg(feature = "mpi")]

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use askgui_train::RunControl;
use common::*;

const FLAGS: &str = "--lr 5e-3 --warmup-steps 0 --max-steps 4 --lora-rank 4 --save-every 4 --seed 3";

/// Every tensor of the final checkpoint's adapter, as raw bytes.
fn adapter(out: &Path) -> HashMap<String, Vec<u8>> {
    let ckpt = out.join("checkpoint-0000004");
    let st = candle_core::safetensors::load(ckpt.join("adapter_model.safetensors"), &candle_core::Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", ckpt.display()));
    st.into_iter()
        .map(|(k, t)| {
            let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            (k, v.iter().flat_map(|x| x.to_le_bytes()).collect())
        })
        .collect()
}

fn losses(out: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("elapsed_s").is_some())
        .map(|v| v["loss"].as_f64().unwrap())
        .collect()
}

/// The binary's arguments for `flags`, as `common::config` resolves them for the library.
fn argv(data: &Path, out: &Path, flags: &str) -> Vec<String> {
    let mut a: Vec<String> = vec!["--model".into(), fixture().display().to_string(), "--data".into()];
    a.extend([data.display().to_string(), "--output-dir".into(), out.display().to_string()]);
    a.extend(["--max-pixels", "12544", "--progress", "false"].map(String::from));
    a.extend(flags.split_whitespace().map(String::from));
    a
}

#[test]
fn two_ranks_train_bitwise_as_one_process_and_a_resume_needs_the_same_ranks() {
    let Some(mpirun) = mpirun() else { return };
    let dir = scratch("data-parallel");
    let data = episodes(&dir, 2);

    let one = dir.join("one");
    let cfg = config(&data, &one, &format!("{FLAGS} --batch-size 1 --grad-accum 2"));
    askgui_train::train(&cfg, &RunControl::default()).unwrap();

    let two = dir.join("two");
    let args = argv(&data, &two, &format!("{FLAGS} --batch-size 1 --grad-accum 1"));
    let job = mpirun_job(&mpirun, 2, env!("CARGO_BIN_EXE_askgui-train"), &args, Duration::from_secs(600));
    assert!(job.status.is_some_and(|s| s.success()), "mpirun failed:\n{}", job.output);

    let (a, b) = (losses(&one), losses(&two));
    eprintln!("one process {a:?}\ntwo ranks   {b:?}");
    assert_eq!(a.len(), 4);
    assert_eq!(a, b, "the losses differ");
    let (a, b) = (adapter(&one), adapter(&two));
    assert!(!a.is_empty());
    for (name, bytes) in &a {
        assert!(b.get(name) == Some(bytes), "{name}: the final adapters differ");
    }
    // Only rank 0 wrote: one metrics line per step.
    assert_eq!(losses(&two).len(), 4);

    // Resuming the two-rank run in one process is refused, naming both world sizes.
    let cfg = config(&data, &two, &format!("{FLAGS} --batch-size 1 --grad-accum 1"));
    let control = RunControl { resume: Some(two.clone()), ..Default::default() };
    let err = askgui_train::train(&cfg, &control).unwrap_err().to_string();
    assert!(err.contains("2 rank(s)") && err.contains("has 1"), "{err}");
}

/// The PID of the process of `exe` whose command line holds `marker` and whose launcher made it rank
/// `rank` (OpenMPI's `OMPI_COMM_WORLD_RANK` in its environment).
fn rank_pid(marker: &str, rank: usize) -> Option<i32> {
    let want = format!("OMPI_COMM_WORLD_RANK={rank}");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        let environ = std::fs::read(e.path().join("environ")).ok()?;
        let has = |bytes: &[u8], s: &str| bytes.split(|&b| b == 0).any(|part| part == s.as_bytes());
        let is_rank = has(&environ, &want);
        (is_rank && String::from_utf8_lossy(&cmdline).contains(marker)).then_some(pid)
    })
}

/// A rank killed in the middle of a run ends the job (non-zero, naming the rank) within a bounded time
/// instead of leaving rank 0 waiting in an all-reduce, and the newest checkpoint is complete.
#[test]
fn a_killed_rank_ends_the_run_and_the_last_checkpoint_is_intact() {
    let Some(mpirun) = mpirun() else { return };
    let dir = scratch("data-parallel-kill");
    let data = episodes(&dir, 2);
    let out = dir.join("run");
    let flags =
        "--lr 5e-3 --warmup-steps 0 --max-steps 1000 --lora-rank 4 --save-every 1 --batch-size 1 --grad-accum 1";
    let job = mpirun_start(&mpirun, 2, env!("CARGO_BIN_EXE_askgui-train"), &argv(&data, &out, flags));
    // Wait for the second checkpoint, then kill rank 1.
    let saved = |n: usize| {
        let ckpt = askgui_train::snapshot::find(&out).ok();
        ckpt.and_then(|c| askgui_train::snapshot::read_state(&c).ok()).is_some_and(|s| s.step >= n)
    };
    let started = std::time::Instant::now();
    while !saved(2) {
        assert!(started.elapsed() < Duration::from_secs(300), "no second checkpoint after 300 s");
        std::thread::sleep(Duration::from_millis(100));
    }
    let pid = rank_pid(&out.display().to_string(), 1).expect("rank 1 of the run is running");
    // SAFETY: kill(2) on a process this test started (through mpirun); no memory is involved.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let killed = std::time::Instant::now();
    let job = job.wait(Duration::from_secs(400));
    let status = job.status.unwrap_or_else(|| panic!("the run still ran past its deadline:\n{}", job.output));
    eprintln!("mpirun exited {status} {:.1?} after rank 1 was killed", killed.elapsed());
    assert!(!status.success(), "mpirun exited 0:\n{}", job.output);
    assert!(killed.elapsed() < Duration::from_secs(60), "the job took {:.1?} to end", killed.elapsed());
    assert!(job.output.contains("process rank 1 with PID"), "rank 1 is not named:\n{}", job.output);
    // The newest checkpoint loads: its state and its adapter.
    let ckpt = askgui_train::snapshot::find(&out).unwrap();
    let state = askgui_train::snapshot::read_state(&ckpt).unwrap();
    assert_eq!(state.world_size, 2);
    assert!(state.step >= 2 && ckpt.ends_with(askgui_train::snapshot::dir_name(state.step)), "{}", ckpt.display());
    candle_core::safetensors::load(ckpt.join("adapter_model.safetensors"), &candle_core::Device::Cpu).unwrap();
}
