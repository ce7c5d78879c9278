//! `askgui-data split` end to end on a synthetic world: whole episodes, every line kept once, seeded,
//! counts by ratio (at least one episode per weighted split) or exact; and `synth` never leaves a weighted
//! split empty.

use std::collections::BTreeSet;
use std::fs;
use std::path::PathBuf;

use anyhow::Result;
use askgui_data::split::{split, SplitArgs, SplitError};
use askgui_data::synth::{synth, SynthArgs};
use askgui_data::validate::validate_file;

fn world(name: &str, episodes: usize, split: &str) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("askgui-split-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    let args = SynthArgs {
        out: dir.clone(),
        episodes,
        seed: 5,
        width: 200,
        height: 240,
        split: split.into(),
        ambiguous_fraction: 0.5,
        slot_colors: false,
        grid: 0,
        icons: false,
    };
    synth(&args)?;
    Ok(dir)
}

fn lines(path: &std::path::Path) -> Result<Vec<String>> {
    Ok(fs::read_to_string(path)?.lines().map(String::from).collect())
}

#[test]
fn split_keeps_whole_episodes_seeded() -> Result<()> {
    let dir = world("ratio", 12, "1:0:0")?;
    let input = dir.join("episodes.jsonl");
    fs::rename(dir.join("train.jsonl"), &input)?;
    let all: BTreeSet<String> = lines(&input)?.into_iter().collect();
    let args = |ratio: &str, counts: Option<&str>, seed| SplitArgs {
        file: input.clone(),
        ratio: counts.is_none().then(|| ratio.to_string()),
        counts: counts.map(String::from),
        seed,
    };
    let r = split(&args("8:1:1", None, 1))?;
    let sizes: Vec<usize> = r.iter().map(|(_, _, n)| *n).collect();
    assert_eq!(sizes, [10, 1, 1]);
    let mut seen = BTreeSet::new();
    for (_, file, n) in &r {
        let got = lines(file)?;
        assert_eq!(got.len(), *n);
        assert_eq!(validate_file(file, true)?.problems.len(), 0, "screenshot paths stay valid beside the input");
        for l in got {
            assert!(all.contains(&l) && seen.insert(l), "each episode line once, unchanged");
        }
    }
    assert_eq!(seen, all);
    let first = lines(&dir.join("val.jsonl"))?;
    split(&args("8:1:1", None, 1))?;
    assert_eq!(lines(&dir.join("val.jsonl"))?, first, "same seed, same split");
    let mut by_seed = BTreeSet::new();
    for seed in 0..6 {
        split(&args("8:1:1", None, seed))?;
        by_seed.insert(lines(&dir.join("val.jsonl"))?);
    }
    assert!(by_seed.len() > 1, "the seed changes the split");

    let r = split(&args("", Some("5:3:2"), 0))?;
    assert_eq!(r.iter().map(|(_, _, n)| *n).collect::<Vec<_>>(), [5, 3, 2]);
    assert!(matches!(split(&args("", Some("10:2:1"), 0)), Err(SplitError::TooFew { asked: 13, have: 12 })));
    let own = SplitArgs { file: dir.join("val.jsonl"), ..args("1:1:1", None, 0) };
    assert!(matches!(split(&own), Err(SplitError::SelfOverwrite { .. })));
    fs::write(&input, fs::read_to_string(&input)? + "{\"id\": \"x\"\n")?;
    let e = split(&args("8:1:1", None, 0)).unwrap_err().to_string();
    assert!(e.contains("episodes.jsonl:13"), "{e}");
    fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn synth_gives_every_weighted_split_an_episode() -> Result<()> {
    // Four episodes drawn 8:1:1 leave val or test empty for most seeds; none may be empty.
    let dir = world("synth-small", 4, "8:1:1")?;
    for name in ["train", "val", "test"] {
        assert!(!lines(&dir.join(format!("{name}.jsonl")))?.is_empty(), "{name} is empty");
    }
    fs::remove_dir_all(&dir)?;
    Ok(())
}
