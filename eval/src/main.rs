//! askgui-eval: evaluates a GUI agent over an episode file (standard, Dual-Stream, strict) and scores
//! ASK questions. Thin: parses arguments and calls the library; errors are one line on stderr, exit 2.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use askgui_data::{load_episodes, LoadedEpisode};
use askgui_eval::backends::{self, BackendArgs};
use askgui_eval::calibrate;
use askgui_eval::matching::MatchConfig;
use askgui_eval::modes::Mode;
use askgui_eval::runner::{discard_results, run_eval, EvalConfig, RunOptions};
use askgui_eval::text::{score_text_file, TextMetrics};
use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "askgui-eval",
    version,
    about = "Navi-plus Dual-Stream and Morae strict evaluation of GUI agents that ask"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Evaluate an agent over an episode file; writes results-<mode>.jsonl, report.json, report.md and plots.
    Run(Box<RunArgs>),
    /// Choose the pause threshold on a validation split: the best strict ASK F1 within a per-step ask FPR
    /// bound; writes it into the adapter's askgui.json, with the reliability of ask_probability.
    Calibrate(Box<CalibrateArgs>),
    /// How far each choice the papers leave open moves the Table 1 numbers of finished runs (Markdown on
    /// stdout); no agent is called.
    Sensitivity {
        /// A folder written by `run` (repeat for several).
        #[arg(long = "results", required = true)]
        results: Vec<PathBuf>,
        /// The episode file (default: the one the folder's identity.json names).
        #[arg(long)]
        episodes: Option<PathBuf>,
    },
    /// Score (reference, hypothesis) question pairs: one JSON line with `cosine` and `meteor` per pair.
    ScoreText {
        /// JSONL of {"reference": .., "hypothesis": ..}.
        #[arg(long)]
        pairs: PathBuf,
        #[command(flatten)]
        text: TextArgs,
    },
}

#[derive(Args)]
struct TextArgs {
    /// all-MiniLM-L6-v2 folder (else $ASKGUI_MINILM); cosine is unavailable without it.
    #[arg(long)]
    embedder: Option<PathBuf>,
    /// WordNet 3.0 folder (else $ASKGUI_WORDNET, else /usr/share/wordnet); METEOR is unavailable without it.
    #[arg(long)]
    wordnet: Option<PathBuf>,
}

/// What `run` and `calibrate` share: the episodes, the results folder and how episodes are walked.
#[derive(Args)]
struct Pass {
    /// The episode file (JSONL).
    #[arg(long)]
    episodes: PathBuf,
    /// Output folder. Results already there are continued when the same agent and settings made them,
    /// refused otherwise (see --restart).
    #[arg(long)]
    out: PathBuf,
    /// Discard the results, identity and reports already in --out, then run from the start.
    #[arg(long)]
    restart: bool,
    /// Episodes evaluated at once.
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// No progress bar.
    #[arg(long)]
    no_progress: bool,
}

impl Pass {
    /// The episodes (loaded first: a bad line should not wait for a model to load) and the run's settings
    /// for `modes`; with `--restart`, the folder's earlier results are discarded.
    fn start(self, modes: Vec<Mode>, matching: MatchConfig) -> anyhow::Result<(Vec<LoadedEpisode>, EvalConfig)> {
        if self.concurrency == 0 {
            anyhow::bail!("--concurrency must be at least 1");
        }
        let episodes = load_episodes(&self.episodes)?;
        let cfg = EvalConfig {
            episodes: self.episodes,
            out: self.out,
            modes,
            matching,
            run: RunOptions { concurrency: self.concurrency, progress: !self.no_progress },
        };
        if self.restart {
            let removed = discard_results(&cfg.out)?;
            eprintln!("--restart: discarded {} files in {}", removed.len(), cfg.out.display());
        }
        Ok((episodes, cfg))
    }
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    pass: Pass,
    /// Modes to run, comma-separated: original, incomplete, standard (alias ask), dual, strict.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "standard,dual,strict", conflicts_with = "table")]
    modes: Vec<Mode>,
    /// Run the four rows of Navi-plus Table 1: original, incomplete, standard (+ASK), dual.
    #[arg(long)]
    table: bool,
    #[command(flatten)]
    text: TextArgs,
    #[command(flatten)]
    matching: MatchConfig,
    #[command(flatten)]
    backend: BackendArgs,
}

// `--episodes` is the validation split (never the test split); `--out` gets the recorded results,
// calibration.json/.md, reliability.svg and pr_curve.svg.
#[derive(Args)]
struct CalibrateArgs {
    #[command(flatten)]
    pass: Pass,
    /// The largest per-step ask false-positive rate (+ASK: needless asks / steps that need none) allowed.
    #[arg(long, default_value_t = 0.05)]
    target_fpr: f64,
    /// Where the threshold is written: this folder's askgui.json [default: --adapter's, else --model's].
    #[arg(long)]
    card: Option<PathBuf>,
    /// Only report; write no askgui.json.
    #[arg(long, conflicts_with = "card")]
    no_write: bool,
    /// Write the threshold even when no threshold kept the FPR within --target-fpr.
    #[arg(long, conflicts_with = "no_write")]
    force: bool,
    #[command(flatten)]
    matching: MatchConfig,
    #[command(flatten)]
    backend: BackendArgs,
}

