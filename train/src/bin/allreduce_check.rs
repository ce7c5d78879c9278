//! Test helper for `tests/distributed.rs`, run under `mpirun -np N` (built only with `--features mpi`).
//!
//! `askgui-allreduce-check sums LEN DIR`: each rank fills f32 and f64 buffers of LEN with values of its
//! rank (the formulas below, which the test repeats), all-reduces them and writes `DIR/rank-R.txt`; files,
//! not stdout, because mpirun may interleave long lines of different ranks.
//! `askgui-allreduce-check die abort|exit|panic|error`: rank 1 dies before the all-reduce that the others enter, to
//! show how mpirun ends a job that lost a rank: killed by a signal, exited, panicked or returned an error
//! (the last two drop an unfinished World, which aborts the job).

use std::fmt::Write as _;
use std::process::ExitCode;

use askgui_train::distributed::World;

/// Rank `r`'s f32 value at index `i`: small integers plus a quarter, so that every sum is exact.
fn value_f32(r: usize, i: usize) -> f32 {
    ((r + 1) * (i % 1024)) as f32 + 0.25
}

/// Rank `r`'s f64 value at index `i`: exact in f64 far past any test length.
fn value_f64(r: usize, i: usize) -> f64 {
    (r + 1) as f64 * 1e9 + i as f64 * 0.5
}

fn sums(world: &World, len: usize, dir: &str) -> Result<(), Box<dyn std::error::Error>> {
    let r = world.rank();
    let mut f: Vec<f32> = (0..len).map(|i| value_f32(r, i)).collect();
    let mut d: Vec<f64> = (0..len).map(|i| value_f64(r, i)).collect();
    world.all_reduce_sum_f32(&mut f)?;
    world.all_reduce_sum_f64(&mut d)?;
    let same = world.all_equal_u64(42)?;
    let differ = world.all_equal_u64(r as u64)?;
    world.barrier()?;
    let mut text = format!("rank {r} size {}\nequal same={same} rank={differ}\nf32", world.size());
    f.iter().for_each(|x| write!(text, " {x}").unwrap());
    text.push_str("\nf64");
    d.iter().for_each(|x| write!(text, " {x}").unwrap());
    text.push('\n');
    std::fs::write(format!("{dir}/rank-{r}.txt"), text)?;
    println!("rank {r} of {}: wrote {dir}/rank-{r}.txt", world.size());
    Ok(())
}

fn die(world: &World, how: &str) -> Result<(), Box<dyn std::error::Error>> {
    if world.rank() == 1 {
        println!("rank 1: dying ({how}) before the all-reduce");
        match how {
            "abort" => std::process::abort(),
            "exit" => std::process::exit(3),
            "panic" => panic!("rank 1 panics before the all-reduce"),
            _ => return Err("rank 1 returns an error before the all-reduce".into()),
        }
    }
    println!("rank {}: entering the all-reduce", world.rank());
    let mut buf = vec![1.0f32; 1024];
    world.all_reduce_sum_f32(&mut buf)?;
    println!("rank {}: the all-reduce returned", world.rank());
    Ok(())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt().with_writer(std::io::stderr).with_ansi(false).init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let world = match World::from_env() {
        Ok(world) => world,
        Err(e) => {
            eprintln!("askgui-allreduce-check: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = match args.as_slice() {
        [mode, len, dir] if mode == "sums" => len.parse().map_err(Into::into).and_then(|len| sums(&world, len, dir)),
        [mode, how] if mode == "die" && ["abort", "exit", "panic", "error"].contains(&how.as_str()) => die(&world, how),
        _ => Err("usage: askgui-allreduce-check sums LEN DIR | die abort|exit|panic|error".into()),
    };
    match result {
        Ok(()) => {
            world.finish();
            ExitCode::SUCCESS
        }
        Err(e) => {
            // Dropping the unfinished World aborts the other ranks too.
            eprintln!("askgui-allreduce-check: rank {}: {e}", world.rank());
            ExitCode::FAILURE
        }
    }
}
