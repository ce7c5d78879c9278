//! End to end on the tiny random Qwen2.5-VL fixture with synthetic episodes from askgui-data: the loss
//! falls, a stopped and resumed run repeats the uninterrupted one, bad records are reported with their
//! line or skipped and counted, long samples are truncated and counted, a non-finite loss stops the run
//! with the last good checkpoint intact, and `--kernels reference` trains as the askgui kernels do.
//!
//! Images are kept tiny (`--max-pixels 12544`: a few patches each) so that each test runs in seconds.

mod common;

use std::path::Path;

use askgui_data::synth::{synth, SynthArgs};
use askgui_data::PromptConfig;
use askgui_train::cli::from_args;
use askgui_train::data::{self, DataOptions};
use askgui_train::snapshot;
use askgui_train::{RunControl, TrainError};
use common::{config, data_options, episodes, fixture, scratch, tokenizer_and_images};

fn none() -> RunControl {
    RunControl::default()
}

#[test]
fn loss_is_finite_and_falls_at_a_high_lr() {
    let dir = scratch("falls");
    let data = episodes(&dir, 1);
    let flags = "--lr 1e-2 --warmup-steps 0 --min-lr-ratio 1 --max-steps 10 --batch-size 1 --grad-accum 1 \
        --lora-dropout 0 --save-checkpoints false --lora-rank 8";
    let val = format!("--val {} --eval-every 5 --eval-samples 2", data.display());
    let s = askgui_train::train(&config(&data, &dir.join("run"), &format!("{flags} {val}")), &none()).unwrap();
    let losses: Vec<f64> = s.steps.iter().map(|l| l.loss).collect();
    eprintln!("losses: {losses:?}");
    assert_eq!(losses.len(), 10);
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert!(s.steps.iter().all(|l| l.lr == 1e-2), "constant lr from the first step");
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (head, tail) = (mean(&losses[..3]), mean(&losses[7..]));
    assert!(tail < 0.75 * head, "the last three steps average {tail}, the first three {head}");
    // The eval loss on (two samples of) the training episode is taken at steps 5 and 10, and falls.
    eprintln!("val: {:?}", s.val_losses);
    assert_eq!(s.val_losses.iter().map(|v| v.0).collect::<Vec<_>>(), [5, 10]);
    assert!(s.val_losses[1].1 < s.val_losses[0].1 && s.val_losses[1].1.is_finite());
    // metrics.jsonl has one line per step and one per eval.
    let metrics = std::fs::read_to_string(dir.join("run").join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 12);
    let svg = std::fs::read_to_string(dir.join("run").join("curves.svg")).unwrap();
    assert!(svg.contains("<polyline") && svg.matches("<circle").count() == 2, "{svg}");
}

