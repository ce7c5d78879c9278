//! `askgui-data split`: divides an episode file into `train.jsonl`, `val.jsonl` and `test.jsonl` beside it.
//!
//! Whole episodes only (a line is copied unchanged, so screenshot paths stay valid next to the input), in a
//! seeded shuffle. `--ratio 8:1:1` gives each split its share by largest remainder, and at least one
//! episode to every split with a weight (taken from the largest), so a small set still has a val and a
//! test file; `--counts 100:20:20` gives exact numbers. Every line must parse as an episode first: a split
//! of a broken file would hide the error in one of its parts.

use std::path::{Path, PathBuf};

use rand::seq::SliceRandom;
use rand::SeedableRng;
use thiserror::Error;

use crate::episode::{read_episodes, EpisodeError};

#[derive(Debug, Clone, clap::Args)]
pub struct SplitArgs {
    /// The episode file (JSONL); the three files are written beside it.
    pub file: PathBuf,
    /// Weights of train:val:test, e.g. 8:1:1 (each weighted split gets at least one episode).
    #[arg(long, conflicts_with = "counts", required_unless_present = "counts")]
    pub ratio: Option<String>,
    /// Episodes in train:val:test, e.g. 100:20:20 (at most the file's episodes; the rest are left out).
    #[arg(long)]
    pub counts: Option<String>,
    /// Seeds the shuffle.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

#[derive(Debug, Error)]
pub enum SplitError {
    #[error(transparent)]
    Episodes(#[from] EpisodeError),
    #[error("{path}:{line}: {reason}: fix the line (see `askgui-data validate`) before splitting")]
    BadLine { path: PathBuf, line: usize, reason: String },
    #[error("`{0}` is not three non-negative numbers like 8:1:1, not all zero")]
    Spec(String),
    #[error("{asked} episodes asked for, but the file holds {have}")]
    TooFew { asked: usize, have: usize },
    #[error("{path} would be overwritten by its own split: rename it (e.g. to episodes.jsonl) first")]
    SelfOverwrite { path: PathBuf },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

/// The files written: `(split name, file, episodes)`.
pub type SplitReport = Vec<(String, PathBuf, usize)>;

fn parse_three(s: &str) -> Result<[f64; 3], SplitError> {
    let v: Vec<f64> = s
        .split(':')
        .map(|x| x.trim().parse::<f64>())
        .collect::<Result<_, _>>()
        .map_err(|_| SplitError::Spec(s.into()))?;
    match v[..] {
        [a, b, c] if a >= 0.0 && b >= 0.0 && c >= 0.0 && a + b + c > 0.0 => Ok([a, b, c]),
        _ => Err(SplitError::Spec(s.into())),
    }
}

/// Episodes per split for `n` episodes and these weights: largest remainder, then at least one for every
/// weighted split while the largest has more than one.
pub fn ratio_counts(n: usize, w: [f64; 3]) -> [usize; 3] {
    let total: f64 = w.iter().sum();
    let exact = w.map(|x| x / total * n as f64);
    let mut counts = exact.map(|x| x.floor() as usize);
    let mut order = [0, 1, 2];
    order.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())));
    for &k in order.iter().cycle().take(n - counts.iter().sum::<usize>()) {
        counts[k] += 1;
    }
    for k in 0..3 {
        let largest = (0..3).max_by_key(|&j| counts[j]).expect("three splits");
        if w[k] > 0.0 && counts[k] == 0 && counts[largest] > 1 {
            counts[largest] -= 1;
            counts[k] += 1;
        }
    }
    counts
}

/// Splits `args.file` into `train.jsonl`, `val.jsonl` and `test.jsonl` in its folder.
pub fn split(args: &SplitArgs) -> Result<SplitReport, SplitError> {
    let path = &args.file;
    let names = ["train", "val", "test"];
    if names.iter().any(|n| path.file_name().and_then(|f| f.to_str()) == Some(&format!("{n}.jsonl"))) {
        return Err(SplitError::SelfOverwrite { path: path.clone() });
    }
    for (line, parsed) in read_episodes(path)? {
        parsed.map_err(|reason| SplitError::BadLine { path: path.clone(), line, reason })?;
    }
    let text = std::fs::read_to_string(path).map_err(|source| SplitError::Io { path: path.clone(), source })?;
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let n = lines.len();
    let counts = match (&args.ratio, &args.counts) {
        (_, Some(c)) => {
            let c = parse_three(c)?;
            if c.iter().any(|x| x.fract() != 0.0) {
                return Err(SplitError::Spec(args.counts.clone().unwrap_or_default()));
            }
            let c = c.map(|x| x as usize);
            match c.iter().sum::<usize>() {
                asked if asked > n => return Err(SplitError::TooFew { asked, have: n }),
                _ => c,
            }
        }
        (Some(r), None) => ratio_counts(n, parse_three(r)?),
        (None, None) => return Err(SplitError::Spec(String::new())),
    };
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(args.seed));
    let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let mut report = vec![];
    let mut next = order.into_iter();
    for (k, name) in names.iter().enumerate() {
        let file = dir.join(format!("{name}.jsonl"));
        let mut picked: Vec<usize> = next.by_ref().take(counts[k]).collect();
        picked.sort(); // keep the file's order within a split
        let body: String = picked.iter().map(|&i| format!("{}\n", lines[i])).collect();
        std::fs::write(&file, body).map_err(|source| SplitError::Io { path: file.clone(), source })?;
        report.push((name.to_string(), file, counts[k]));
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_counts_sum_to_n_and_fill_every_weighted_split() {
        assert_eq!(ratio_counts(40, [8.0, 1.0, 1.0]), [32, 4, 4]);
        assert_eq!(ratio_counts(10, [8.0, 1.0, 1.0]), [8, 1, 1]);
        assert_eq!(ratio_counts(5, [8.0, 1.0, 1.0]), [3, 1, 1], "4.0/0.5/0.5 would round a split to zero");
        assert_eq!(ratio_counts(3, [8.0, 1.0, 1.0]), [1, 1, 1]);
        assert_eq!(ratio_counts(7, [1.0, 0.0, 1.0]), [4, 0, 3]);
        assert_eq!(ratio_counts(1, [8.0, 1.0, 1.0]), [1, 0, 0], "one episode cannot be split");
        for n in 0..50 {
            assert_eq!(ratio_counts(n, [7.0, 2.0, 1.0]).iter().sum::<usize>(), n);
        }
    }
}
