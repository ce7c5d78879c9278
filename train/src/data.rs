//! Training data: episode JSONL -> samples (the prompt code of askgui-data) -> token ids with a loss
//! mask -> [`TrainExample`]s, and the order in which a run visits them.
//!
//! Loading does everything but decoding pixels, once, up front: each line is parsed (a bad line is an
//! error with its file and line, or skipped and counted with `skip_bad_records`), every screenshot is
//! checked and its size read from the file header (a missing one is an error naming the episode, step and
//! path), the samples are rendered in ChatML and tokenised, and a sample longer than the context loses
//! its oldest history (earlier screenshots first, then the oldest history lines) until it fits; that is
//! counted. Pixels are decoded and preprocessed when a batch is built ([`example`], a few micro-batches
//! ahead of the step on the trainer's prefetch thread), so memory does not grow with the data set.
//!
//! Tokenising: [`askgui_runtime::encode_chat`], the agent runtime's own, so what a model is trained on
//! equals what it is asked at inference token for token: the rendered text is split at the loss spans and
//! each piece encoded on its own, so that the supervised tokens are exactly the tokens of the target
//! pieces. Each `<|image_pad|>` is expanded to the image's merged-patch count, computed from the header's
//! size with the same `smart_resize` the preprocessing uses.
//!
//! Order: epoch `e` visits the samples in a Fisher-Yates permutation driven by SplitMix64 seeded from
//! `(seed, e)`; both are written out here so that the order never changes with a dependency's version.
//! A data position `(epoch, index)` therefore fully determines every later batch.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use askgui_data::prompt::SampleKind;
use askgui_data::prompt::{ChatMessage, Part};
use askgui_data::{episode_samples, plural, read_episodes, render_chatml, LoadedEpisode, PromptConfig, TaskMode};
use askgui_model::{load_image, preprocess_batch, ImageProcessorConfig, ModelError, QwenTokenizer, TrainExample};
use askgui_runtime::encode_chat;
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// How episodes become token sequences.
#[derive(Debug, Clone)]
pub struct DataOptions {
    /// The prompt layout; its min/max pixels must be the image processor's.
    pub prompt: PromptConfig,
    pub task_mode: TaskMode,
    /// More samples from the same episodes, built in these modes, mixed in.
    pub extra_task_modes: Vec<TaskMode>,
    /// Most recent history lines kept (0: all).
    pub history_length: usize,
    pub max_seq_len: usize,
    pub skip_bad_records: bool,
    /// Copies of each ask sample (the annotated step of an ambiguous task, whose target is the question):
    /// 1 keeps the natural mix. Asks are a small share of the steps (~12% in the demo's world), and a
    /// model learns when to ask from them alone.
    pub ask_repeat: usize,
    /// Copies of each sample that acts on the user's answer (the annotated step after the SAY turn).
    pub say_repeat: usize,
    /// Copies of each later step of an ambiguous task, acted with an answered question in its history.
    pub dialog_repeat: usize,
    /// Build each sample's region-word targets ([`PreparedSample::region_targets`]).
    pub region_words: bool,
}

/// One tokenised training sample whose pixels are not decoded yet.
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedSample {
    pub episode: String,
    /// 1-based line of the episode in its file.
    pub line: usize,
    pub step: usize,
    pub ids: Vec<u32>,
    pub labels_mask: Vec<bool>,
    pub images: Vec<PathBuf>,
    pub grids: Vec<[usize; 3]>,
    /// `(t, token)`: image token `t` lies inside a listed element whose text has `token`, or inside the
    /// element the target clicks and `token` is the action's name (see [`region_words`]); empty unless
    /// [`DataOptions::region_words`].
    pub region_targets: Vec<(usize, u32)>,
}

impl PreparedSample {
    /// Tokens that carry loss (the first token never does: nothing predicts it).
    pub fn supervised_tokens(&self) -> usize {
        self.labels_mask.iter().skip(1).filter(|&&m| m).count()
    }
}

/// What loading saw.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DataStats {
    /// Non-empty lines read.
    pub records: usize,
    /// Lines skipped with `skip_bad_records` (unparsable, or a screenshot missing or unreadable).
    pub bad_records: usize,
    pub samples: usize,
    /// Samples that lost history to fit the context.
    pub truncated: usize,
    /// Samples too long even without any history (left out).
    pub too_long: usize,
    /// Screenshots whose size is not the episode's `screen` (coordinates are converted with `screen`).
    pub screen_mismatch: usize,
    pub tokens: usize,
    pub supervised_tokens: usize,
}