#[test]
fn a_stopped_and_resumed_run_repeats_the_uninterrupted_run() {
    let dir = scratch("resume");
    let data = episodes(&dir, 1);
    // Dropout, weight decay and two micro-batches a step, so that the dropout seeds, the decay and the
    // accumulation are covered; 4 steps of 2 sequences cross an epoch boundary (the episode gives 5 or 6
    // samples).
    let flags = "--lr 5e-3 --warmup-steps 1 --max-steps 4 --batch-size 1 --grad-accum 2 --lora-dropout 0.1 \
        --save-every 2 --seed 5 --lora-rank 4 --weight-decay 0.01 --adapter-keys transformers5";
    let full = askgui_train::train(&config(&data, &dir.join("full"), flags), &none()).unwrap();
    assert_eq!(full.steps.len(), 4);
    assert_eq!(full.steps.last().unwrap().epoch, 1, "the run crosses an epoch");

    let part_dir = dir.join("part");
    let stop = RunControl { stop_after: Some(2), ..RunControl::default() };
    let first = askgui_train::train(&config(&data, &part_dir, flags), &stop).unwrap();
    // A fresh run into a folder with checkpoints is refused: it would overwrite them.
    let e = askgui_train::train(&config(&data, &part_dir, flags), &stop).unwrap_err().to_string();
    assert!(e.contains("already holds checkpoints") && e.contains("--resume"), "{e}");
    assert!(first.stopped_early && first.steps.len() == 2);
    let ckpt = first.last_checkpoint.clone().unwrap();
    assert_eq!(ckpt, part_dir.join("checkpoint-0000002"));
    for f in ["adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors", "trainer_state.json"] {
        assert!(ckpt.join(f).is_file(), "{f} missing");
    }
    // The adapter is in PEFT-on-transformers-5's key layout, as asked; resuming reads it back.
    let adapter = candle_core::safetensors::load(ckpt.join("adapter_model.safetensors"), &candle_core::Device::Cpu);
    let keys: Vec<String> = adapter.unwrap().into_keys().collect();
    assert!(keys.iter().any(|k| k.starts_with("base_model.model.model.language_model.layers.0.")), "{keys:?}");
    // Resume as a user would: only --resume; the rest comes from the checkpoint's config.toml.
    let (cfg, control) = from_args(["askgui-train", "--resume", part_dir.to_str().unwrap()]).unwrap();
    assert_eq!(control.resume.as_deref(), Some(part_dir.as_path()));
    let second = askgui_train::train(&cfg, &control).unwrap();
    assert_eq!(second.steps.first().map(|s| s.step), Some(3));

    let resumed: Vec<f64> = first.steps.iter().chain(&second.steps).map(|s| s.loss).collect();
    let straight: Vec<f64> = full.steps.iter().map(|s| s.loss).collect();
    eprintln!("uninterrupted {straight:?}\nresumed       {resumed:?}");
    // Bitwise: the resumed run loads the exact f32 adapter and moments, and every random draw and the data
    // order are functions of (seed, epoch, step); candle's CPU kernels are deterministic at a fixed thread
    // count.
    assert_eq!(resumed, straight);
    let lrs = |s: &askgui_train::TrainSummary| s.steps.iter().map(|l| l.lr).collect::<Vec<_>>();
    assert_eq!([lrs(&first), lrs(&second)].concat(), lrs(&full));
    // The metrics of the resumed folder hold each step once.
    let metrics = std::fs::read_to_string(part_dir.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 4);
}

#[test]
fn bad_records_are_reported_with_their_line_or_skipped_and_counted() {
    let dir = scratch("bad");
    let data = episodes(&dir, 3);
    let clean = std::fs::read_to_string(&data).unwrap();
    let mut lines: Vec<String> = clean.lines().map(String::from).collect();
    lines.insert(1, "{\"id\": \"broken\", \"steps\": [".into());
    std::fs::write(&data, lines.join("\n") + "\n").unwrap();
    let flags = "--max-steps 1 --save-checkpoints false";
    let e = askgui_train::train(&config(&data, &dir.join("run"), flags), &none()).unwrap_err();
    eprintln!("{e}");
    assert!(matches!(e, TrainError::BadRecord { line: 2, .. }), "{e}");
    assert!(e.to_string().contains("train.jsonl:2:"), "{e}");

    let skip = DataOptions { skip_bad_records: true, ..data_options(0) };
    let (tok, images) = tokenizer_and_images();
    let d = data::load_dataset(&data, &skip, &tok, &images).unwrap();
    assert_eq!((d.stats.records, d.stats.bad_records), (4, 1));
    assert!(d.samples.iter().all(|s| s.line != 2) && d.samples.iter().any(|s| s.line == 4));

    // A missing screenshot names the file, the line, the episode, the step and the image.
    std::fs::write(&data, &clean).unwrap();
    let first: serde_json::Value = serde_json::from_str(clean.lines().next().unwrap()).unwrap();
    let image = dir.join(first["steps"][1]["screenshot"].as_str().unwrap());
    std::fs::remove_file(&image).unwrap();
    let e = askgui_train::train(&config(&data, &dir.join("run"), flags), &none()).unwrap_err();
    let msg = e.to_string();
    eprintln!("{msg}");
    assert!(matches!(e, TrainError::Image { .. }), "{msg}");
    let name = image.file_name().unwrap().to_str().unwrap();
    assert!(msg.contains("train.jsonl:1:") && msg.contains("step 1") && msg.contains(name), "{msg}");
    assert!(msg.contains("does not exist"), "{msg}");
    // With --skip-bad-records that episode is left out and counted.
    let d = data::load_dataset(&data, &skip, &tok, &images).unwrap();
    assert_eq!((d.stats.records, d.stats.bad_records), (3, 1));
    assert!(d.samples.iter().all(|s| s.line != 1));
}

