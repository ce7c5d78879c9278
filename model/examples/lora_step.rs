//! LoRA training steps on a Qwen2.5-VL checkpoint, timed, with peak memory and the gradients kept: the
//! measurement behind docs/benchmarks.md's LoRA-step table and the side-by-side with
//! `scripts/bench/bench_train_peft.py`.
//!
//! cargo run --release -p askgui-model --example lora_step -- --model DIR --path ops|composed
//!     [--checkpointing] [--batch N] [--steps N] [--save-adapter DIR] [--inspect-gradstore]
//!     [--device cpu|cuda --dtype f32|bf16 --image-size WxH --max-pixels N --supervised N]
//!
//! Paths: `ops` is the training path ([`Qwen2Vl::loss_and_grads`]: the kernels' CustomOps with explicit
//! backward, with or without gradient checkpointing); `composed` is the inference forward built from
//! plain candle ops with a reference masked cross-entropy on its logits, and candle's own `backward`.
//! One warm-up step, then `--steps` timed AdamW steps (lr 1e-4); the JSON line has the median step time,
//! tokens/s, the peak RSS (`VmHWM`, which includes loading the model) and the bytes of gradients kept.
//! `--inspect-gradstore` also runs the `ops` loss as one graph and sorts everything candle's own
//! `GradStore` holds into LoRA, base weights and other tensors (with the shapes of the others).
//! `--save-adapter DIR` saves the trained adapter in PEFT's transformers-5 key layout.
//! On CUDA (`--features cuda`) the JSON line also has the high-water marks of the device memory pool
//! that candle allocates from (`gpu_used_high_bytes`, `gpu_reserved_high_bytes`: torch's
//! `max_memory_allocated` / `max_memory_reserved`), over the timed steps and the warm-up; a bf16 model
//! keeps its adapter in f32 (the trainer's masters).
//!
//! Each sequence is `text/2` random text ids, `<|vision_start|>`, the image pads of one synthetic
//! `side x side` image, `<|vision_end|>`, and `text - text/2` random text ids; the trailing text is
//! supervised. The adapter targets the seven decoder projections (`q_proj` ... `down_proj`); since PEFT
//! matches by name suffix, `gate_proj` / `up_proj` / `down_proj` also match the vision tower's MLPs.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use askgui_kernels::ops::cross_entropy_masked_reference;
use askgui_model::{preprocess, AdapterLayout, LoraConfig, Qwen2Vl, StepOptions, TrainExample};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use clap::{Parser, ValueEnum};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum PathKind {
    Composed,
    Ops,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum DeviceArg {
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum DTypeArg {
    F32,
    Bf16,
}

#[derive(Parser, Debug)]
#[command(about = "LoRA training steps, timed, with peak RSS and the gradients kept")]
struct Args {
    #[arg(long)]
    model: String,
    #[arg(long, value_enum)]
    path: PathKind,
    /// Recompute every block in the backward (`ops` path only).
    #[arg(long)]
    checkpointing: bool,
    #[arg(long, default_value_t = 448)]
    image_side: u32,
    /// `WIDTHxHEIGHT` of the synthetic image (instead of `--image-side` squared), e.g. 1080x2400.
    #[arg(long)]
    image_size: Option<String>,
    /// The image processor's max_pixels (default: the checkpoint's).
    #[arg(long)]
    max_pixels: Option<usize>,
    #[arg(long, default_value_t = 64)]
    text_tokens: usize,
    /// Supervised trailing text tokens (default: the text after the image, half of `--text-tokens`).
    #[arg(long)]
    supervised: Option<usize>,
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    device: DeviceArg,
    #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
    dtype: DTypeArg,
    #[arg(long, default_value_t = 16)]
    rank: usize,
    /// LoRA dropout on the adapted linears' inputs.
    #[arg(long, default_value_t = 0.0)]
    dropout: f64,
    /// Adapt the language model's seven projections only (as `scripts/gpu/bench_torch_lora_step.py`
    /// does); by default the names also match the vision tower's MLPs, as PEFT's suffix match does.
    #[arg(long)]
    lm_only: bool,
    /// Sequences per step (`ops` path only for more than 1).
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Timed AdamW steps after one warm-up step.
    #[arg(long, default_value_t = 0)]
    steps: usize,
    #[arg(long, default_value_t = 1e-4)]
    lr: f64,
    #[arg(long)]
    save_adapter: Option<PathBuf>,
    #[arg(long)]
    inspect_gradstore: bool,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// `VmHWM` / `VmRSS` from `/proc/self/status`, in bytes.
fn proc_status_kb(key: &str) -> Result<u64> {
    let s = std::fs::read_to_string("/proc/self/status")?;
    for line in s.lines() {
        if let Some(rest) = line.strip_prefix(key) {
            let kb: u64 = rest.trim_start_matches(':').trim().trim_end_matches("kB").trim().parse()?;
            return Ok(kb * 1024);
        }
    }
    bail!("{key} not in /proc/self/status")
}

fn bytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

fn main() -> Result<()> {
    askgui_model::pin_cpu_threads();
    let args = Args::parse();
    if args.batch == 0 || (args.batch > 1 && matches!(args.path, PathKind::Composed)) {
        bail!("--batch must be 1 for the composed path and at least 1 for ops");
    }
    let device = match args.device {
        DeviceArg::Cpu => Device::Cpu,
        DeviceArg::Cuda => Device::new_cuda(0).context("--device cuda (build with --features cuda)")?,
    };
    let dtype = match args.dtype {
        DTypeArg::F32 => DType::F32,
        DTypeArg::Bf16 => DType::BF16,
    };
    let mut model = Qwen2Vl::load(&args.model, &device, dtype).context("loading the model")?;
    if let Some(m) = args.max_pixels {
        model.image_config.max_pixels = m;
    }
    let cfg = model.cfg.clone();
    let mut rng = StdRng::seed_from_u64(args.seed);

    // A synthetic image: a smooth gradient plus noise.
    let (w, h) = match &args.image_size {
        Some(s) => {
            let (w, h) = s.split_once('x').context("--image-size is WIDTHxHEIGHT, e.g. 1080x2400")?;
            (w.parse::<u32>().context("--image-size width")?, h.parse::<u32>().context("--image-size height")?)
        }
        None => (args.image_side, args.image_side),
    };
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        let n: u8 = rng.random();
        image::Rgb([(x * 255 / w) as u8, (y * 255 / h) as u8, n])
    });
    let processed = preprocess(&img, &model.image_config)?;
    let n_img = processed.num_tokens(model.image_config.geometry.merge_size);
    let pixel_values = processed.pixel_tensor(&device)?.to_dtype(dtype)?;

    // Random text ids below the special ids (which sit at the top of the vocabulary).
    let specials = [cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id];
    let text_max = *specials.iter().min().unwrap_or(&(cfg.text.vocab_size as u32));
    let before = args.text_tokens / 2;
    let after = args.text_tokens - before;
    let supervised = args.supervised.unwrap_or(after).min(after);
    let batch: Vec<TrainExample> = (0..args.batch)
        .map(|_| {
            let mut text = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(0..text_max)).collect() };
            let mut ids = text(before);
            ids.push(cfg.vision_start_token_id);
            ids.extend(std::iter::repeat_n(cfg.image_token_id, n_img));
            ids.push(cfg.vision_end_token_id);
            ids.extend(text(after));
            let t = ids.len();
            TrainExample {
                labels_mask: (0..t).map(|i| i >= t - supervised).collect(),
                ids,
                pixel_values: Some(pixel_values.clone()),
                grid_thw: vec![processed.grid_thw],
                region_targets: vec![],
            }
        })
        .collect();
    let seq_len = batch[0].ids.len();

    let targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];
    let per_layer: Vec<String> = (0..cfg.text.num_hidden_layers)
        .flat_map(|i| {
            let attn = ["q_proj", "k_proj", "v_proj", "o_proj"].map(|p| format!("layers.{i}.self_attn.{p}"));
            let mlp = ["gate_proj", "up_proj", "down_proj"].map(|p| format!("layers.{i}.mlp.{p}"));
            attn.into_iter().chain(mlp)
        })
        .collect();
    let per_layer: Vec<&str> = per_layer.iter().map(String::as_str).collect();
    let lora = LoraConfig::new(args.rank, 2.0 * args.rank as f64, if args.lm_only { &per_layer } else { &targets });
    model.add_trainable_adapter("train", lora, args.seed)?;
    model.set_adapter_dropout("train", args.dropout)?;
    model.set_active_adapter(Some("train"))?;
    let vars = model.trainable_vars("train")?;
    let lora_bytes: u64 = vars.iter().map(|(_, v)| bytes(v.as_tensor())).sum();
    let n_modules = vars.len() / 2;
    let n_vision_modules = vars.iter().filter(|(n, _)| n.contains("visual")).count() / 2;
    let base_bytes: u64 = model.base_tensors().iter().map(|(_, t)| bytes(t)).sum();
    let params = ParamsAdamW { lr: args.lr, ..Default::default() };
    let mut opt = AdamW::new(vars.iter().map(|(_, v)| v.clone()).collect(), params)?;
    let rss_before = proc_status_kb("VmRSS")?;

    // One step: forward, backward, the gradients kept, AdamW.
    let step = |model: &Qwen2Vl, opt: &mut AdamW, n: u64| -> Result<(f64, f64, u64)> {
        let t0 = Instant::now();
        let (loss, grads) = match args.path {
            PathKind::Ops => {
                let opts = StepOptions { checkpointing: args.checkpointing, dropout_seed: n, ..Default::default() };
                let out = model.loss_and_grads(&batch, &opts)?;
                (out.loss, out.grads)
            }
            PathKind::Composed => {
                let e = &batch[0];
                let t = e.ids.len();
                // (T, V) -> (T - 1, V): the logits at t - 1 predict token t.
                let logits = model.forward_prompt(&e.ids, Some(&pixel_values), &e.grid_thw)?.narrow(0, 0, t - 1)?;
                let labels = Tensor::from_slice(&e.ids[1..], t - 1, &device)?;
                let mask: Vec<f32> = e.labels_mask[1..].iter().map(|&m| m as u8 as f32).collect();
                let loss = cross_entropy_masked_reference(&logits, &labels, &Tensor::from_vec(mask, t - 1, &device)?)?;
                (loss.to_dtype(DType::F64)?.to_scalar::<f64>()?, loss.backward()?)
            }
        };
        let kept: u64 = grads.get_ids().filter_map(|id| grads.get_id(*id)).map(bytes).sum();
        opt.step(&grads)?;
        device.synchronize()?;
        Ok((loss, t0.elapsed().as_secs_f64(), kept))
    };
    let (loss_first, warmup_s, grads_kept) = step(&model, &mut opt, 0)?;
    let mut times = vec![];
    let mut loss_last = loss_first;
    for n in 1..=args.steps {
        let (l, s, _) = step(&model, &mut opt, n as u64)?;
        times.push(s);
        loss_last = l;
    }
    let median = if times.is_empty() {
        warmup_s
    } else {
        let mut t = times.clone();
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };
    let peak = proc_status_kb("VmHWM")?;
    let gpu = gpu::pool_high_water(&device)?;

    let mut out = serde_json::json!({
        "stack": "askgui (candle)",
        "path": format!("{:?}", args.path).to_lowercase(),
        "checkpointing": args.checkpointing,
        "threads": candle_core::utils::get_num_threads(),
        "batch": args.batch,
        "seq_len": seq_len,
        "image_tokens": n_img,
        "grid_thw": processed.grid_thw,
        "rank": args.rank,
        "lora_dropout": args.dropout,
        "lora_modules": n_modules,
        "lora_modules_vision": n_vision_modules,
        "lora_param_bytes": lora_bytes,
        "base_weight_bytes": base_bytes,
        "loss_first": loss_first,
        "loss_last": loss_last,
        "warmup_step_s": warmup_s,
        "step_s_all": times,
        "step_s_median": median,
        "tokens_per_s": (args.batch * seq_len) as f64 / median,
        "samples_per_s": args.batch as f64 / median,
        "peak_rss_bytes": peak,
        "rss_before_first_step_bytes": rss_before,
        "grads_kept_bytes": grads_kept,
        "device": format!("{:?}", args.device).to_lowercase(),
        "dtype": format!("{:?}", args.dtype).to_lowercase(),
        "image_size": [w, h],
        "supervised_tokens": supervised * args.batch,
        "gpu_used_high_bytes": gpu.map(|g| g.0),
        "gpu_reserved_high_bytes": gpu.map(|g| g.1),
    });
    if args.inspect_gradstore {
        out["candle_gradstore"] = inspect(&model, &batch, &vars.iter().map(|(_, v)| v.as_tensor().id()).collect())?;
    }
    if let Some(dir) = &args.save_adapter {
        model.save_adapter_as("train", dir, AdapterLayout::Transformers5)?;
        out["saved_adapter"] = dir.display().to_string().into();
    }
    println!("{out}");
    Ok(())
}

