//! `askgui-train`: parses the command line (and `--config`, `--preset`, `--resume`'s saved config) and
//! runs the training loop; everything else is in the library.
//!
//! A tiny CPU run on the test fixture:
//! `askgui-train --model model/tests/fixtures/tiny-qwen2_5_vl --data DIR/train.jsonl --max-pixels 12544 --lr 1e-2`
//!
//! `askgui-train merge --model DIR --adapter CHECKPOINT --out DIR` folds an adapter into its base
//! ([`askgui_train::merge`]).
//! `askgui-train demo [--out DIR]` runs the from-scratch demo ([`askgui_train::demo`]).
//! `askgui-train check-gpu [--device cuda]` checks every kernel against its reference on the device and
//! exits non-zero if one disagrees ([`askgui_train::check_gpu`]).

use anyhow::Result;
use clap::Parser;

/// `askgui-train demo`: its own command line.
#[derive(Parser)]
#[command(name = "askgui-train demo", about = "Synthetic world -> base agent from scratch -> LoRA+ASK -> eval")]
struct DemoCli {
    #[command(flatten)]
    args: askgui_train::demo::DemoArgs,
}

fn main() -> Result<()> {
    askgui_model::pin_cpu_threads();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    askgui_train::alloc::tune_for_training();
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if argv.get(1).is_some_and(|a| a == "merge") {
        match askgui_train::merge::run_cli(argv.into_iter().skip(1)) {
            Err(askgui_train::TrainError::Cli(e)) => e.exit(),
            r => return r.map(|_| ()).map_err(Into::into),
        }
    }
    if argv.get(1).is_some_and(|a| a == "check-gpu") {
        match askgui_train::check_gpu::run_cli(argv.into_iter().skip(1)) {
            Err(askgui_train::TrainError::Cli(e)) => e.exit(),
            Ok(true) => return Ok(()),
            Ok(false) => anyhow::bail!(
                "check-gpu: a kernel disagrees with its reference (the FAIL rows above); train and serve with \
                 `--kernels reference` until it is fixed"
            ),
            Err(e) => return Err(e.into()),
        }
    }
    if argv.get(1).is_some_and(|a| a == "demo") {
        let cli = DemoCli::parse_from(argv.into_iter().skip(1));
        let report = askgui_train::demo::run(&cli.args)?;
        print!("{}", askgui_train::demo::markdown(&report));
        return Ok(());
    }
    let (cfg, control) = match askgui_train::config::from_args(argv) {
        Ok(c) => c,
        Err(askgui_train::TrainError::Cli(e)) => e.exit(),
        Err(e) => return Err(e.into()),
    };
    let summary = askgui_train::train(&cfg, &control)?;
    let last = summary.steps.last();
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