#[test]
fn long_samples_lose_their_oldest_history_and_are_counted() {
    let dir = scratch("long");
    let data = episodes(&dir, 3);
    let (tok, images) = tokenizer_and_images();
    let all = data::load_dataset(&data, &data_options(0), &tok, &images).unwrap();
    assert_eq!((all.stats.truncated, all.stats.too_long, all.stats.screen_mismatch), (0, 0, 0));
    // A context at the mean length: the later steps of each episode (longer histories) must be cut, and
    // a sample that is too long even without history is left out.
    let limit = all.stats.tokens / all.stats.samples;
    let cut = data::load_dataset(&data, &DataOptions { max_seq_len: limit, ..data_options(0) }, &tok, &images).unwrap();
    let st = &cut.stats;
    eprintln!("{:?}\n{st:?}", all.stats);
    assert!(st.truncated > 0, "{st:?}");
    assert_eq!(st.samples + st.too_long, all.stats.samples);
    assert!(cut.samples.iter().all(|s| s.ids.len() <= limit));
    let over = all.samples.iter().filter(|s| s.ids.len() > limit).count();
    assert_eq!(st.truncated + st.too_long, over, "every sample over the limit was cut or left out");
    // The target is never cut: each kept sample supervises the same tokens as its uncut twin.
    let sup = |x: &data::PreparedSample| -> Vec<u32> {
        x.ids.iter().zip(&x.labels_mask).filter(|(_, &m)| m).map(|(&t, _)| t).collect()
    };
    for s in &cut.samples {
        let twin = all
            .samples
            .iter()
            .find(|a| (a.line, a.step, &a.ids[a.ids.len() - 8..]) == (s.line, s.step, &s.ids[s.ids.len() - 8..]));
        assert_eq!(sup(twin.unwrap()), sup(s));
    }
}

#[test]
fn a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint() {
    let dir = scratch("nan");
    let data = episodes(&dir, 1);
    let out = dir.join("run");
    // An absurd lr puts every B near 1e35 after the first step; the next forward overflows f32.
    let flags = "--lr 1e35 --warmup-steps 0 --max-steps 4 --batch-size 1 --grad-accum 1 --save-every 1 \
        --max-grad-norm 0 --lora-dropout 0";
    let e = askgui_train::train(&config(&data, &out, flags), &none()).unwrap_err();
    let TrainError::NonFinite { step, last_checkpoint, .. } = &e else { panic!("{e}") };
    eprintln!("{e}");
    assert_eq!(*step, 2);
    assert_eq!(last_checkpoint.as_deref(), Some(out.join("checkpoint-0000001").as_path()));
    assert!(e.to_string().contains("step 2") && e.to_string().contains("checkpoint-0000001"), "{e}");
    assert_eq!(snapshot::read_state(&out.join("checkpoint-0000001")).unwrap().step, 1);
    assert!(!out.join("checkpoint-0000002").exists());
}

/// The per-step losses logged in `dir/metrics.jsonl`.
fn logged_losses(dir: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|v| v["loss"].as_f64())
        .collect()
}

