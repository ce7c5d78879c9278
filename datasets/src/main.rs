//! `askgui-data`: the data tools on the command line. Each subcommand parses its arguments and calls one
//! library function; see `askgui-data help <command>`.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use askgui_data::{ambiguate, convert, plural, render, split, stats, synth, validate};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "askgui-data", version, about = "askgui's agent protocol and data tools")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check an episode file and report every problem with its line number; exits 1 if any.
    Validate {
        /// The episode file (JSONL).
        file: PathBuf,
        /// Skip opening the screenshots (faster; misses missing or mis-sized images).
        #[arg(long)]
        no_images: bool,
        /// Also check that this action language can say every action and question.
        #[arg(long, value_enum)]
        action_language: Option<askgui_data::ActionLanguage>,
    },
    /// Write the synthetic GUI world: train/val/test JSONL files and their screenshots.
    Synth(synth::SynthArgs),
    /// Convert a public dataset into askgui episodes.
    Convert {
        /// The dataset's format.
        #[arg(value_enum)]
        format: Format,
        /// The dataset folder (screenagent, gui-odyssey); for mind2web its parquet shards (one, or the folder of
        /// the published `*.parquet`) or a JSONL of rows; for android-control its TFRecord files (one, or a
        /// folder of the published `android_control-*-of-*`) or a JSONL export.
        #[arg(long)]
        input: PathBuf,
        /// Output folder: episodes.jsonl and images/.
        #[arg(long)]
        out: PathBuf,
        /// Skip and count bad records (truncated, wrong schema, missing image) instead of stopping at the first.
        #[arg(long)]
        skip_bad_records: bool,
        /// android-control only: its split file (splits.json); also writes train/val/test.jsonl by its episode ids.
        #[arg(long)]
        splits: Option<PathBuf>,
    },
    /// Divide an episode file into train/val/test files beside it: whole episodes, seeded, by ratio or count.
    Split(split::SplitArgs),
    /// Make tasks ambiguous the Navi-plus way through an OpenAI-compatible chat endpoint.
    Ambiguate(ambiguate::AmbiguateArgs),
    /// Episodes, steps, action mix, ask rate, image sizes.
    Stats {
        /// The episode file (JSONL).
        file: PathBuf,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Write an HTML page per episode with each screenshot and its action drawn on it.
    Render {
        /// The episode file (JSONL).
        file: PathBuf,
        /// Output folder: index.html and one page per episode.
        #[arg(long)]
        out: PathBuf,
        /// Show each action as this action language writes it.
        #[arg(long, value_enum, default_value_t = askgui_data::ActionLanguage::AskguiJson)]
        action_language: askgui_data::ActionLanguage,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Format {
    Screenagent,
    AndroidControl,
    Mind2web,
    GuiOdyssey,
}

fn main() -> ExitCode {
    // Rust ignores SIGPIPE, so printing into a closed pipe (`askgui-data stats | head`) would panic; a
    // command-line tool should end quietly there, as the default action does.
    #[cfg(unix)]
    // SAFETY: called first in main, before any thread starts; SIG_DFL is a valid handler for SIGPIPE.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Validate { file, no_images, action_language } => {
            let r = validate::validate_file_in(&file, !no_images, action_language)?;
            for p in &r.problems {
                println!("{}: {p}", file.display());
            }
            let (e, s, p) =
                (plural(r.episodes, "episode"), plural(r.steps, "step"), plural(r.problems.len(), "problem"));
            println!("{}: {e}, {s}, {p}", file.display());
            return Ok(if r.problems.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(1) });
        }
        Command::Synth(args) => {
            let r = synth::synth(&args)?;
            for (name, file, n) in &r.files {
                println!("{name}: {} -> {}", plural(*n, "episode"), file.display());
                if name == "val" && *n < 32 {
                    let exist = if *n == 1 { "exists" } else { "exist" };
                    println!(
                        "  note: the trainer's agent eval runs --eval-episodes (default 32) of these; only {n} {exist}"
                    );
                }
            }
            println!("{}, {}", plural(r.steps, "step"), plural(r.ambiguous, "ambiguous episode"));
        }
        Command::Convert { format, input, out, skip_bad_records, splits } => {
            let opts = convert::ConvertOptions { skip_bad_records };
            if splits.is_some() && !matches!(format, Format::AndroidControl) {
                anyhow::bail!("--splits is for android-control only (other datasets: `askgui-data split`)");
            }
            let r = match format {
                Format::Screenagent => convert::convert_screenagent_with(&input, &out, opts),
                Format::AndroidControl => convert::convert_android_control_split(&input, splits.as_deref(), &out, opts),
                Format::Mind2web => convert::convert_mind2web_with(&input, &out, opts),
                Format::GuiOdyssey => convert::convert_gui_odyssey_with(&input, &out, opts),
            }
            .with_context(|| format!("converting {}", input.display()))?;
            for s in &r.skipped {
                eprintln!("skipped: {s}");
            }
            for (reason, n) in &r.skip_counts {
                println!("skipped {n}: {reason}");
            }
            println!(
                "{}, {} -> {} ({} skipped)",
                plural(r.episodes, "episode"),
                plural(r.steps, "step"),
                out.join("episodes.jsonl").display(),
                r.skipped.len()
            );
            for line in r.split_lines() {
                println!("{line}");
            }
        }
        Command::Split(args) => {
            for (name, file, n) in split::split(&args)? {
                println!("{name}: {} -> {}", plural(n, "episode"), file.display());
            }
        }
        Command::Ambiguate(args) => {
            let r = ambiguate::ambiguate(&args)?;
            println!(
                "{} written, {} already done, {} without an informative step, {} unchanged after junk answers -> {}",
                plural(r.done, "episode"),
                r.skipped_existing,
                r.no_informative_step,
                r.rejected_total(),
                args.out.display()
            );
        }
        Command::Stats { file, json } => {
            let s = stats::stats(&file)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&s)?);
            } else {
                print!("{s}");
            }
        }
        Command::Render { file, out, action_language } => {
            let r = render::render_html(&file, &out, action_language)?;
            println!("{} -> {}", plural(r.pages, "page"), r.index.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The error and its causes on one line, leaving out causes the message already quotes (our error
/// types put their source in their message, so `{:#}` would print it twice).
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
