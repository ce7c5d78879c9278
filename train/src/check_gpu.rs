//! `askgui-train check-gpu`: the command a lab runs first on a new GPU. It runs every askgui kernel
//! (attention, the norms, RoPE, the masked cross-entropy, `frozen_linear`, and the image tiling on CUDA)
//! against its plain-candle reference on the chosen device, forward and gradients, in f32 and bf16, prints
//! one table row per compared tensor, and fails when any row does. The checks themselves are
//! askgui-kernels' ([`askgui_kernels::selfcheck`]); this file picks the device and prints.
//!
//! When a row fails, training and serving still work with `--kernels reference` (plain candle: slower,
//! independent of askgui's CUDA code). `--device cpu` runs the same checks on the CPU (CI does).

use askgui_kernels::selfcheck::{self, CheckRow};
use askgui_model::DeviceKind;
use clap::{CommandFactory, FromArgMatches, Parser};

use crate::error::{Result, TrainError};

/// `askgui-train check-gpu`.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "askgui-train check-gpu",
    about = "Check every askgui kernel against its plain-candle reference on this device (forward and gradients, \
             f32 and bf16); exits non-zero if any check fails"
)]
pub struct CheckGpuArgs {
    /// Where to check: `cuda` (the first GPU), `cpu`, or `auto` (the GPU when there is one).
    #[arg(long, value_enum, default_value_t = DeviceKind::Auto)]
    pub device: DeviceKind,
}

/// Runs every check on the device `args` names; the rows in order.
pub fn check_gpu(args: &CheckGpuArgs) -> Result<Vec<CheckRow>> {
    let (device, _) = args.device.pick()?;
    tracing::info!("checking askgui's kernels against their references on {device:?}");
    Ok(selfcheck::check_all(&device))
}

/// Runs the checks and prints the table on stdout; returns whether every check passed (an unsupported
/// dtype is not a failure).
pub fn run(args: &CheckGpuArgs) -> Result<bool> {
    let rows = check_gpu(args)?;
    print!("{}", selfcheck::table(&rows));
    Ok(selfcheck::all_passed(&rows))
}

/// Parses `argv` (`check-gpu` first) and [`run`]s.
pub fn run_cli<I, T>(argv: I) -> Result<bool>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = |e| TrainError::Cli(Box::new(e));
    // The usage line names the subcommand as it is typed, not argv[0] (`check-gpu`).
    let matches = CheckGpuArgs::command().bin_name("askgui-train check-gpu").try_get_matches_from(argv).map_err(cli)?;
    run(&CheckGpuArgs::from_arg_matches(&matches).map_err(cli)?)
}