impl std::fmt::Display for DataStats {
    /// One line for logs and errors: `3 records (0 skipped), 12 samples (1 truncated, 0 too long), ...`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({} skipped), {} ({} truncated, {} too long), {} ({} supervised)",
            plural(self.records, "record"),
            self.bad_records,
            plural(self.samples, "sample"),
            self.truncated,
            self.too_long,
            plural(self.tokens, "token"),
            self.supervised_tokens
        )?;
        if self.screen_mismatch > 0 {
            write!(f, ", {} of another size than the episode's screen", plural(self.screen_mismatch, "screenshot"))?;
        }
        Ok(())
    }
}

/// The samples of one JSONL file.
#[derive(Debug, Clone)]
pub struct Dataset {
    pub path: PathBuf,
    pub samples: Vec<PreparedSample>,
    pub stats: DataStats,
}

/// Loads and tokenises every episode of `path`.
pub fn load_dataset(
    path: &Path,
    opts: &DataOptions,
    tokenizer: &QwenTokenizer,
    images: &ImageProcessorConfig,
) -> Result<Dataset> {
    let lines = read_episodes(path).map_err(|e| match e {
        askgui_data::episode::EpisodeError::Io { path, source } => TrainError::Io { path, source },
        other => TrainError::Data(other.to_string()),
    })?;
    let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let mut stats = DataStats::default();
    let mut samples = Vec::new();
    for (line, parsed) in lines {
        stats.records += 1;
        let skip = |err: TrainError, stats: &mut DataStats| -> Result<()> {
            if opts.skip_bad_records {
                tracing::warn!("skipping a bad record: {err}");
                stats.bad_records += 1;
                Ok(())
            } else {
                Err(err)
            }
        };
        let episode = match parsed {
            Ok(e) => e,
            Err(reason) => {
                skip(TrainError::BadRecord { path: path.into(), line, reason }, &mut stats)?;
                continue;
            }
        };
        // The same checks as `askgui-data validate` (images are opened below, by `image_tokens`).
        let mut problems = vec![];
        askgui_data::validate::check_episode(&episode, &base, false, &mut |step, msg| {
            problems.push(step.map_or(msg.clone(), |s| format!("step {s}: {msg}")))
        });
        if !problems.is_empty() {
            let reason = format!("episode `{}` does not validate: {}", episode.id, problems.join("; "));
            skip(TrainError::BadRecord { path: path.into(), line, reason }, &mut stats)?;
            continue;
        }
        let ep = LoadedEpisode { episode, base: base.clone(), line };
        let tokens = match image_tokens(path, &ep, images) {
            Ok((t, mismatched)) => {
                if mismatched > 0 {
                    tracing::warn!(
                        "{}:{line}: episode `{}`: {mismatched} screenshots are not {}x{} as `screen` says",
                        path.display(),
                        ep.episode.id,
                        ep.episode.screen.width,
                        ep.episode.screen.height
                    );
                }
                stats.screen_mismatch += mismatched;
                t
            }
            Err(e) => {
                skip(e, &mut stats)?;
                continue;
            }
        };
        let words = match opts.region_words {
            true => element_words(tokenizer, &ep)?,
            false => Vec::new(),
        };
        let modes = std::iter::once(opts.task_mode).chain(opts.extra_task_modes.iter().copied());
        let built: std::result::Result<Vec<_>, _> = modes.map(|m| episode_samples(&ep, &opts.prompt, m)).collect();
        let ep_samples = match built {
            Ok(s) => s.into_iter().flatten().collect::<Vec<_>>(),
            Err(e) => {
                let err = TrainError::BadRecord { path: path.into(), line, reason: e.to_string() };
                skip(err, &mut stats)?;
                continue;
            }
        };
        for s in ep_samples {
            let mut messages = s.messages;
            if opts.history_length > 0 {
                cap_history(&mut messages, opts.history_length);
            }
            let mut truncated = false;
            let encoded = loop {
                let enc = encode(tokenizer, &messages, &tokens)?;
                if enc.ids.len() <= opts.max_seq_len {
                    break Some(enc);
                }
                if !drop_oldest_history(&mut messages) {
                    break None;
                }
                truncated = true;
            };
            let Some(Encoded { ids, mask: labels_mask, images: imgs, starts }) = encoded else {
                tracing::warn!(
                    "{}:{line}: episode `{}` step {}: longer than --max-seq-len {} even without history; left out",
                    path.display(),
                    s.episode,
                    s.step,
                    opts.max_seq_len
                );
                stats.too_long += 1;
                continue;
            };
            stats.truncated += truncated as usize;
            let grids = imgs.iter().map(|p| tokens[p].grid).collect();
            let mut region_targets = Vec::new();
            if opts.region_words {
                // Everything that decides the target (the task, the history, an answer to an ask at
                // this step) comes before the screenshots, so the screen tokens can mark it.
                // The element the target acts on predicts the first token of the action's name.
                let marker = match s.target.target() {
                    Some(_) => tokenizer.encode(s.target.name())?.first().copied(),
                    None => None,
                };
                let merge = images.geometry.merge_size;
                // The prompt shows the screenshots of consecutive steps ending with this one (the oldest
                // are the first to go when a sample is cut to fit), so image `k` shows step `first + k`.
                let first = (s.step + 1).checked_sub(imgs.len()).ok_or_else(|| {
                    TrainError::Data(format!("episode `{}` step {}: more screenshots than steps", s.episode, s.step))
                })?;
                for (k, (p, &start)) in imgs.iter().zip(&starts).enumerate() {
                    let step = &words[first + k];
                    // The element the target acts on, on the current screenshot only.
                    let mark = match (marker, step.target) {
                        (Some(m), Some(t)) if first + k == s.step => Some((t, m)),
                        _ => None,
                    };
                    region_words(&tokens[p], &step.elements, mark, merge, start, &mut region_targets);
                }
            }
            let sample = PreparedSample {
                episode: s.episode,
                line,
                step: s.step,
                ids,
                labels_mask,
                images: imgs,
                grids,
                region_targets,
            };
            let copies = match s.kind {
                SampleKind::Ask => opts.ask_repeat.max(1),
                SampleKind::ActAfterSay => opts.say_repeat.max(1),
                SampleKind::ActInDialog => opts.dialog_repeat.max(1),
                _ => 1,
            };
            stats.tokens += copies * sample.ids.len();
            stats.supervised_tokens += copies * sample.supervised_tokens();
            samples.extend(std::iter::repeat_n(sample, copies));
        }
    }
    stats.samples = samples.len();
    if samples.is_empty() {
        return Err(TrainError::Data(format!("{}: no training sample ({stats})", path.display())));
    }
    Ok(Dataset { path: path.into(), samples, stats })
}