#[test]
fn a_killed_binary_resumes_from_its_last_checkpoint() {
    let dir = scratch("kill");
    let data = episodes(&dir, 1);
    let flags = "--lr 5e-3 --warmup-steps 0 --max-steps 4 --batch-size 1 --grad-accum 1 --save-every 1 --seed 2 \
        --lora-rank 4";
    let reference: Vec<f64> = askgui_train::train(&config(&data, &dir.join("reference"), flags), &none())
        .unwrap()
        .steps
        .iter()
        .map(|s| s.loss)
        .collect();

    // The binary, killed (SIGKILL) as soon as its first checkpoint is complete.
    let out = dir.join("killed");
    let fixture = fixture();
    let mut argv: Vec<&str> = vec!["--model", fixture.to_str().unwrap(), "--data", data.to_str().unwrap()];
    argv.extend(["--output-dir", out.to_str().unwrap(), "--max-pixels", "12544", "--progress", "false"]);
    argv.extend(flags.split_whitespace());
    let log = std::fs::File::create(dir.join("log.txt")).unwrap();
    let bin = env!("CARGO_BIN_EXE_askgui-train");
    let mut child = std::process::Command::new(bin).args(&argv).stderr(log).spawn().unwrap();
    let first = out.join("checkpoint-0000001").join(snapshot::STATE_FILE);
    let t0 = std::time::Instant::now();
    while !first.exists() && t0.elapsed().as_secs() < 60 {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let at = snapshot::read_state(&snapshot::find(&out).unwrap()).unwrap().step;
    eprintln!("killed after the checkpoint of step {at}");
    assert!(at >= 1);

    // `--resume OUT` continues from the newest checkpoint with the saved config.
    let log = std::fs::File::create(dir.join("log-resume.txt")).unwrap();
    let status = std::process::Command::new(bin).args(["--resume", out.to_str().unwrap()]).stderr(log).status();
    assert!(status.unwrap().success(), "see {}", dir.join("log-resume.txt").display());
    assert_eq!(logged_losses(&out), reference);
}

#[test]
fn the_binary_explains_conflicting_model_flags() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_askgui-train"))
        .args(["--model", "m", "--init-config", "c.json", "--data", "d.jsonl", "--mode", "full"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--model and --init-config exclude each other"), "{err}");
}

#[test]
fn accumulated_micro_batches_equal_one_batch() {
    let dir = scratch("accum");
    let data = episodes(&dir, 1);
    let common = "--lr 5e-3 --warmup-steps 0 --max-steps 2 --lora-dropout 0 --save-checkpoints false --lora-rank 4";
    let run = |name: &str, shape: &str| -> Vec<f64> {
        let cfg = config(&data, &dir.join(name), &format!("{common} {shape}"));
        askgui_train::train(&cfg, &none()).unwrap().steps.iter().map(|s| s.loss).collect()
    };
    let one = run("one", "--batch-size 2 --grad-accum 1");
    let two = run("two", "--batch-size 1 --grad-accum 2");
    eprintln!("one batch {one:?}\ntwo micro-batches {two:?}");
    // Same sequences, same token-weighted mean: equal up to f32 summation order (the batch of two is
    // padded to the longer sequence, the micro-batches are not), which moves the loss by ~1e-7 relative.
    for (a, b) in one.iter().zip(&two) {
        assert!((a - b).abs() < 1e-5 * a.abs(), "{a} vs {b}");
    }
}

#[test]
fn only_the_target_is_supervised_and_images_get_their_pads() {
    let dir = scratch("mask");
    let data = episodes(&dir, 1);
    let (tok, images) = tokenizer_and_images();
    let d = data::load_dataset(&data, &data_options(0), &tok, &images).unwrap();
    for s in &d.samples {
        let target: Vec<u32> = s.ids.iter().zip(&s.labels_mask).filter(|(_, &m)| m).map(|(&t, _)| t).collect();
        let text = tok.decode(&target, false).unwrap();
        let json = text.strip_suffix("<|im_end|>").unwrap_or_else(|| panic!("{text:?}"));
        let action: serde_json::Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{json:?}: {e}"));
        assert!(action["action"].is_string(), "{json}");
        // The supervised tokens are one run after `<|im_start|>assistant\n`, followed only by the newline
        // that closes the turn.
        let first = s.labels_mask.iter().position(|&m| m).unwrap();
        let n = s.ids.len();
        assert!(s.labels_mask[first..n - 1].iter().all(|&m| m) && !s.labels_mask[n - 1], "one run");
        assert_eq!(tok.decode(&s.ids[n - 1..], false).unwrap(), "\n");
        assert!(tok.decode(&s.ids[..first], false).unwrap().ends_with("<|im_start|>assistant\n"));
        // Each image's pads: its merged-patch count.
        let pads = s.ids.iter().filter(|&&t| t == tok.image_pad_id).count();
        assert_eq!(pads, s.grids.iter().map(|g| g.iter().product::<usize>() / 4).sum::<usize>());
        assert_eq!(s.images.len(), 1);
    }
}

/// The demo's screens (168x308 on the 28-pixel grid, seen unresized): every screen token inside a listed
/// element gets one of its words, as the task spells them; the tokens of the element the action clicks
/// get the action's name instead; nothing else gets a target.
#[test]
fn region_targets_name_what_each_screen_token_shows() {
    let dir = scratch("region");
    let args = SynthArgs {
        out: dir.clone(),
        episodes: 12,
        seed: 3,
        width: 168,
        height: 308,
        split: "1:0:0".into(),
        ambiguous_fraction: 0.0,
        slot_colors: true,
        grid: 28,
        icons: true,
    };
    synth(&args).expect("synth");
    let data = dir.join("train.jsonl");
    let (tok, mut images) = tokenizer_and_images();
    images.max_pixels = 57_344;
    let prompt = PromptConfig { min_pixels: images.min_pixels, max_pixels: images.max_pixels, ..Default::default() };
    let opts = DataOptions { prompt, region_words: true, ..data_options(0) };
    let d = data::load_dataset(&data, &opts, &tok, &images).unwrap();
    assert!(data::load_dataset(&data, &DataOptions { region_words: false, ..opts.clone() }, &tok, &images)
        .unwrap()
        .samples
        .iter()
        .all(|s| s.region_targets.is_empty()));
    let episodes: Vec<askgui_data::Episode> =
        std::fs::read_to_string(&data).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let click = tok.encode("click").unwrap()[0];
    let (mut marked, mut named) = (0, 0);
    for s in &d.samples {
        let ep = &episodes[s.line - 1];
        let step = &ep.steps[s.step];
        assert_eq!(s.grids, [[1, 22, 12]], "168x308 is seen unresized: 11 x 6 merged tokens");
        let start = s.ids.iter().position(|&t| t == tok.image_pad_id).unwrap();
        let at: std::collections::HashMap<usize, u32> = s.region_targets.iter().copied().collect();
        assert_eq!(at.len(), s.region_targets.len(), "one target per token");
        let target = step.action.target().and_then(|t| t.xy());
        for e in step.elements.iter().flatten().filter(|e| !e.text.trim().is_empty()) {
            let [x1, y1, x2, y2] = e.bbox;
            // The elements of this world sit on whole 28-pixel cells, except the list rows, which leave
            // 8 pixels each side (still covering the centres of the cells they span).
            let lower = ep.task.to_lowercase();
            let phrase = match lower.find(&e.text.to_lowercase()) {
                Some(i) => ep.task[i..i + e.text.len()].to_string(),
                None => e.text.clone(),
            };
            named += (phrase != e.text) as usize;
            let words = tok.encode(&format!(" {phrase}")).unwrap();
            let clicked = target.is_some_and(|(x, y)| x >= x1 && x < x2 && y >= y1 && y < y2);
            let mut k = 0;
            for r in 0..11 {
                for c in 0..6 {
                    let (cx, cy) = (c * 28 + 14, r * 28 + 14);
                    if cx < x1 || cx >= x2 || cy < y1 || cy >= y2 {
                        continue;
                    }
                    let got = at.get(&(start + (r * 6 + c) as usize)).copied();
                    let want = if clicked { click } else { words[k % words.len()] };
                    assert_eq!(got, Some(want), "{} step {} `{}` cell ({r}, {c})", ep.id, s.step, e.text);
                    k += 1;
                    marked += clicked as usize;
                }
            }
        }
        let cells: usize = at.keys().filter(|&&p| p >= start && p < start + 66).count();
        assert_eq!(cells, at.len(), "targets only on the screenshot's tokens");
    }
    assert!(marked > 0 && named > 0, "the check saw clicked elements ({marked}) and named ones ({named})");

    // With the previous screenshot in the prompt, the current one gets the same targets (shifted to its
    // pads), and the earlier one gets the previous step's: the same cells, the same words where that
    // step's own sample had no marker (the tokenizer is byte-level, so the marker, `c`, is also a letter).
    let prompt = PromptConfig { history_images: 1, ..opts.prompt.clone() };
    let h = data::load_dataset(&data, &DataOptions { prompt, ..opts.clone() }, &tok, &images).unwrap();
    let pad = |s: &data::PreparedSample, nth: usize| {
        s.ids.iter().enumerate().filter(|(_, &t)| t == tok.image_pad_id).nth(nth * 66).unwrap().0
    };
    // The targets on image `nth`, by cell.
    let cells = |s: &data::PreparedSample, nth: usize| {
        let start = pad(s, nth);
        let on = s.region_targets.iter().filter(|t| t.0 >= start && t.0 < start + 66);
        on.map(|&(p, t)| (p - start, t)).collect::<Vec<_>>()
    };
    let mut with_history = 0;
    for (a, b) in d.samples.iter().zip(&h.samples) {
        assert_eq!((a.line, a.step), (b.line, b.step));
        assert_eq!(cells(a, 0), cells(b, b.images.len() - 1), "{} step {}", a.episode, a.step);
        if b.images.len() == 2 {
            with_history += 1;
            let prev = d.samples.iter().find(|p| (p.line, p.step) == (b.line, b.step - 1)).unwrap();
            let (want, got) = (cells(prev, 0), cells(b, 0));
            assert_eq!(want.iter().map(|c| c.0).collect::<Vec<_>>(), got.iter().map(|c| c.0).collect::<Vec<_>>());
            for (w, g) in want.iter().zip(&got) {
                assert!(w.1 == click || w.1 == g.1, "{} step {} cell {}: {} != {}", b.episode, b.step, w.0, g.1, w.1);
            }
        }
    }
    assert!(with_history > 0);

    // Ambiguous tasks: the ask sample marks no element (an ask acts on none), and the sample after the
    // user's answer, which the prompt lists before the screenshot, marks the element the action acts on:
    // the two differ only there (both share the one screenshot; the pads sit at different offsets).
    let amb = scratch("region-ambiguous");
    synth(&SynthArgs { out: amb.clone(), ambiguous_fraction: 1.0, ..args }).expect("synth");
    let data = amb.join("train.jsonl");
    let task_mode = askgui_data::TaskMode::Ambiguous;
    let a = data::load_dataset(&data, &DataOptions { task_mode, ..opts.clone() }, &tok, &images).unwrap();
    let episodes: Vec<askgui_data::Episode> =
        std::fs::read_to_string(&data).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let (mut asked, mut asked_steps, mut differ) = (0, 0, 0);
    for (i, ep) in episodes.iter().enumerate() {
        for (k, step) in ep.steps.iter().enumerate().filter(|(_, st)| st.ask.is_some()) {
            let both: Vec<_> = a.samples.iter().filter(|s| (s.line, s.step) == (i + 1, k)).collect();
            assert_eq!(both.len(), 2, "{} step {k}: the ask and the action after the answer", ep.id);
            asked_steps += 1;
            let Some((x, y)) = step.action.target().and_then(|t| t.xy()) else { continue };
            let marker = tok.encode(step.action.name()).unwrap()[0];
            let (ask, after) = (cells(both[0], 0), cells(both[1], 0));
            assert_eq!(ask.iter().map(|c| c.0).collect::<Vec<_>>(), after.iter().map(|c| c.0).collect::<Vec<_>>());
            for (w, g) in ask.iter().zip(&after) {
                assert!(w.1 == g.1 || g.1 == marker, "{} step {k} cell {}: {} -> {}", ep.id, w.0, w.1, g.1);
                differ += (w.1 != g.1) as usize;
            }
            let cell = (y / 28) as usize * 6 + (x / 28) as usize;
            assert_eq!(after.iter().find(|c| c.0 == cell).map(|c| c.1), Some(marker), "{} step {k}", ep.id);
            asked += 1;
        }
    }
    assert!(differ > 0, "the answer's sample marks what the ask's does not");
    // `--ask-repeat` and `--say-repeat` copy the two samples of an asked step, and only those.
    let more = DataOptions { task_mode, ask_repeat: 2, say_repeat: 3, ..opts.clone() };
    let m = data::load_dataset(&data, &more, &tok, &images).unwrap();
    assert_eq!(m.samples.len(), a.samples.len() + 3 * asked_steps, "one more ask and two more answers each");
    // `--dialog-repeat` copies the steps after an episode's first asked step that are not asked themselves.
    let in_dialog: usize = episodes
        .iter()
        .filter_map(|ep| ep.steps.iter().position(|st| st.ask.is_some()).map(|f| (ep, f)))
        .map(|(ep, f)| ep.steps[f + 1..].iter().filter(|st| st.ask.is_none()).count())
        .sum();
    assert!(in_dialog > 0, "the ambiguous world has steps after an answer");
    let dialog = DataOptions { task_mode, dialog_repeat: 3, ..opts.clone() };
    let m = data::load_dataset(&data, &dialog, &tok, &images).unwrap();
    assert_eq!(m.samples.len(), a.samples.len() + 2 * in_dialog, "two more copies of each step after an answer");
    assert!(asked > 0, "the ambiguous world has asked steps that act on a point");
}

#[test]
fn reference_kernels_train_as_the_askgui_kernels_do() {
    let dir = scratch("kernels");
    let data = episodes(&dir, 1);
    let common = "--lr 5e-3 --warmup-steps 0 --max-steps 3 --grad-accum 2 --lora-dropout 0 --save-checkpoints false \
        --lora-rank 4";
    let run = |kernels: &str| -> Vec<f64> {
        let cfg = config(&data, &dir.join(kernels), &format!("{common} --kernels {kernels}"));
        assert_eq!(format!("{:?}", cfg.model.kernels).to_lowercase(), kernels);
        askgui_train::train(&cfg, &none()).unwrap().steps.iter().map(|s| s.loss).collect()
    };
    let (ours, reference) = (run("askgui"), run("reference"));
    eprintln!("askgui {ours:?}\nreference {reference:?}");
    // The first loss differs by f32 summation order only (~1e-7, `model/tests/kernel_choice.rs`); AdamW's
    // division by sqrt(v) can turn that noise on a near-zero gradient into part of a step, so the later
    // losses are allowed 1e-4.
    assert_eq!(ours.len(), 3);
    assert!((ours[0] - reference[0]).abs() <= 1e-5 * ours[0].abs(), "{ours:?} vs {reference:?}");
    for (a, b) in ours.iter().zip(&reference) {
        assert!((a - b).abs() <= 1e-4 * a.abs(), "{ours:?} vs {reference:?}");
    }
}

/// `--dtype bf16` trains on the CPU (bf16 weights and activations, f32 LoRA masters, the loss in f32)
/// and follows the f32 run: three steps' losses within 2% (bf16 keeps 8 significant bits, so each
/// rounding moves a value by up to 2^-9 relative; about 150 roundings between the input and the loss add
/// up to a few tenths of a percent, and a wrong cast or a lost master would move the loss by far more).
#[test]
fn bf16_trains_on_the_cpu_like_f32() {
    let dir = scratch("bf16");
    let data = episodes(&dir, 1);
    let common = "--lr 5e-3 --warmup-steps 0 --max-steps 3 --lora-dropout 0 --save-checkpoints false --lora-rank 4 \
        --device cpu";
    let run = |dtype: &str| -> Vec<f64> {
        let cfg = config(&data, &dir.join(dtype), &format!("{common} --dtype {dtype}"));
        askgui_train::train(&cfg, &none()).unwrap().steps.iter().map(|s| s.loss).collect()
    };
    let (f32_losses, bf16_losses) = (run("f32"), run("bf16"));
    eprintln!("f32 {f32_losses:?}\nbf16 {bf16_losses:?}");
    assert_eq!(bf16_losses.len(), 3);
    for (a, b) in f32_losses.iter().zip(&bf16_losses) {
        assert!(b.is_finite() && (a - b).abs() <= 0.02 * a.abs(), "{f32_losses:?} vs {bf16_losses:?}");
    }
}

/// Every checkpoint carries `askgui.json`: the prompt and image settings the run trained with, which eval
/// and serve then apply by default.
#[test]
fn checkpoints_carry_the_runs_prompt_and_image_settings() {
    let dir = scratch("card");
    let data = episodes(&dir, 1);
    let flags = "--lr 5e-3 --warmup-steps 0 --max-steps 1 --save-every 1 --lora-rank 4 --system-prompt compact";
    let summary = askgui_train::train(&config(&data, &dir.join("run"), flags), &none()).unwrap();
    let ckpt = summary.last_checkpoint.expect("a checkpoint");
    let card: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("askgui.json")).expect("askgui.json")).unwrap();
    assert_eq!(card["image"]["max_pixels"], 12544, "{card}");
    assert_eq!(card["prompt"]["system_prompt"], "compact", "{card}");
}