/// Runs the `ops` loss as one graph and sorts candle's whole `GradStore` into LoRA, base weights and
/// other tensors (constants such as rotary tables and the padding of the loss).
fn inspect(
    model: &Qwen2Vl,
    batch: &[TrainExample],
    var_ids: &HashSet<candle_core::TensorId>,
) -> Result<serde_json::Value> {
    let grads: GradStore = model.loss(batch, 0)?.backward()?;
    let base_ids: HashSet<_> = model.base_tensors().iter().map(|(_, t)| t.id()).collect();
    let (mut lora, mut base, mut other) = (0u64, 0u64, 0u64);
    let mut other_shapes = std::collections::BTreeMap::<String, usize>::new();
    for id in grads.get_ids() {
        let Some(g) = grads.get_id(*id) else { continue };
        if var_ids.contains(id) {
            lora += bytes(g);
        } else if base_ids.contains(id) {
            base += bytes(g);
        } else {
            other += bytes(g);
            *other_shapes.entry(format!("{:?}", g.dims())).or_default() += 1;
        }
    }
    let missing = var_ids.iter().filter(|id| grads.get_id(**id).is_none()).count();
    Ok(serde_json::json!({
        "entries": grads.get_ids().count(),
        "lora_bytes": lora,
        "base_bytes": base,
        "other_bytes": other,
        "other_shapes": other_shapes,
        "lora_vars_without_grad": missing,
    }))
}

