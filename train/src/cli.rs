//! The `askgui-train` command line: a training run (the config's flags, [`crate::config::TrainArgs`]) or
//! one of the subcommands. It sits above the config and the subcommands' modules, so that those never
//! import each other.

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

use crate::config::{from_matches, RunControl, TrainArgs, TrainConfig};
use crate::error::{Result, TrainError};

/// The command line: training flags, or a subcommand.
#[derive(Parser, Debug)]
#[command(
    name = "askgui-train",
    about = "Fine-tune a Qwen2.5-VL / Qwen2-VL GUI agent on askgui episodes (without a subcommand: train)",
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub train: TrainArgs,
}

/// The tools besides training; each takes its own flags.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Fold a LoRA adapter into its base checkpoint and write a plain Hugging Face checkpoint.
    Merge(crate::merge::MergeArgs),
    /// Rewrite a PEFT LoRA adapter's tensor keys: transformers5 (PEFT today) or hub (older stacks, vLLM).
    ConvertAdapter(crate::convert_adapter::ConvertArgs),
    /// Synthetic world -> base agent from scratch -> LoRA+ASK -> eval, on the CPU with nothing downloaded.
    Demo(Box<crate::demo::DemoArgs>),
    /// Check every kernel against its plain-candle reference on this device; exits non-zero if one fails.
    CheckGpu(crate::check_gpu::CheckGpuArgs),
}

/// Parses a training command line (`argv` as the binary gets it, no subcommand) and resolves the layers.
pub fn from_args<I, T>(argv: I) -> Result<(TrainConfig, RunControl)>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let matches = Cli::command().try_get_matches_from(argv).map_err(|e| TrainError::Cli(Box::new(e)))?;
    let cli = Cli::from_arg_matches(&matches).map_err(|e| TrainError::Cli(Box::new(e)))?;
    if cli.command.is_some() {
        return Err(TrainError::Config("a subcommand was given where a training command line was expected".into()));
    }
    from_matches(&cli.train, &matches)
}