fn main() -> ExitCode {
    askgui_model::pin_cpu_threads();
    let cli = Cli::parse();
    // score-text says once on stderr why a metric is unavailable; the loader's warnings would repeat it.
    let default = if matches!(cli.command, Command::ScoreText { .. }) { "error" } else { "warn" };
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default.into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Run(a) => {
            let modes = if a.table { Mode::TABLE.to_vec() } else { dedup(a.modes) };
            let (episodes, cfg) = a.pass.start(modes, a.matching)?;
            let agent = backends::from_args(&a.backend)?;
            let text = TextMetrics::load(a.text.embedder.as_deref(), a.text.wordnet.as_deref());
            let report = run_eval(agent.as_ref(), &episodes, &cfg, &text)?;
            print!("{}", askgui_eval::report::markdown(&report));
            eprintln!("reports written to {}", cfg.out.display());
        }
        Command::Calibrate(a) => calibrate(*a)?,
        Command::Sensitivity { results, episodes } => {
            print!("{}", askgui_eval::sensitivity::tables(&results, episodes.as_deref())?);
        }
        Command::ScoreText { pairs, text } => {
            let m = TextMetrics::load(text.embedder.as_deref(), text.wordnet.as_deref());
            if let Err(reason) = &m.embedder {
                eprintln!("cosine unavailable: {reason}");
            }
            if let Err(reason) = &m.meteor {
                eprintln!("meteor unavailable: {reason}");
            }
            for s in score_text_file(&pairs, &m)? {
                println!("{}", serde_json::to_string(&s)?);
            }
        }
    }
    Ok(())
}

fn calibrate(mut a: CalibrateArgs) -> anyhow::Result<()> {
    if !(0.0..=1.0).contains(&a.target_fpr) {
        anyhow::bail!("--target-fpr must be in 0..=1, got {}", a.target_fpr);
    }
    if a.backend.decoding.pause_threshold.is_some() || a.backend.decoding.temperature.is_some_and(|t| t != 0.0) {
        anyhow::bail!(
            "calibrate records greedy answers with pause threshold 1: leave --pause-threshold and --temperature unset"
        );
    }
    let card = match (&a.card, a.no_write) {
        (_, true) => None,
        (Some(dir), false) => Some(dir.clone()),
        (None, false) => match (&a.backend.adapter, &a.backend.model) {
            (Some(dir), _) => Some(dir.clone()),
            (None, Some(m)) if std::path::Path::new(m).is_dir() => Some(PathBuf::from(m)),
            _ => anyhow::bail!("where should the threshold go? give --card DIR (an askgui.json folder) or --no-write"),
        },
    };
    let (episodes, cfg) = a.pass.start(vec![], a.matching)?;
    a.backend.decoding.pause_threshold = Some(1.0);
    let agent = backends::from_args(&a.backend)?;
    let c = calibrate::calibrate(agent.as_ref(), &episodes, &cfg, a.target_fpr)?;
    calibrate::report::write(&cfg.out, &c)?;
    print!("{}", calibrate::report::markdown(&c));
    eprintln!("reports written to {}", cfg.out.display());
    if !c.bound_met {
        eprintln!("warning: no threshold kept the ask FPR within {}; the lowest FPR is shown", c.target_fpr);
    }
    match card {
        Some(dir) => {
            let path = calibrate::write_to_card(&dir, &c, a.force)?;
            eprintln!("pause threshold {:.4} written to {}", c.threshold, path.display())
        }
        None => eprintln!("pause threshold {:.4} (not written: --no-write)", c.threshold),
    }
    Ok(())
}

/// Modes in the order given, each once.
fn dedup(modes: Vec<Mode>) -> Vec<Mode> {
    let mut out = Vec::new();
    for m in modes {
        if !out.contains(&m) {
            out.push(m);
        }
    }
    out
}

/// The error and its causes on one line, without repeating a cause already in the message.
fn one_line(e: &anyhow::Error) -> String {
    let mut msg = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !msg.contains(&c) {
            msg = format!("{msg}: {c}");
        }
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from([
            "askgui-eval",
            "run",
            "--episodes",
            "e.jsonl",
            "--out",
            "o",
            "--modes",
            "ask,dual",
            "--match-distance",
            "0.1",
        ])
        .unwrap();
        let Command::Run(a) = cli.command else { panic!("run") };
        assert_eq!(a.modes, [Mode::Standard, Mode::Dual]);
        assert_eq!(a.matching.distance, 0.1);
        assert!(Cli::try_parse_from([
            "askgui-eval",
            "run",
            "--episodes",
            "e",
            "--out",
            "o",
            "--table",
            "--modes",
            "dual"
        ])
        .is_err());
    }
}