/// What the prompt needs to know of a screenshot before its pixels are decoded.
struct ImageInfo {
    /// `[t, h, w]` in patches, after `smart_resize`.
    grid: [usize; 3],
    /// Its number of `<|image_pad|>` tokens.
    pads: usize,
    /// Width and height in pixels, as the file is.
    size: (u32, u32),
}

type ImageTokens = HashMap<PathBuf, ImageInfo>;

/// The grid and pad count of every screenshot of `ep`, from the image headers, and how many screenshots
/// differ in size from the episode's `screen`.
fn image_tokens(file: &Path, ep: &LoadedEpisode, cfg: &ImageProcessorConfig) -> Result<(ImageTokens, usize)> {
    let mut out = HashMap::new();
    let mut mismatched = 0;
    for step in 0..ep.episode.steps.len() {
        let image = ep.image_path(step);
        let err = |reason: String| TrainError::Image {
            path: file.into(),
            line: ep.line,
            episode: ep.episode.id.clone(),
            step,
            image: image.clone(),
            reason,
        };
        if !image.is_file() {
            return Err(err("does not exist".into()));
        }
        let size = image::image_dimensions(&image).map_err(|e| err(format!("is not a readable image: {e}")))?;
        mismatched += (size != (ep.episode.screen.width, ep.episode.screen.height)) as usize;
        let (w, h) = (size.0 as usize, size.1 as usize);
        if w * h > cfg.max_input_pixels || w.min(h) < cfg.min_side {
            return Err(err(format!("is {w}x{h}, outside the image processor's limits")));
        }
        let g = &cfg.geometry;
        let (nh, nw) = askgui_kernels::smart_resize(h, w, g.factor(), cfg.min_pixels, cfg.max_pixels)
            .map_err(|e| err(e.to_string()))?;
        let grid = [1, nh / g.patch_size, nw / g.patch_size];
        let pads = grid.iter().product::<usize>() / (g.merge_size * g.merge_size);
        out.insert(image, ImageInfo { grid, pads, size });
    }
    Ok((out, mismatched))
}