#[test]
fn packing_trains_the_same_steps_without_computing_padding() {
    let dir = scratch("packing");
    let data = episodes(&dir, 2);
    // Both runs cut samples to the same --max-seq-len, so they train on identical sequences.
    let common = "--lr 5e-3 --warmup-steps 0 --max-steps 3 --lora-dropout 0 --save-checkpoints false --lora-rank 4 \
                  --batch-size 4 --grad-accum 1 --max-seq-len 2600";
    let run = |name: &str, extra: &str| {
        let cfg = config(&data, &dir.join(name), &format!("{common} {extra}"));
        askgui_train::train(&cfg, &none()).unwrap().steps
    };
    let (padded, packed) = (run("padded", ""), run("packed", "--packing"));
    for (a, b) in padded.iter().zip(&packed) {
        eprintln!(
            "step {}: loss {:.7} / {:.7}, tokens {}, computed {} / {}",
            a.step, a.loss, b.loss, a.tokens, a.computed_tokens, b.computed_tokens
        );
        assert_eq!((a.tokens, a.supervised_tokens), (b.tokens, b.supervised_tokens), "the same sequences");
        // More tokens than one pack holds: the step is split into several packs.
        assert!(b.tokens > 2600, "step {}: {} tokens fit one pack; the test needs several", b.step, b.tokens);
        assert_eq!(b.computed_tokens, b.tokens, "a pack computes no padding");
        assert!(a.computed_tokens > a.tokens, "the padded batch computes padding");
        // As `accumulated_micro_batches_equal_one_batch`: equal up to f32 summation order.
        assert!((a.loss - b.loss).abs() < 1e-5 * a.loss.abs(), "step {}: {} vs {}", a.step, a.loss, b.loss);
    }
    assert_eq!(packed.len(), 3);
}

