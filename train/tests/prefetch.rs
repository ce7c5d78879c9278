//! `--prefetch`: micro-batches made on a background thread while the step runs change no loss, an
//! interrupt stops the thread and the run resumes bitwise, a screenshot that cannot be decoded stops the
//! run with the same error as inline and never hangs it, and a sample's pixels are its screenshots' rows
//! in prompt order.
//!
//! On the tiny fixture with synthetic episodes and tiny images (`--max-pixels 12544`), seconds each.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use askgui_model::{load_image, pixel_rows, preprocess};
use askgui_train::cli::from_args;
use askgui_train::data;
use askgui_train::{RunControl, TrainError};
use candle_core::Device;
use common::{config, data_options, episodes, scratch, tokenizer_and_images};

/// Runs `f` on a thread; a run that takes over two minutes fails the test instead of hanging it.
fn without_hanging<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(f()).unwrap());
    rx.recv_timeout(Duration::from_secs(120)).expect("the run hung")
}

/// Same steps, same order, same pixels: only when a micro-batch is made changes, so the losses and
/// gradient norms are bitwise those of the inline run (the model's step runs on the same thread with
/// the same inputs either way). Dropout and two micro-batches a step make a wrong order or a wrong
/// micro-batch number (it seeds the dropout mask) show; 3 steps of 2 sequences visit every sample.
#[test]
fn prefetch_changes_no_loss() {
    let dir = scratch("prefetch-same");
    let data = episodes(&dir, 1);
    let common = "--lr 5e-3 --warmup-steps 1 --max-steps 3 --batch-size 1 --grad-accum 2 --lora-dropout 0.1 \
        --save-checkpoints false --lora-rank 4 --seed 3";
    let run = |name: &str, depth: usize| {
        let cfg = config(&data, &dir.join(name), &format!("{common} --prefetch {depth}"));
        assert_eq!(cfg.data.prefetch, depth);
        askgui_train::train(&cfg, &RunControl::default()).unwrap().steps
    };
    let (inline, ahead) = (run("inline", 0), run("ahead", 2));
    let losses = |s: &[askgui_train::StepLog]| s.iter().map(|l| (l.loss, l.grad_norm)).collect::<Vec<_>>();
    eprintln!("inline {:?}\nahead  {:?}", losses(&inline), losses(&ahead));
    assert_eq!(inline.len(), 3);
    assert_eq!(losses(&inline), losses(&ahead));
    let tokens = |s: &[askgui_train::StepLog]| s.iter().map(|l| (l.tokens, l.computed_tokens)).collect::<Vec<_>>();
    assert_eq!(tokens(&inline), tokens(&ahead));
}

/// Polls of [`interrupt_at_the_second_poll`].
static POLLS: AtomicUsize = AtomicUsize::new(0);

/// The trainer polls before each step: this interrupts the run after its first step.
fn interrupt_at_the_second_poll() -> bool {
    POLLS.fetch_add(1, Ordering::SeqCst) >= 1
}

/// An interrupt while the thread holds micro-batches ahead (and is blocked on the full channel) stops the
/// run after the step in flight with a checkpoint, without hanging; resumed, the run repeats the
/// uninterrupted one bitwise.
#[test]
fn an_interrupted_prefetching_run_stops_and_resumes_bitwise() {
    let dir = scratch("prefetch-interrupt");
    let data = episodes(&dir, 1);
    let flags = "--lr 5e-3 --warmup-steps 0 --max-steps 2 --batch-size 1 --grad-accum 2 --lora-dropout 0.1 \
        --save-every 10 --lora-rank 4 --seed 4 --prefetch 2";
    let straight = askgui_train::train(&config(&data, &dir.join("straight"), flags), &RunControl::default()).unwrap();
    let out = dir.join("part");
    let cfg = config(&data, &out, flags);
    let control = RunControl { interrupted: Some(interrupt_at_the_second_poll), ..RunControl::default() };
    let first = without_hanging(move || askgui_train::train(&cfg, &control).unwrap());
    assert!(first.interrupted && first.steps.len() == 1, "{:?}", first.steps);
    let (cfg, control) = from_args(["askgui-train", "--resume", out.to_str().unwrap()]).unwrap();
    assert_eq!(cfg.data.prefetch, 2, "the saved config keeps --prefetch");
    let second = askgui_train::train(&cfg, &control).unwrap();
    let losses = |s: &[askgui_train::StepLog]| s.iter().map(|l| (l.loss, l.grad_norm)).collect::<Vec<_>>();
    assert_eq!(losses(&[first.steps, second.steps].concat()), losses(&straight.steps));
}