/// A rendered and tokenised sample.
struct Encoded {
    ids: Vec<u32>,
    mask: Vec<bool>,
    /// The screenshots in prompt order, and where each one's pads start in `ids`.
    images: Vec<PathBuf>,
    starts: Vec<usize>,
}

/// Token ids, the loss mask and the images in order, for rendered messages: the runtime's
/// [`encode_chat`], so a sample's prompt is token for token what the runtime asks at inference.
fn encode(tok: &QwenTokenizer, messages: &[ChatMessage], tokens: &ImageTokens) -> Result<Encoded> {
    let r = render_chatml(messages, false);
    let pads = r
        .images
        .iter()
        .map(|p| tokens.get(p).map(|t| t.pads))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| TrainError::Data("the prompt shows a screenshot that was not measured".into()))?;
    let enc = encode_chat(tok, &r, &pads).map_err(|e| TrainError::Data(e.to_string()))?;
    Ok(Encoded { ids: enc.ids, mask: enc.mask, images: r.images, starts: enc.starts })
}

/// A listed element's box and the token ids of its text.
type ElementWords = ([i32; 4], Vec<u32>);

/// One step's elements with words, and which of them its action acts on.
struct StepWords {
    elements: Vec<ElementWords>,
    /// Index into `elements` of the smallest one that contains the action's point.
    target: Option<usize>,
}

/// Each step's elements with the token ids of their text, as the task spells it where the task names
/// the element ("Buy oat milk" for a row "Oat milk"), with a leading space as inside a sentence.
fn element_words(tok: &QwenTokenizer, ep: &LoadedEpisode) -> Result<Vec<StepWords>> {
    let task = &ep.episode.task;
    let lower = task.to_ascii_lowercase();
    let mut out = Vec::with_capacity(ep.episode.steps.len());
    for step in &ep.episode.steps {
        let mut words = Vec::new();
        for e in step.elements.iter().flatten() {
            let text = e.text.trim();
            if text.is_empty() {
                continue;
            }
            // ASCII lowercasing keeps byte offsets, so the match indexes the task itself.
            let phrase = match lower.find(&text.to_ascii_lowercase()) {
                Some(at) => &task[at..at + text.len()],
                None => text,
            };
            let ids = tok.encode(&format!(" {phrase}"))?;
            if !ids.is_empty() {
                words.push((e.bbox, ids));
            }
        }
        let point = step.action.target().and_then(|t| t.xy());
        let target = point.and_then(|(x, y)| smallest_containing(&words, x, y));
        out.push(StepWords { elements: words, target });
    }
    Ok(out)
}

/// The smallest element whose box contains pixel `(x, y)`.
fn smallest_containing(words: &[ElementWords], x: i32, y: i32) -> Option<usize> {
    let area = |b: &[i32; 4]| (b[2] - b[0]) as i64 * (b[3] - b[1]) as i64;
    let inside = words.iter().enumerate().filter(|(_, (b, _))| x >= b[0] && x < b[2] && y >= b[1] && y < b[3]);
    inside.min_by_key(|(_, (b, _))| area(b)).map(|(i, _)| i)
}

