//! Runs a Qwen2.5-VL / Qwen2-VL checkpoint on one image and prints the generated text.
//!
//! cargo run --release -p askgui-model --example generate -- --model DIR|HUB_ID --image PATH --prompt TEXT
//!     [--max-new-tokens N] [--min-pixels N] [--max-pixels N] [--temperature T --top-p P --top-k K --seed S]
//!     [--dump FILE] [--timings] [--device cpu|cuda --dtype f32|bf16] [--repeat N]
//!
//! The prompt is one user turn holding the image and then the text, with the default system prompt.
//! `--dump FILE` writes a safetensors file with `input_ids` [1, T], `pixel_values` [P, 1176] f32,
//! `image_grid_thw` [1, 3], `logits` [T, V] f32 (every prompt position) and `generated_ids` [N], for
//! comparing against another implementation. `--timings` prints one JSON line of phase timings to stderr
//! (what `scripts/bench/bench_generate.sh` reads). `--repeat N` runs the generation N more times after the first
//! (a warm-up) and reports the medians; `--device cuda` (with `--features cuda`) runs on the first GPU.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use askgui_model::{generate, load_image, preprocess, render_chat, Content, Message, Prompt, Qwen2Vl, SamplingParams};
use candle_core::{DType, Device, Tensor};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Run a Qwen2.5-VL / Qwen2-VL checkpoint on one image")]
struct Args {
    /// Checkpoint directory or hub id.
    #[arg(long, env = "ASKGUI_MODEL")]
    model: String,
    #[arg(long)]
    image: PathBuf,
    #[arg(long)]
    prompt: String,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Overrides preprocessor_config.json.
    #[arg(long)]
    min_pixels: Option<usize>,
    /// Overrides preprocessor_config.json.
    #[arg(long)]
    max_pixels: Option<usize>,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep generating past end-of-sequence tokens (benchmarks want a fixed token count).
    #[arg(long)]
    ignore_eos: bool,
    /// Write inputs, prompt logits and generated ids to this safetensors file.
    #[arg(long)]
    dump: Option<PathBuf>,
    /// A LoRA adapter directory (PEFT format: adapter_config.json + adapter_model.safetensors).
    #[arg(long)]
    adapter: Option<std::path::PathBuf>,
    /// Print phase timings as one JSON line on stderr.
    #[arg(long)]
    timings: bool,
    /// Timed repetitions after the first generation (the timings are then medians).
    #[arg(long, default_value_t = 0)]
    repeat: usize,
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    device: DeviceArg,
    #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
    dtype: DTypeArg,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum DeviceArg {
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum DTypeArg {
    F32,
    Bf16,
}

fn main() -> std::process::ExitCode {
    askgui_model::pin_cpu_threads();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    // One readable line for the user, not a backtrace.
    match run(Args::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<()> {
    let device = match args.device {
        DeviceArg::Cpu => Device::Cpu,
        DeviceArg::Cuda => Device::new_cuda(0).context("--device cuda (build with --features cuda)")?,
    };
    let dtype = match args.dtype {
        DTypeArg::F32 => DType::F32,
        DTypeArg::Bf16 => DType::BF16,
    };
    let mut model = Qwen2Vl::load(&args.model, &device, dtype).context("loading the model")?;
    if let Some(dir) = &args.adapter {
        model.load_adapter("adapter", dir).with_context(|| format!("loading the adapter {}", dir.display()))?;
        model.set_active_adapter(Some("adapter"))?;
    }
    let tokenizer = model.tokenizer()?;

    let t0 = Instant::now();
    let mut icfg = model.image_config.clone();
    icfg.min_pixels = args.min_pixels.unwrap_or(icfg.min_pixels);
    icfg.max_pixels = args.max_pixels.unwrap_or(icfg.max_pixels);
    let img = load_image(&args.image, icfg.max_input_pixels)?;
    let processed = preprocess(&img, &icfg)?;
    let preprocess_s = t0.elapsed().as_secs_f64();

    let text = render_chat(&[Message::new("user", vec![Content::Image, Content::Text(args.prompt.clone())])], true);
    let ids = tokenizer.encode_prompt(&text, &[processed.num_tokens(model.cfg.vision.spatial_merge_size)])?;
    let stop_tokens = if args.ignore_eos { vec![] } else { model.eos_token_ids.clone() };
    let params = SamplingParams {
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        seed: args.seed,
        stop_tokens,
    };
    let prompt = Prompt { ids: ids.clone(), images: vec![processed.clone()] };
    let (gens, mut timings) = generate(&model, std::slice::from_ref(&prompt), &params, args.dump.is_some())?;
    if args.repeat > 0 {
        let mut runs = Vec::with_capacity(args.repeat);
        for _ in 0..args.repeat {
            runs.push(generate(&model, std::slice::from_ref(&prompt), &params, false)?.1);
        }
        let median = |f: fn(&askgui_model::Timings) -> f64| {
            let mut v: Vec<f64> = runs.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        timings.vision_s = median(|t| t.vision_s);
        timings.prefill_s = median(|t| t.prefill_s);
        timings.decode_s = median(|t| t.decode_s);
    }
    let g = &gens[0];
    println!("{}", tokenizer.decode(&g.tokens, true)?);

    if args.timings {
        let j = serde_json::json!({
            "preprocess_s": preprocess_s,
            "vision_s": timings.vision_s,
            "prefill_s": timings.prefill_s,
            "decode_s": timings.decode_s,
            "generate_s": timings.vision_s + timings.prefill_s + timings.decode_s,
            "prompt_tokens": ids.len(),
            "new_tokens": g.tokens.len(),
            "repeat": args.repeat,
            "device": format!("{:?}", args.device).to_lowercase(),
            "dtype": format!("{:?}", args.dtype).to_lowercase(),
        });
        eprintln!("{j}");
    }
    if let Some(path) = &args.dump {
        let mut t: HashMap<String, Tensor> = HashMap::new();
        let ids64: Vec<i64> = ids.iter().map(|&x| x as i64).collect();
        t.insert("input_ids".into(), Tensor::from_vec(ids64.clone(), (1, ids64.len()), &device)?);
        t.insert("pixel_values".into(), processed.pixel_tensor(&device)?);
        let grid: Vec<i64> = processed.grid_thw.iter().map(|&x| x as i64).collect();
        t.insert("image_grid_thw".into(), Tensor::from_vec(grid, (1, 3), &device)?);
        t.insert("logits".into(), g.prompt_logits.clone().context("prompt logits")?);
        let gen: Vec<i64> = g.tokens.iter().map(|&x| x as i64).collect();
        t.insert("generated_ids".into(), Tensor::from_vec(gen.clone(), gen.len(), &device)?);
        candle_core::safetensors::save(&t, path).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
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
