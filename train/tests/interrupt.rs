//! Interrupts lose no work, and one output folder has one trainer: an interrupt lets the step in flight
//! finish and writes its checkpoint (not only the last `--save-every` one); Ctrl-C on the binary does the
//! same and exits non-zero with the resume command; a second trainer on a locked folder is refused naming
//! the PID that holds it.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

use askgui_train::lock::Lock;
use askgui_train::RunControl;
use common::{config, episodes, fixture, scratch};

const FLAGS: &str = "--max-steps 10 --save-every 5 --batch-size 1 --lora-rank 4 --warmup-steps 1";

static POLLS: AtomicUsize = AtomicUsize::new(0);

/// An interrupt that arrives during the third step (the loop polls before each step).
fn during_step_three() -> bool {
    POLLS.fetch_add(1, Ordering::SeqCst) >= 3
}

#[test]
fn an_interrupt_finishes_the_step_in_flight_and_writes_its_checkpoint() {
    let dir = scratch("interrupt-lib");
    let data = episodes(&dir, 3);
    let out = dir.join("run");
    let control = RunControl { interrupted: Some(during_step_three), ..RunControl::default() };
    let s = askgui_train::train(&config(&data, &out, FLAGS), &control).unwrap();
    assert!(s.interrupted && s.stopped_early);
    assert_eq!(s.steps.len(), 3, "steps 1 to 3 ran, none after");
    assert_eq!(s.last_checkpoint.as_deref(), Some(out.join("checkpoint-0000003").as_path()));
    assert!(out.join("checkpoint-0000003/trainer_state.json").is_file());
    assert!(!out.join(askgui_train::lock::FILE).exists(), "the lock is released");
}

#[test]
fn a_second_trainer_on_a_locked_folder_is_refused() {
    let dir = scratch("interrupt-lock");
    let data = episodes(&dir, 2);
    let out = dir.join("run");
    let held = Lock::acquire(&out).unwrap();
    let e = askgui_train::train(&config(&data, &out, FLAGS), &RunControl::default()).unwrap_err().to_string();
    assert!(e.contains(&format!("PID {}", std::process::id())) && e.contains("--output-dir"), "{e}");
    drop(held);
}

#[test]
fn ctrl_c_on_the_binary_saves_a_checkpoint_and_prints_the_resume_command() {
    let dir = scratch("interrupt-bin");
    let data = episodes(&dir, 3);
    let out = dir.join("run");
    let mut child = Command::new(env!("CARGO_BIN_EXE_askgui-train"))
        .args(["--model", fixture().to_str().unwrap(), "--data", data.to_str().unwrap()])
        .args(["--output-dir", out.to_str().unwrap(), "--max-pixels", "12544", "--progress", "false"])
        .args(FLAGS.replace("--max-steps 10", "--max-steps 1000").split_whitespace())
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut log = String::new();
    // Wait for the second step, then interrupt as Ctrl-C would.
    for line in lines.by_ref() {
        let line = line.unwrap();
        log.push_str(&line);
        log.push('\n');
        if line.contains("step=2 ") {
            // SAFETY: a signal to our own child.
            assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
            break;
        }
    }
    for line in lines {
        log.push_str(&line.unwrap());
        log.push('\n');
    }
    let status = child.wait().unwrap();
    assert!(!status.success(), "an interrupted run exits non-zero\n{log}");
    assert!(log.contains("continue with: askgui-train --resume"), "{log}");
    // The newest checkpoint is the interrupted step's (a `--save-every` one may precede it).
    let step = std::fs::read_dir(&out)
        .unwrap()
        .filter_map(|e| e.unwrap().file_name().to_string_lossy().strip_prefix("checkpoint-")?.parse::<usize>().ok())
        .max()
        .expect("a checkpoint");
    assert!((2..1000).contains(&step), "{step}");
    assert!(log.contains(&format!("interrupted after step {step};")), "{log}");
    assert!(!out.join(askgui_train::lock::FILE).exists(), "the lock is released");
}