/// Cuts a PNG inside its first IDAT chunk: the header (and so the size the loader checks) stays readable,
/// the pixels do not decode.
fn cut_png(path: &std::path::Path) {
    let bytes = std::fs::read(path).unwrap();
    let idat = bytes.windows(4).position(|w| w == b"IDAT").expect("a PNG with an IDAT chunk");
    std::fs::write(path, &bytes[..idat + 4 + 8]).unwrap();
}

/// A screenshot whose header reads but whose pixels do not decode passes loading; the step that needs it
/// stops the run with an error that names the data file's line, the episode, the step and the image,
/// word for word the inline run's, and the run ends (no hang).
#[test]
fn an_undecodable_screenshot_stops_the_run_with_the_inline_error() {
    let dir = scratch("prefetch-bad");
    let data = episodes(&dir, 1);
    let text = std::fs::read_to_string(&data).unwrap();
    let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    let image = dir.join(first["steps"][1]["screenshot"].as_str().unwrap());
    cut_png(&image);
    // 4 steps of 2 sequences visit every sample of the episode (it gives 5 or 6), step 1's among them.
    let flags = "--max-steps 4 --batch-size 1 --grad-accum 2 --save-checkpoints false --lora-rank 4";
    let run = |depth: usize| {
        let cfg = config(&data, &dir.join(format!("run-{depth}")), &format!("{flags} --prefetch {depth}"));
        let fails = move || askgui_train::train(&cfg, &RunControl::default()).map(|s| s.steps.len()).unwrap_err();
        without_hanging(fails)
    };
    let (inline, ahead) = (run(0), run(2));
    let msg = ahead.to_string();
    eprintln!("{msg}");
    assert!(matches!(ahead, TrainError::Image { step: 1, .. }), "{msg}");
    let name = image.file_name().unwrap().to_str().unwrap();
    assert!(msg.contains("train.jsonl:1:") && msg.contains("step 1") && msg.contains(name), "{msg}");
    assert!(msg.contains("cannot decode"), "{msg}");
    assert_eq!(msg, inline.to_string());
}

/// With an earlier screenshot in the prompt, a sample's pixel rows are each screenshot's rows through the
/// image processor, oldest first (the order of its pads): the rows built image by image and stacked.
#[test]
fn a_samples_pixels_are_its_screenshots_rows_in_prompt_order() {
    let dir = scratch("prefetch-rows");
    let data = episodes(&dir, 1);
    let (tok, images) = tokenizer_and_images();
    let opts = data_options(1);
    let set = data::load_dataset(&data, &opts, &tok, &images).unwrap();
    let two = set.samples.iter().find(|s| s.images.len() == 2).expect("a sample with an earlier screenshot");
    let got = data::example(two, &set.path, &images, &Device::Cpu).unwrap().pixel_values.unwrap();
    let each: Vec<_> =
        two.images.iter().map(|p| preprocess(&load_image(p, usize::MAX).unwrap(), &images).unwrap()).collect();
    let want = pixel_rows(&each.iter().collect::<Vec<_>>(), &Device::Cpu).unwrap();
    assert_eq!(got.dims(), want.dims());
    assert_eq!(
        got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        want.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    );
    // The two screenshots differ, so the order is seen.
    assert_ne!(each[0].pixel_values, each[1].pixel_values);
}
