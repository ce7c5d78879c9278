//! Real all-reduces over MPI: `askgui-allreduce-check` under `mpirun -np 2`, and how a job that loses a
//! rank ends (it must end, non-zero and naming the rank, rather than hang). Needs `--features mpi` and
//! OpenMPI's `mpirun` on PATH; says SKIPPED without mpirun.
#![cfg(feature = "mpi")]

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::{mpirun, mpirun_job, Job};

const HELPER: &str = env!("CARGO_BIN_EXE_askgui-allreduce-check");
const RANKS: usize = 2;
/// How long a job that lost a rank may take to end (it takes about a second).
const DEADLINE: Duration = Duration::from_secs(60);

fn run_job(mpirun: &std::path::Path, args: &[&str]) -> Job {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    mpirun_job(mpirun, RANKS, HELPER, &args, DEADLINE)
}

fn expected_f32(i: usize) -> f32 {
    // Σ_r ((r+1)·(i mod 1024) + 0.25) over r < RANKS.
    ((RANKS * (RANKS + 1) / 2) * (i % 1024)) as f32 + 0.25 * RANKS as f32
}

fn expected_f64(i: usize) -> f64 {
    // Σ_r ((r+1)·1e9 + i/2) over r < RANKS.
    (RANKS * (RANKS + 1) / 2) as f64 * 1e9 + RANKS as f64 * (i as f64 * 0.5)
}

/// The numbers after `label` on the line that starts with it.
fn numbers<T: std::str::FromStr>(text: &str, label: &str) -> Vec<T>
where
    T::Err: std::fmt::Debug,
{
    let line = text.lines().find(|l| l.starts_with(label)).unwrap_or_else(|| panic!("no {label} line"));
    line.split_whitespace().skip(1).map(|x| x.parse().unwrap()).collect()
}

#[test]
fn all_reduce_sums_are_exact_on_every_rank() {
    let Some(mpirun) = mpirun() else { return };
    // Past 2^16 so that the sums cover many pages, odd so that no length is a power of two.
    let len = 100_003;
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("allreduce-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let job = run_job(&mpirun, &["sums", &len.to_string(), dir.to_str().unwrap()]);
    assert!(job.status.is_some_and(|s| s.success()), "mpirun failed ({:?}):\n{}", job.status, job.output);
    for rank in 0..RANKS {
        let text = std::fs::read_to_string(dir.join(format!("rank-{rank}.txt"))).unwrap();
        assert!(text.starts_with(&format!("rank {rank} size {RANKS}\n")), "{}", &text[..40]);
        assert!(text.contains("equal same=true rank=false\n"), "all_equal_u64 on rank {rank}");
        let f: Vec<f32> = numbers(&text, "f32");
        let d: Vec<f64> = numbers(&text, "f64");
        assert_eq!((f.len(), d.len()), (len, len));
        for i in 0..len {
            assert_eq!(f[i], expected_f32(i), "f32 sum at {i} on rank {rank}");
            assert_eq!(d[i], expected_f64(i), "f64 sum at {i} on rank {rank}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Rank 1 leaves `how` while rank 0 waits for it in an all-reduce: the job must end non-zero well within
/// [`DEADLINE`], rank 0 must not get past the all-reduce, and the output must name rank 1.
fn lost_rank_ends_the_job(how: &str, names_rank_1: &[&str]) -> Job {
    let mpirun = mpirun().expect("checked by the caller");
    let job = run_job(&mpirun, &["die", how]);
    let status = job.status.unwrap_or_else(|| panic!("mpirun still ran after {DEADLINE:?}:\n{}", job.output));
    assert!(!status.success(), "mpirun exited 0:\n{}", job.output);
    assert!(!job.output.contains("the all-reduce returned"), "rank 0 got a sum without rank 1:\n{}", job.output);
    assert!(names_rank_1.iter().any(|s| job.output.contains(s)), "rank 1 is not named:\n{}", job.output);
    println!("{how}: mpirun exited {status} after {:.1?}", job.elapsed);
    job
}

#[test]
fn a_rank_killed_by_a_signal_ends_the_job() {
    if mpirun().is_none() {
        return;
    }
    let job = lost_rank_ends_the_job("abort", &["process rank 1 with PID"]);
    // mpirun exits 128 + the signal's number: SIGABRT is 6.
    assert_eq!(job.status.unwrap().code(), Some(134), "{}", job.output);
    assert!(job.output.contains("exited on signal 6 (Aborted)"), "{}", job.output);
}

#[test]
fn a_rank_that_exits_ends_the_job() {
    if mpirun().is_none() {
        return;
    }
    // OpenMPI names the rank as the process name [[job id,1],rank].
    let job = lost_rank_ends_the_job("exit", &[",1],1]"]);
    assert_eq!(job.status.unwrap().code(), Some(3), "mpirun passes the rank's exit code on:\n{}", job.output);
}

#[test]
fn a_rank_that_returns_an_error_aborts_the_job_instead_of_hanging() {
    if mpirun().is_none() {
        return;
    }
    // Our own log line names the rank every time; OpenMPI's MPI_ABORT banner does most times.
    let job = lost_rank_ends_the_job("error", &["rank 1 is leaving the run without World::finish"]);
    assert_eq!(job.status.unwrap().code(), Some(1), "the MPI_Abort error code:\n{}", job.output);
}

#[test]
fn a_rank_that_panics_aborts_the_job_instead_of_hanging() {
    if mpirun().is_none() {
        return;
    }
    let job = lost_rank_ends_the_job("panic", &["rank 1 is leaving the run without World::finish"]);
    assert_eq!(job.status.unwrap().code(), Some(1), "the MPI_Abort error code:\n{}", job.output);
}