/// Appends the region-word targets of one screenshot whose pads start at sequence position `start`: each
/// merged token (row-major over the merged grid) whose centre, mapped back to the file's pixels, lies in
/// an element (the smallest, where boxes nest) gets one of that element's words, the element's tokens
/// taking its words in turn; with `mark = (element, token)`, that element's tokens get `token` instead.
fn region_words(
    info: &ImageInfo,
    words: &[ElementWords],
    mark: Option<(usize, u32)>,
    merge: usize,
    start: usize,
    out: &mut Vec<(usize, u32)>,
) {
    let (rows, cols) = (info.grid[1] / merge, info.grid[2] / merge);
    // Merged-token pitch in file pixels (the processor resized the file to the grid).
    let (sx, sy) = (info.size.0 as f64 / cols as f64, info.size.1 as f64 / rows as f64);
    let mut seen = vec![0usize; words.len()];
    for r in 0..rows {
        for c in 0..cols {
            let (x, y) = (((c as f64 + 0.5) * sx) as i32, ((r as f64 + 0.5) * sy) as i32);
            if let Some(i) = smallest_containing(words, x, y) {
                let ids = &words[i].1;
                let token = match mark {
                    Some((m, t)) if m == i => t,
                    _ => ids[seen[i] % ids.len()],
                };
                out.push((start + r * cols + c, token));
                seen[i] += 1;
            }
        }
    }
}

/// The user message's content (the one with the task, history and screenshots).
fn user_content(messages: &mut [ChatMessage]) -> Option<&mut Vec<Part>> {
    messages.iter_mut().find(|m| m.role == "user").map(|m| &mut m.content)
}

const HISTORY_HEADER: &str = "History:\n";

/// Keeps the last `keep` lines of the history text.
fn cap_history(messages: &mut [ChatMessage], keep: usize) {
    let Some(content) = user_content(messages) else { return };
    for p in content.iter_mut() {
        if let Part::Text { text } = p {
            if let Some(body) = text.strip_prefix(HISTORY_HEADER) {
                let lines: Vec<&str> = body.lines().collect();
                if lines.len() > keep {
                    *text = format!("{HISTORY_HEADER}{}\n", lines[lines.len() - keep..].join("\n"));
                }
            }
        }
    }
}

/// Removes the oldest piece of history: the oldest earlier screenshot (with its label) if there is one,
/// else the oldest history line. False when there is no history left.
fn drop_oldest_history(messages: &mut [ChatMessage]) -> bool {
    let Some(content) = user_content(messages) else { return false };
    let earlier =
        content.iter().position(|p| matches!(p, Part::Text { text } if text.starts_with("Earlier screenshot")));
    if let Some(i) = earlier {
        if matches!(content.get(i + 1), Some(Part::Image { .. })) {
            content.drain(i..i + 2);
            return true;
        }
    }
    for i in 0..content.len() {
        if let Part::Text { text } = &mut content[i] {
            if let Some(body) = text.strip_prefix(HISTORY_HEADER) {
                let rest: Vec<&str> = body.lines().skip(1).collect();
                if rest.is_empty() {
                    content.remove(i);
                } else {
                    *text = format!("{HISTORY_HEADER}{}\n", rest.join("\n"));
                }
                return true;
            }
        }
    }
    false
}

/// Decodes and preprocesses a sample's screenshots into a [`TrainExample`] whose pixels are on `device`:
/// tiled by the GPU kernels on a CUDA device, on the CPU elsewhere ([`preprocess_batch`]). `file` is the
/// JSONL file the sample came from; an error names it, the sample and the screenshot.
pub fn example(s: &PreparedSample, file: &Path, cfg: &ImageProcessorConfig, device: &Device) -> Result<TrainExample> {
    let mut rows = Vec::with_capacity(s.images.len());
    for (p, grid) in s.images.iter().zip(&s.grids) {
        let err = |reason: String| TrainError::Image {
            path: file.into(),
            line: s.line,
            episode: s.episode.clone(),
            step: s.step,
            image: p.clone(),
            reason,
        };
        let reason = |e: ModelError| match e {
            ModelError::Image { reason, .. } => reason,
            other => other.to_string(),
        };
        let img = load_image(p, cfg.max_input_pixels).map_err(|e| err(reason(e)))?;
        let done = preprocess_batch(&[&img], cfg, device).map_err(|e| err(reason(e)))?;
        if done.grid_thw[0] != *grid {
            return Err(err(format!(
                "gave grid {:?} but its header promised {grid:?}; did the file change?",
                done.grid_thw[0]
            )));
        }
        rows.push(done.pixel_values);
    }
    // One image (the usual sample) is used as it is; earlier screenshots are stacked before the current one.
    let pixel_values = match rows.len() {
        0 | 1 => rows.pop(),
        _ => Some(Tensor::cat(&rows, 0)?),
    };
    Ok(TrainExample {
        ids: s.ids.clone(),
        labels_mask: s.labels_mask.clone(),
        pixel_values,
        grid_thw: s.grids.clone(),
        region_targets: s.region_targets.clone(),
    })
}