/// `--micro-batch-threads 2` runs a step's micro-batches side by side and sums them in plan order: the
/// same steps as one micro-batch after another. Unpacked, the plan is the same (four micro-batches of
/// one), so only kernel threading differs; packed, the step is split into two balanced packs instead of
/// one, which moves the loss by f32 summation order only.
#[test]
fn micro_batches_on_threads_train_the_same_steps() {
    let dir = scratch("threads");
    let data = episodes(&dir, 2);
    let common = "--lr 5e-3 --warmup-steps 0 --max-steps 3 --lora-dropout 0 --save-checkpoints false --lora-rank 4 \
                  --batch-size 1 --grad-accum 4 --device cpu";
    let run = |name: &str, extra: &str| {
        let cfg = config(&data, &dir.join(name), &format!("{common} {extra}"));
        askgui_train::train(&cfg, &none()).unwrap().steps
    };
    // Unpacked, the micro-batches and their summing order are the same, only the kernels' threading differs
    // (bitwise equal on the development machine; 1e-6 leaves room for a GEMM that splits its sums by thread
    // count). Packed, the grouping differs: f32 summation order, as in the packing test (1e-5).
    let pairs = [
        (run("serial", ""), run("threads", "--micro-batch-threads 2"), 1e-6),
        (run("packed", "--packing"), run("packed-threads", "--packing --micro-batch-threads 2"), 1e-5),
    ];
    for (serial, threads, tol) in &pairs {
        assert_eq!(serial.len(), 3);
        for (a, b) in serial.iter().zip(threads) {
            eprintln!(
                "step {}: loss {:.8} / {:.8}, grad norm {:.8} / {:.8}",
                a.step, a.loss, b.loss, a.grad_norm, b.grad_norm
            );
            assert_eq!(
                (a.tokens, a.supervised_tokens, a.computed_tokens),
                (b.tokens, b.supervised_tokens, b.computed_tokens)
            );
            assert!((a.loss - b.loss).abs() <= tol * a.loss.abs(), "step {}: {} vs {}", a.step, a.loss, b.loss);
            let rel = (a.grad_norm - b.grad_norm).abs() / a.grad_norm;
            assert!(rel <= *tol, "step {}: grad norm {} vs {}", a.step, a.grad_norm, b.grad_norm);
        }
    }
}

#[test]
fn micro_batch_threads_are_refused_off_the_cpu() {
    let dir = scratch("threads-gpu");
    let data = episodes(&dir, 1);
    let mut cfg = config(&data, &dir.join("run"), "--max-steps 1 --micro-batch-threads 2 --device cpu");
    cfg.model.device = askgui_model::DeviceKind::Cuda;
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.contains("--micro-batch-threads 2") && err.contains("--device cpu"), "{err}");
    cfg.model.device = askgui_model::DeviceKind::Cpu;
    cfg.optim.micro_batch_threads = 0;
    assert!(cfg.validate().unwrap_err().to_string().contains("at least 1"));
}