/// The CUDA memory pool's high-water marks (used, reserved) in bytes; `None` on the CPU.
#[cfg(feature = "cuda")]
mod gpu {
    use anyhow::{bail, Result};
    use candle_core::cuda_backend::cudarc::driver::sys;
    use candle_core::Device;

    pub fn pool_high_water(device: &Device) -> Result<Option<(u64, u64)>> {
        let Device::Cuda(d) = device else { return Ok(None) };
        let cu_device = d.cuda_stream().context().cu_device();
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        let (mut used, mut reserved) = (0u64, 0u64);
        // SAFETY: plain driver queries on the context candle created, writing into the locals above.
        unsafe {
            let r = sys::cuDeviceGetDefaultMemPool(&mut pool, cu_device);
            if r != sys::CUresult::CUDA_SUCCESS {
                bail!("cuDeviceGetDefaultMemPool: {r:?}");
            }
            for (attr, out) in [
                (sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, &mut used),
                (sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, &mut reserved),
            ] {
                let r = sys::cuMemPoolGetAttribute(pool, attr, out as *mut u64 as *mut std::ffi::c_void);
                if r != sys::CUresult::CUDA_SUCCESS {
                    bail!("cuMemPoolGetAttribute({attr:?}): {r:?}");
                }
            }
        }
        Ok(Some((used, reserved)))
    }
}

#[cfg(not(feature = "cuda"))]
mod gpu {
    pub fn pool_high_water(_device: &candle_core::Device) -> anyhow::Result<Option<(u64, u64)>> {
        Ok(None)
    }
}