/// Where a run is in its data: the epoch and the next index into that epoch's order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataPosition {
    pub epoch: usize,
    pub index: usize,
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The order of epoch `epoch`: a permutation of `0..n` fixed by `(seed, epoch)`.
pub fn epoch_order(n: usize, seed: u64, epoch: usize) -> Vec<usize> {
    let mut state = seed ^ (epoch as u64).wrapping_mul(0xd1b5_4a32_d192_ed03);
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        // Multiply-shift gives an unbiased-enough index in 0..=i for any realistic n (< 2^32).
        let j = ((splitmix64(&mut state) >> 32) * (i as u64 + 1)) >> 32;
        order.swap(i, j as usize);
    }
    order
}

/// Optimiser steps in one epoch of `n` samples at `per_step` sequences a step (the last may be short).
pub fn steps_per_epoch(n: usize, per_step: usize) -> usize {
    n.div_ceil(per_step)
}

/// The sample indices of the step that starts at `pos`, and the position after it. A step never spans
/// two epochs.
pub fn step_samples(n: usize, per_step: usize, seed: u64, pos: DataPosition) -> (Vec<usize>, DataPosition) {
    let pos = if pos.index >= n { DataPosition { epoch: pos.epoch + 1, index: 0 } } else { pos };
    let order = epoch_order(n, seed, pos.epoch);
    let end = (pos.index + per_step).min(n);
    (order[pos.index..end].to_vec(), DataPosition { epoch: pos.epoch, index: end })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PINNED: [usize; 8] = [1, 2, 6, 5, 4, 0, 3, 7];

    #[test]
    fn epoch_order_is_a_fixed_permutation() {
        let a = epoch_order(50, 7, 0);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..50).collect::<Vec<_>>());
        assert_eq!(a, epoch_order(50, 7, 0));
        assert_ne!(a, epoch_order(50, 7, 1));
        assert_ne!(a, epoch_order(50, 8, 0));
        // Pinned: a change of the shuffle would silently change what a resumed run trains on.
        assert_eq!(epoch_order(8, 0, 0), PINNED);
    }

    #[test]
    fn steps_walk_epochs_without_spanning_them() {
        let (n, per) = (5, 2);
        let mut pos = DataPosition::default();
        let mut seen = vec![];
        for _ in 0..2 * steps_per_epoch(n, per) {
            let (idx, next) = step_samples(n, per, 3, pos);
            seen.push((pos.epoch.max(next.epoch), idx.len()));
            pos = next;
        }
        assert_eq!(seen, [(0, 2), (0, 2), (0, 1), (1, 2), (1, 2), (1, 1)]);
    }

    fn user(parts: Vec<Part>) -> Vec<ChatMessage> {
        vec![ChatMessage { role: "user".into(), content: parts, loss: false }]
    }

    #[test]
    fn history_is_dropped_oldest_first_screenshots_before_lines() {
        let text = |t: &str| Part::Text { text: t.into() };
        let mut m = user(vec![
            text("Task: t\n"),
            text("History:\n1. a\n2. b\n3. c\n"),
            text("Earlier screenshot 2:"),
            Part::Image { path: "s0.png".into() },
            text("Earlier screenshot 1:"),
            Part::Image { path: "s1.png".into() },
            text("Current screenshot:"),
        ]);
        cap_history(&mut m, 2);
        assert_eq!(m[0].content[1], text("History:\n2. b\n3. c\n"));
        assert!(drop_oldest_history(&mut m));
        assert_eq!(m[0].content[2], text("Earlier screenshot 1:"));
        assert!(drop_oldest_history(&mut m));
        assert!(drop_oldest_history(&mut m));
        assert_eq!(m[0].content[1], text("History:\n3. c\n"));
        assert!(drop_oldest_history(&mut m));
        assert_eq!(m[0].content, [text("Task: t\n"), text("Current screenshot:")]);
        assert!(!drop_oldest_history(&mut m));
    }
}
