//! What the tests share: backend arguments parsed as the binary parses them, screenshots, and small
//! hand-made episodes.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use askgui_data::{Action, Episode, LoadedEpisode, Platform, Screen, Step, StepAsk, Target};
use askgui_eval::backends::BackendArgs;
use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    backend: BackendArgs,
}

/// `list` parsed as askgui-eval's backend flags.
pub fn args(list: &[&str]) -> BackendArgs {
    let argv = std::iter::once("askgui-eval").chain(list.iter().copied());
    Cli::try_parse_from(argv).unwrap_or_else(|e| panic!("{list:?}: {e}")).backend
}

/// A small PNG with some structure at `target/tmp/askgui-eval-<name>.png`.
pub fn screenshot(name: &str, w: u32, h: u32) -> PathBuf {
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("askgui-eval-{name}.png"));
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x * 4) as u8, (y * 5) as u8, ((x ^ y) * 3) as u8]));
    img.save(&path).unwrap();
    path
}

/// Step i of every episode is a click at (100 + 200 i, 500) on a 1000x1000 screen (steps 0.2 apart: no
/// two match under the 0.14 rule).
pub fn episode(id: &str, n: usize, asks: &[(usize, &str)], ambiguous: bool) -> LoadedEpisode {
    let steps = (0..n)
        .map(|i| Step {
            screenshot: format!("{id}-{i}.png"),
            elements: None,
            instruction: None,
            informative: None,
            action: Action::Click(Target::point(100 + 200 * i as i32, 500)),
            ask: asks.iter().find(|(s, _)| *s == i).map(|(_, q)| StepAsk {
                question: q.to_string(),
                answer: format!("answer to {q}"),
                options: vec![],
                kind: None,
            }),
        })
        .collect();
    let episode = Episode {
        id: id.into(),
        platform: Platform::Android,
        screen: Screen { width: 1000, height: 1000 },
        task: format!("full task {id}"),
        ambiguous_task: ambiguous.then(|| format!("vague task {id}")),
        steps,
    };
    LoadedEpisode { episode, base: PathBuf::from("."), line: 0 }
}
