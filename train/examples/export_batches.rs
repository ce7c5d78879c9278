//! Writes the batches a training run takes, so that another trainer can be timed on the very same data
//! (`scripts/bench/bench_trainer_peft.py`, transformers + PEFT): one JSON line per optimiser step,
//! `{"step": k, "samples": [{"ids": [..], "labels_mask": [..], "images": [abs path, ..], "grids": [[t, h, w], ..]}, ..]}`.
//!
//!     cargo run --release -p askgui-train --example export_batches -- --steps 20 --out batches.jsonl \
//!         -- <the askgui-train arguments of the run>

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;

#[derive(Parser)]
struct Args {
    /// Optimiser steps to write.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    #[arg(long)]
    out: PathBuf,
    /// The askgui-train arguments (after `--`).
    #[arg(last = true)]
    train_args: Vec<String>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let argv = std::iter::once("askgui-train".to_string()).chain(args.train_args.iter().cloned());
    let (cfg, _) = askgui_train::cli::from_args(argv)?;
    let batches = askgui_train::trainer::planned_batches(&cfg, args.steps)?;
    let file = std::fs::File::create(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let mut w = std::io::BufWriter::new(file);
    for (step, batch) in batches.iter().enumerate() {
        let samples: Vec<_> = batch
            .iter()
            .map(|s| {
                let images: Vec<PathBuf> =
                    s.images.iter().map(|p| std::path::absolute(p).unwrap_or_else(|_| p.clone())).collect();
                serde_json::json!({ "ids": s.ids, "labels_mask": s.labels_mask, "images": images, "grids": s.grids })
            })
            .collect();
        writeln!(w, "{}", serde_json::json!({ "step": step, "samples": samples }))?;
    }
    w.flush()?;
    eprintln!("wrote {} steps to {}", batches.len(), args.out.display());
    Ok(())
}
