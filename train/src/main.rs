//! `askgui-train`: parses the command line (and `--config`, `--preset`, `--resume`'s saved config) and
//! runs the training loop, or one of the subcommands; everything else is in the library.
//!
//! A tiny CPU run on the test fixture:
//! `askgui-train --model model/tests/fixtures/tiny-qwen2_5_vl --data DIR/train.jsonl --max-pixels 12544 --lr 1e-2`
//!
//! `askgui-train merge --model DIR --adapter CHECKPOINT --out DIR` folds an adapter into its base
//! ([`askgui_train::merge`]).
//! `askgui-train convert-adapter --in DIR --out DIR --to transformers5|hub` rewrites an adapter's keys
//! ([`askgui_train::convert_adapter`]).
//! `askgui-train demo [--out DIR]` runs the from-scratch demo ([`askgui_train::demo`]).
//! `askgui-train check-gpu [--device cuda]` checks every kernel against its reference on the device and
//! exits non-zero if one disagrees ([`askgui_train::check_gpu`]).

use std::io::IsTerminal;

use anyhow::Result;
use askgui_train::cli::{Cli, Command};
use clap::{CommandFactory, FromArgMatches};

fn main() -> Result<()> {
    askgui_model::pin_cpu_threads();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_log_level())),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    askgui_train::alloc::tune_for_training();
    // The matches are kept: the config's layers need to know which flags were given.
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    match &cli.command {
        Some(Command::Merge(args)) => {
            askgui_train::merge::merge(args)?;
        }
        Some(Command::ConvertAdapter(args)) => {
            askgui_train::convert_adapter::convert(args)?;
        }
        Some(Command::Demo(args)) => {
            let report = askgui_train::demo::run(args)?;
            print!("{}", askgui_train::demo::markdown(&report));
        }
        Some(Command::CheckGpu(args)) => {
            if !askgui_train::check_gpu::run(args)? {
                anyhow::bail!(
                    "check-gpu: a kernel disagrees with its reference (the FAIL rows above); train and serve with \
                     `--kernels reference` until it is fixed"
                );
            }
        }
        None => train(&cli, &matches)?,
    }
    Ok(())
}

/// `info`, or `warn` on the ranks after the first of a data-parallel launch (rank 0 reports the run).
fn default_log_level() -> &'static str {
    match askgui_train::distributed::parse_launch(|v| std::env::var(v).ok()) {
        Ok(l) if l.rank > 0 => "warn",
        _ => "info",
    }
}

/// The training run of a command line without a subcommand.
fn train(cli: &Cli, matches: &clap::ArgMatches) -> Result<()> {
    let (cfg, mut control) = askgui_train::config::from_matches(&cli.train, matches)?;
    // One process, or this rank of `mpirun -np N askgui-train ...`.
    let world = askgui_train::distributed::World::from_env()?;
    askgui_train::interrupt::install();
    control.interrupted = Some(askgui_train::interrupt::requested);
    let summary = askgui_train::trainer::train_on(&cfg, &control, &world)?;
    let main_rank = world.is_main();
    world.finish();
    if summary.interrupted {
        let step = summary.steps.last().map_or(0, |s| s.step);
        let ckpt = summary.last_checkpoint.as_ref().map_or("none".into(), |p| p.display().to_string());
        anyhow::bail!(
            "interrupted after step {step}; checkpoint {ckpt}; continue with: askgui-train --resume {}",
            cfg.run.output_dir.display()
        );
    }
    let last = summary.steps.last().filter(|_| main_rank);
    tracing::info!(
        steps = summary.steps.len(),
        final_loss = last.map(|s| s.loss),
        val_loss = summary.val_losses.last().map(|v| v.1),
        checkpoint = ?summary.last_checkpoint,
        stopped_early = summary.stopped_early,
        "done"
    );
    Ok(())
}
