//! The training loop, in one function you can read top to bottom: per step, the samples of the next data
//! position, micro-batches (made ahead on a thread by [`crate::prefetch`]; forward + backward, gradients
//! accumulated), clipping, the AdamW step, one log line (tracing, metrics.jsonl, the progress bar), then
//! the periodic eval (the validation loss, the model run as an agent on validation episodes by askgui-eval,
//! one sample prediction: [`crate::agent_eval`]) and snapshot (with a redrawn curves.svg). Each of these
//! is a named function that `train` calls in order.
//!
//! Accumulation weights each micro-batch's mean loss and gradients by its share of the step's supervised
//! tokens, so a step's loss and gradient are those of one batch holding all its sequences (the mean over
//! every supervised token, as transformers' `labels` with -100 elsewhere), whatever the micro-batch size.
//!
//! Resuming: the adapter, the optimiser state, the step and the data position come from the snapshot;
//! the data order and the dropout masks are functions of (seed, epoch, step), so a resumed run computes
//! the same steps as an uninterrupted one. A non-finite loss or gradient norm stops the run before the
//! update, and non-finite weights after it stop it before any snapshot, so the last snapshot written
//! stays the last good one.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use askgui_data::{LoadedEpisode, PromptConfig};
use askgui_eval::modes::Mode as EvalMode;
use askgui_model::{DeviceKind, LoraConfig, Qwen2Vl, StepOptions, StepOutput};
use candle_core::{DType, Device, Tensor};
use serde::Serialize;

use crate::agent_eval::{self, AgentMetrics, SamplePrediction};
use crate::config::{Mode, ModelArgs, RunControl, TrainConfig};
use crate::data::{self, DataOptions, DataStats, Dataset};
use crate::data_parallel;
use crate::distributed::World;
use crate::error::{io, Result, TrainError};
use crate::micro_threads::MicroThreads;
use crate::optim::{clip_grad_norm, AdamW, AdamWParams, Schedule};
use crate::prefetch::{self, MicroBatch, Planner, Prefetch, StepPlan};
use crate::snapshot::{self, TrainerState};

/// The adapter's name inside the model.
const ADAPTER: &str = "train";
pub const METRICS_FILE: &str = "metrics.jsonl";
pub const CURVES_FILE: &str = "curves.svg";
pub const SAMPLES_FILE: &str = "samples.jsonl";

/// One optimiser step, as logged.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepLog {
    pub step: usize,
    pub epoch: usize,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub sequences: usize,
    pub tokens: usize,
    pub supervised_tokens: usize,
    /// Decoder rows computed: `tokens` plus the padding (equal to `tokens` with `--packing`).
    pub computed_tokens: usize,
    pub tokens_per_s: f64,
    pub elapsed_s: f64,
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    /// The steps this invocation ran (a resumed run starts after the snapshot's step).
    pub steps: Vec<StepLog>,
    /// `(step, val loss)` of each eval.
    pub val_losses: Vec<(usize, f64)>,
    /// `(step, agent metrics)` of each eval with `--eval-episodes` > 0.
    pub agent_metrics: Vec<(usize, AgentMetrics)>,
    /// `(step, sample prediction)` of each eval.
    pub samples: Vec<(usize, SamplePrediction)>,
    pub train_data: DataStats,
    pub val_data: Option<DataStats>,
    pub total_steps: usize,
    pub last_checkpoint: Option<PathBuf>,
    /// True when [`RunControl::stop_after`] or an interrupt ended the run before `total_steps`.
    pub stopped_early: bool,
    /// True when [`RunControl::interrupted`] ended it.
    pub interrupted: bool,
}

/// The seed of micro-batch `micro` of step `step`'s dropout masks.
fn dropout_seed(seed: u64, step: usize, micro: usize) -> u64 {
    seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (((step as u64) << 20) | micro as u64)
}

/// Appends JSON lines to metrics.jsonl or samples.jsonl.
struct Metrics(std::fs::File, PathBuf);

impl Metrics {
    /// Opens `dir/name`, keeping only the lines of steps up to `keep_through` (a resumed run drops what an
    /// interrupted run logged after its snapshot).
    fn open(dir: &Path, name: &str, keep_through: usize) -> Result<Self> {
        let path = dir.join(name);
        let old = std::fs::read_to_string(&path).unwrap_or_default();
        let kept: String = old
            .lines()
            .filter(|l| {
                let step = serde_json::from_str::<serde_json::Value>(l).ok().and_then(|v| v["step"].as_u64());
                step.is_some_and(|s| s as usize <= keep_through)
            })
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(&path, kept).map_err(io(&path))?;
        let f = std::fs::OpenOptions::new().append(true).open(&path).map_err(io(&path))?;
        Ok(Self(f, path))
    }

    fn write(&mut self, v: &impl Serialize) -> Result<()> {
        let line = serde_json::to_string(v).expect("metrics serialise");
        writeln!(self.0, "{line}").map_err(io(&self.1))
    }
}

/// Redraws `dir/curves.svg` from `dir/metrics.jsonl` (written aside and renamed, so a reader never sees
/// half a picture).
fn draw_curves(dir: &Path) -> Result<()> {
    let metrics = dir.join(METRICS_FILE);
    let text = std::fs::read_to_string(&metrics).map_err(io(&metrics))?;
    let (train, val) = crate::plot::read_points(&text);
    let (tmp, path) = (dir.join(format!(".{CURVES_FILE}.tmp")), dir.join(CURVES_FILE));
    std::fs::write(&tmp, crate::plot::curves_svg(&train, &val)).map_err(io(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io(&path))
}

/// The token-weighted mean loss over (up to `limit` of) the validation samples, dropout off.
fn eval_loss(model: &Qwen2Vl, val: &Dataset, cfg: &TrainConfig, device: &Device) -> Result<f64> {
    let n = if cfg.run.eval_samples > 0 { cfg.run.eval_samples.min(val.samples.len()) } else { val.samples.len() };
    let (mut sum, mut tokens) = (0.0, 0usize);
    for chunk in val.samples[..n].chunks(cfg.optim.batch_size) {
        let batch = chunk
            .iter()
            .map(|s| data::example(s, &val.path, &model.image_config, device))
            .collect::<Result<Vec<_>>>()?;
        let (loss, sup) = model.eval_loss(&batch)?;
        sum += loss * sup as f64;
        tokens += sup;
    }
    Ok(sum / tokens.max(1) as f64)
}

/// The device and weight dtype of `--device` and `--dtype`, chosen once and logged: by default the CPU
/// trains in f32, a CUDA GPU in bf16 (trainable adapters keep f32 masters, `askgui_model::master_dtype`;
/// in full training the optimiser keeps an f32 master of every bf16 weight, [`crate::optim::AdamW`]).
/// Full training on the CPU stays f32 (candle's CPU matmul has no bf16 backward).
/// A rank of a data-parallel run takes its own GPU (`ordinal`, [`World::gpu_ordinal`]).
fn pick_device(m: &ModelArgs, ordinal: usize) -> Result<(Device, DType)> {
    let (device, dtype) = m.device.pick_on(m.dtype, ordinal)?;
    if m.mode == Mode::Full && device.is_cpu() && dtype == DType::BF16 {
        return Err(TrainError::Config(
            "--mode full on the CPU trains f32 weights (the CPU has no bf16 backward); drop --dtype bf16".into(),
        ));
    }
    // TF32 for the f32 GEMMs: process-wide in candle, and a no-op without a CUDA device.
    if device.is_cuda() {
        candle_core::cuda::set_gemm_reduced_precision_f32(m.tf32);
        tracing::info!("f32 GEMMs on TF32 tensor cores: {} (--tf32)", m.tf32);
    }
    tracing::info!("training on {device:?} with {dtype:?} weights");
    Ok((device, dtype))
}

/// The model on `device` in `dtype` ([`pick_device`]'s) with `--kernels`, and the image processor's pixel
/// bounds from `cfg` where it sets them.
fn load_model(cfg: &TrainConfig, device: &Device, dtype: DType) -> Result<Qwen2Vl> {
    let path = match (&cfg.model.model, &cfg.model.init_config) {
        (Some(m), _) => m.clone(),
        (None, Some(c)) => crate::init::init_model_dir(cfg, c)?,
        (None, None) => unreachable!("validated"),
    };
    let mut model = Qwen2Vl::load_with(&path, device, dtype, cfg.model.kernels)?;
    let ic = &mut model.image_config;
    if cfg.data.min_pixels > 0 {
        ic.min_pixels = cfg.data.min_pixels;
    }
    if cfg.data.max_pixels > 0 {
        ic.max_pixels = cfg.data.max_pixels;
    }
    if ic.min_pixels > ic.max_pixels {
        return Err(TrainError::Config(format!("min_pixels {} > max_pixels {}", ic.min_pixels, ic.max_pixels)));
    }
    Ok(model)
}

/// How the data loader builds prompts: `cfg`'s data options and the image processor's pixel bounds (the
/// coordinate frame depends on them).
fn data_options(cfg: &TrainConfig, model: &Qwen2Vl) -> DataOptions {
    let (d, ic) = (&cfg.data, &model.image_config);
    DataOptions {
        prompt: PromptConfig {
            frame: d.frame.or(d.action_language.native_frame()).unwrap_or(askgui_runtime::native_frame(model.arch())),
            min_pixels: ic.min_pixels,
            max_pixels: ic.max_pixels,
            history_images: d.history_images,
            elements: d.elements,
            system_prompt: d.system_prompt,
            token_side: ic.geometry.factor(),
            action_language: d.action_language,
        },
        task_mode: d.task_mode,
        extra_task_modes: d.extra_task_modes.clone(),
        history_length: d.history_length,
        max_seq_len: d.max_seq_len,
        skip_bad_records: d.skip_bad_records,
        ask_repeat: d.ask_repeat as usize,
        say_repeat: d.say_repeat as usize,
        dialog_repeat: d.dialog_repeat as usize,
        region_words: d.region_weight > 0.0,
    }
}

/// Installs the trainable adapter, loaded from snapshot `ckpt` or new, and the optimiser over it; returns
/// where the run stands.
fn adapter_and_optimiser(model: &mut Qwen2Vl, cfg: &TrainConfig, ckpt: Option<&Path>) -> Result<(AdamW, TrainerState)> {
    if cfg.model.mode == Mode::Full {
        return crate::init::full_optimiser(model, cfg, ckpt);
    }
    let state = match ckpt {
        Some(dir) => {
            model.load_adapter(ADAPTER, dir)?;
            model.make_adapter_trainable(ADAPTER)?;
            snapshot::read_state(dir)?
        }
        None => {
            let l = &cfg.lora;
            let targets: Vec<&str> = l.lora_targets.iter().map(String::as_str).collect();
            let mut lora = LoraConfig::new(l.lora_rank, l.lora_alpha, &targets);
            lora.lora_dropout = l.lora_dropout;
            lora.base_model_name_or_path = cfg.model.model.clone();
            model.add_trainable_adapter(ADAPTER, lora, cfg.run.seed)?;
            TrainerState::fresh(cfg.run.seed)
        }
    };
    model.set_active_adapter(Some(ADAPTER))?;
    model.set_adapter_dropout(ADAPTER, cfg.lora.lora_dropout)?;
    let o = &cfg.optim;
    let params = AdamWParams { beta1: o.beta1, beta2: o.beta2, eps: o.eps, weight_decay: o.weight_decay };
    let mut opt = AdamW::new(model.trainable_vars(ADAPTER)?, params)?;
    if let Some(dir) = ckpt {
        opt.load(&dir.join(snapshot::OPTIMIZER_FILE))?;
    }
    Ok((opt, state))
}

/// The samples of the first `steps` optimiser steps of the training that `cfg` describes, in the order the
/// trainer takes them (a fresh run; the model is loaded on the CPU only for its tokenizer and image
/// processor). Benchmarks feed these very batches to another trainer (`examples/export_batches.rs`).
pub fn planned_batches(cfg: &TrainConfig, steps: usize) -> Result<Vec<Vec<data::PreparedSample>>> {
    cfg.validate()?;
    let model = load_model(cfg, &Device::Cpu, DType::F32)?;
    let ic = model.image_config.clone();
    let set = data::load_dataset(
        cfg.data.data.as_deref().expect("validated"),
        &data_options(cfg, &model),
        &model.tokenizer()?,
        &ic,
    )?;
    let mut pos = data::DataPosition::default();
    let mut out = Vec::with_capacity(steps);
    for _ in 0..steps {
        let (indices, next) = data::step_samples(set.samples.len(), cfg.sequences_per_step(), cfg.run.seed, pos);
        out.push(indices.iter().map(|&i| set.samples[i].clone()).collect());
        pos = next;
    }
    Ok(out)
}

/// What the loop reads and never changes: the config, the device, the data and the schedule.
struct Run<'a> {
    cfg: &'a TrainConfig,
    device: Device,
    /// The training data and the plan of each step over it.
    planner: Planner,
    val: Option<Dataset>,
    /// The agent eval's validation episodes (none with `--eval-episodes 0` or without `--val`).
    val_episodes: Vec<LoadedEpisode>,
    eval_mode: EvalMode,
    prompt: PromptConfig,
    schedule: Schedule,
    /// The threads that run `--micro-batch-threads` micro-batches at once.
    threads: MicroThreads,
}

impl<'a> Run<'a> {
    /// Loads the training and validation data with `model`'s tokenizer and image processor, and derives
    /// the schedule from the training set's size and the number of data-parallel ranks.
    fn load(cfg: &'a TrainConfig, device: Device, model: &Qwen2Vl, world: &World) -> Result<Self> {
        let tokenizer = model.tokenizer()?;
        let ic = model.image_config.clone();
        let opts = data_options(cfg, model);
        let train = data::load_dataset(cfg.data.data.as_deref().expect("validated"), &opts, &tokenizer, &ic)?;
        tracing::info!("training data {}: {}", train.path.display(), train.stats);
        let val_opts = DataOptions {
            ask_repeat: 1,
            say_repeat: 1,
            dialog_repeat: 1,
            extra_task_modes: vec![],
            region_words: false,
            ..opts.clone()
        };
        let val = cfg.data.val.as_deref().map(|p| data::load_dataset(p, &val_opts, &tokenizer, &ic)).transpose()?;
        if let Some(v) = &val {
            tracing::info!("validation data {}: {}", v.path.display(), v.stats);
        }
        let val_episodes = match cfg.data.val.as_deref() {
            Some(p) if cfg.run.eval_episodes > 0 => {
                agent_eval::load_val_episodes(p, cfg.run.eval_episodes, cfg.data.skip_bad_records)?
            }
            _ => Vec::new(),
        };
        let eval_mode = agent_eval::mode_for(cfg.data.task_mode);
        if let Some(why) = agent_eval::cannot_measure_asking(&val_episodes, eval_mode) {
            tracing::warn!("eval: {why}");
        }
        let o = &cfg.optim;
        let planner = Planner::new(train, cfg, (world.rank(), world.size()));
        let n = planner.data.samples.len();
        let total = if o.max_steps > 0 { o.max_steps } else { o.epochs * data::steps_per_epoch(n, planner.per_step) };
        let warmup = o.warmup_steps.unwrap_or((o.warmup_ratio * total as f64).ceil() as usize);
        let schedule = Schedule { peak: o.lr, warmup, total, min_ratio: o.min_lr_ratio };
        let threads = MicroThreads::new(cfg.optim.micro_batch_threads)?;
        Ok(Self { cfg, device, planner, val, val_episodes, eval_mode, prompt: opts.prompt, schedule, threads })
    }

    /// Logs the run's shape, and warns when a resumed snapshot was written by a run of another length or seed.
    fn log_start(&self, resumed: Option<&TrainerState>, trainable_tensors: usize, start_step: usize) {
        let (cfg, total_steps) = (self.cfg, self.schedule.total);
        if let Some(state) = resumed.filter(|s| s.total_steps != total_steps || s.seed != cfg.run.seed) {
            tracing::warn!(
                "the checkpoint was written by a run of {} steps with seed {}; this run has {total_steps} steps and \
                 seed {}: it will not reproduce the original run",
                state.total_steps,
                state.seed,
                cfg.run.seed
            );
        }
        tracing::info!(
            samples = self.planner.data.samples.len(),
            sequences_per_step = self.planner.per_step,
            total_steps,
            warmup = self.schedule.warmup,
            trainable_tensors,
            start_step,
            "training"
        );
    }
}

/// Where a run reports: metrics.jsonl, samples.jsonl and the progress bar (log lines go around it).
struct Logs {
    metrics: Metrics,
    samples: Metrics,
    bar: indicatif::ProgressBar,
}

/// Creates `--output-dir` and opens the run's logs, keeping what was logged up to `start_step`. A fresh
/// run (not `resumed`) into a folder that holds snapshots is refused: it would overwrite them.
fn open_output(cfg: &TrainConfig, resumed: bool, start_step: usize, total_steps: usize) -> Result<Logs> {
    let out = &cfg.run.output_dir;
    if !resumed && cfg.run.save_checkpoints {
        if let Ok(existing) = snapshot::find(out) {
            return Err(TrainError::Config(format!(
                "{} already holds checkpoints ({}); pass --resume {} to continue that run, or choose another \
                 --output-dir",
                out.display(),
                existing.display(),
                out.display()
            )));
        }
    }
    std::fs::create_dir_all(out).map_err(io(out))?;
    let metrics = Metrics::open(out, METRICS_FILE, start_step)?;
    let samples = Metrics::open(out, SAMPLES_FILE, start_step)?;
    let bar = if cfg.run.progress {
        indicatif::ProgressBar::new(total_steps as u64)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} [{elapsed} < {eta}]")
            .expect("valid template"),
    );
    bar.set_position(start_step as u64);
    bar.reset_eta();
    Ok(Logs { metrics, samples, bar })
}

impl Logs {
    /// One step's log line: metrics.jsonl, the progress bar and tracing.
    fn step(&mut self, log: &StepLog) -> Result<()> {
        self.metrics.write(log)?;
        let bar = &self.bar;
        bar.set_message(format!("loss {:.4} lr {:.2e} {:.0} tok/s", log.loss, log.lr, log.tokens_per_s));
        bar.set_position(log.step as u64);
        bar.reset_eta();
        bar.suspend(|| {
            tracing::info!(
                step = log.step,
                epoch = log.epoch,
                loss = log.loss,
                lr = log.lr,
                grad_norm = log.grad_norm,
                tokens_per_s = log.tokens_per_s as u64,
                "step"
            )
        });
        Ok(())
    }
}

/// Whether a periodic action (every `every` steps, 0: only at the end) is due after `step`.
fn due(every: usize, step: usize, last: bool) -> bool {
    last || (every > 0 && step.is_multiple_of(every))
}

/// The error that stops the run at step `step` (1-based) when `value`, the `what`, is not finite; it names
/// `last`, the last good snapshot.
fn non_finite(
    what: &'static str,
    value: f64,
    step: usize,
    micro_batch: Option<usize>,
    last: Option<&Path>,
) -> TrainError {
    TrainError::NonFinite { what, value, step, micro_batch, last_checkpoint: last.map(Path::to_path_buf) }
}

/// The model options of micro-batch `micro` of step `step`.
fn step_options(cfg: &TrainConfig, step: usize, micro: usize) -> StepOptions {
    StepOptions {
        checkpointing: cfg.run.grad_checkpointing,
        dropout_seed: dropout_seed(cfg.run.seed, step, micro),
        region_weight: cfg.data.region_weight,
        region_layer: cfg.data.region_layer,
        pack: cfg.optim.packing,
        ..StepOptions::default()
    }
}

/// What the micro-batches of a step computed.
struct Accumulated {
    /// The gradients in `opt`'s order, weighted by each micro-batch's share of the supervised tokens.
    grads: Vec<Option<Tensor>>,
    loss: f64,
    /// Decoder rows computed, padding included.
    rows: usize,
}

impl Accumulated {
    /// Adds one micro-batch's loss and gradients (in `opt`'s order) with weight `w`, and its `rows`.
    fn add(&mut self, out: &StepOutput, w: f64, rows: usize, opt: &AdamW) -> Result<()> {
        self.loss += out.loss * w;
        self.rows += rows;
        for (slot, (_, var)) in self.grads.iter_mut().zip(opt.vars()) {
            if let Some(g) = out.grads.get(var.as_tensor()) {
                let g = (g * w)?;
                *slot = Some(match slot.take() {
                    Some(acc) => (acc + g)?,
                    None => g,
                });
            }
        }
        Ok(())
    }
}

/// Forward + backward over this rank's micro-batches of `plan`, taken from `batches` in plan order, each
/// micro-batch's loss and gradients weighted by its share of the step's supervised tokens (over all
/// ranks); returns the accumulated gradients (in `opt`'s order) and this rank's share of the step's loss.
fn micro_batches(
    model: &Qwen2Vl,
    opt: &AdamW,
    plan: &StepPlan,
    batches: &mut Prefetch<MicroBatch>,
    run: &Run,
    last: Option<&Path>,
) -> Result<Accumulated> {
    let mut acc = Accumulated { grads: vec![None; opt.len()], loss: 0.0, rows: 0 };
    let mut counted = 0;
    let (step, first) = (plan.step, plan.first);
    // `--micro-batch-threads` of them at once; summed in plan order either way.
    for start in (0..plan.micro.len()).step_by(run.threads.at_once()) {
        let n = run.threads.at_once().min(plan.micro.len() - start);
        let ready = (start..start + n).map(|k| prefetch::take(batches, plan, k)).collect::<Result<Vec<_>>>()?;
        let one = |i: usize| model.loss_and_grads(&ready[i].examples, &step_options(run.cfg, step, first + start + i));
        for ((micro, done), batch) in (start..).zip(run.threads.run(n, one)).zip(&ready) {
            let out = done?;
            if !out.loss.is_finite() {
                return Err(non_finite("loss", out.loss, step + 1, Some(first + micro), last));
            }
            acc.add(&out, out.supervised_tokens as f64 / plan.supervised as f64, batch.rows, opt)?;
            counted += out.supervised_tokens;
        }
    }
    if counted != plan.mine_supervised {
        // The weights above would not sum to 1: the loader's mask and the model's disagree.
        return Err(TrainError::Data(format!(
            "step {}: the model supervised {counted} tokens where the data marks {}",
            step + 1,
            plan.mine_supervised
        )));
    }
    Ok(acc)
}

/// Clips `grads` and takes the AdamW step at the schedule's learning rate; returns (gradient norm, lr).
/// A non-finite norm stops the run before the update, non-finite weights after it.
fn clip_and_step(
    opt: &mut AdamW,
    grads: &mut [Option<Tensor>],
    run: &Run,
    step: usize,
    last: Option<&Path>,
) -> Result<(f64, f64)> {
    let grad_norm = clip_grad_norm(grads, run.cfg.optim.max_grad_norm)?;
    if !grad_norm.is_finite() {
        return Err(non_finite("gradient norm", grad_norm, step + 1, None, last));
    }
    let lr = run.schedule.lr(step);
    opt.step(grads, lr)?;
    // A finite gradient can still overflow a weight; such weights must never reach a snapshot.
    if !opt.all_finite()? {
        return Err(non_finite("updated adapter", f64::NAN, step + 1, None, last));
    }
    Ok((grad_norm, lr))
}

/// One optimiser step from `state`: the samples of its data position ([`Planner::plan`]), this rank's
/// shard of them in micro-batches (made ahead by `batches`), the sums over the ranks ([`data_parallel`]),
/// clip and step. Advances `state` and returns the step's log (of the whole step, on every rank); `last`
/// is the last good snapshot, which errors name.
fn train_step(
    model: &Qwen2Vl,
    opt: &mut AdamW,
    state: &mut TrainerState,
    (run, world, batches): (&Run, &World, &mut Prefetch<MicroBatch>),
    last: Option<&Path>,
    started: Instant,
) -> Result<StepLog> {
    let t0 = Instant::now();
    let plan = run.planner.plan(state.step, state.position);
    let (next, tokens) = (plan.next, plan.tokens);
    let acc = micro_batches(model, opt, &plan, batches, run, last)?;
    let Accumulated { mut grads, loss, rows } = acc;
    let mut sums = [loss, rows as f64];
    data_parallel::all_reduce(world, &mut grads, &opt.vars().map(|(_, v)| v.clone()).collect::<Vec<_>>(), &mut sums)?;
    let [loss, rows] = sums;
    let (grad_norm, lr) = clip_and_step(opt, &mut grads, run, state.step, last)?;
    state.step += 1;
    state.position = next;
    state.loss = loss;
    state.tokens += tokens as u64;
    let secs = t0.elapsed().as_secs_f64();
    Ok(StepLog {
        step: state.step,
        epoch: next.epoch,
        loss,
        lr,
        grad_norm,
        sequences: plan.sequences,
        tokens,
        supervised_tokens: plan.supervised,
        computed_tokens: rows as usize,
        tokens_per_s: tokens as f64 / secs.max(1e-9),
        elapsed_s: started.elapsed().as_secs_f64(),
    })
}

/// `line` (a JSON object) with the fields of `extra` added.
fn with_fields(mut line: serde_json::Value, extra: &impl Serialize) -> serde_json::Value {
    if let (Some(l), serde_json::Value::Object(extra)) =
        (line.as_object_mut(), serde_json::to_value(extra).expect("serialises"))
    {
        l.extend(extra);
    }
    line
}

/// The periodic eval after step `step`: the validation loss of `val` and, with `--eval-episodes`, the agent
/// metrics (one metrics.jsonl line), then one sample prediction; each is logged and kept in `summary`. Both
/// run through an in-process agent that the model is lent to and given back from.
fn periodic_eval(
    model: Qwen2Vl,
    val: &Dataset,
    run: &Run,
    step: usize,
    logs: &mut Logs,
    summary: &mut TrainSummary,
) -> Result<Qwen2Vl> {
    let cfg = run.cfg;
    let v = eval_loss(&model, val, cfg, &run.device)?;
    let mut line = serde_json::json!({"step": step, "val_loss": v});
    let agent = agent_eval::lend(model, &run.prompt, cfg.run.eval_max_new_tokens)?;
    let metrics = match run.val_episodes.is_empty() {
        true => None,
        false => Some(agent_eval::run_agent_eval(&agent, &run.val_episodes, run.eval_mode)?),
    };
    if let Some(a) = &metrics {
        line = with_fields(line, a);
    }
    logs.metrics.write(&line)?;
    logs.bar.suspend(|| {
        let a = metrics.as_ref();
        tracing::info!(
            step,
            val_loss = v,
            ssr = a.and_then(|a| a.ssr),
            sr = a.and_then(|a| a.sr),
            ask_precision = a.and_then(|a| a.ask_precision),
            ask_recall = a.and_then(|a| a.ask_recall),
            ask_f1 = a.and_then(|a| a.ask_f1),
            eval_episodes = a.map(|a| a.eval_episodes),
            "eval"
        )
    });
    summary.val_losses.push((step, v));
    summary.agent_metrics.extend(metrics.map(|a| (step, a)));
    if let Some(sample) = val.samples.first() {
        let p = agent_eval::sample_prediction(&agent, sample, cfg.run.eval_max_new_tokens)?;
        logs.samples.write(&with_fields(serde_json::json!({"step": step}), &p))?;
        logs.bar.suspend(|| {
            tracing::info!(
                step,
                episode = %p.episode,
                episode_step = p.episode_step,
                predicted = %p.predicted,
                target = %p.target,
                "sample"
            )
        });
        summary.samples.push((step, p));
    }
    Ok(agent.into_model())
}

/// Writes the snapshot of `state` (the model's trained weights, the optimiser, the trainer state and the
/// config) atomically into `--output-dir`, then redraws curves.svg; returns its folder.
fn save_snapshot(
    model: &Qwen2Vl,
    opt: &AdamW,
    state: &TrainerState,
    cfg: &TrainConfig,
    bar: &indicatif::ProgressBar,
) -> Result<PathBuf> {
    let out = &cfg.run.output_dir;
    let dir = snapshot::write_atomically(out, &snapshot::dir_name(state.step), |tmp| {
        match cfg.model.mode {
            Mode::Full => crate::init::save_model(model, tmp)?,
            Mode::Lora => model.save_adapter_as(ADAPTER, tmp, cfg.run.adapter_keys.into())?,
        }
        // The prompt and image settings the model was trained with travel with it (askgui.json), so that
        // eval and serve apply them by default.
        crate::adapter_card::write(tmp, &data_options(cfg, model))?;
        opt.save(&tmp.join(snapshot::OPTIMIZER_FILE))?;
        snapshot::write_state(tmp, state)?;
        let path = tmp.join(snapshot::CONFIG_FILE);
        std::fs::write(&path, cfg.to_toml()).map_err(io(path))
    })?;
    bar.suspend(|| tracing::info!(step = state.step, "checkpoint {}", dir.display()));
    draw_curves(out)?;
    Ok(dir)
}

/// Runs (or, with `control.resume`, continues) the training that `cfg` describes, in this one process.
pub fn train(cfg: &TrainConfig, control: &RunControl) -> Result<TrainSummary> {
    train_on(cfg, control, &World::single())
}

/// [`train`] as rank `world.rank()` of a data-parallel run: every rank loads the model and data, takes its
/// shard of each step and the same optimiser step; rank 0 alone holds the output folder's lock and
/// writes the logs, metrics, progress, evals and checkpoints. A checkpoint records its world size, and a
/// resume with another is refused (the data order and the batch depend on it).
pub fn train_on(cfg: &TrainConfig, control: &RunControl, world: &World) -> Result<TrainSummary> {
    cfg.validate()?;
    // Saved configs and adapters name their files by absolute path: they resume and load from any folder.
    let cfg = &cfg.with_absolute_paths()?;
    let main = world.is_main();
    let _lock = main.then(|| crate::lock::Lock::acquire(&cfg.run.output_dir)).transpose()?;
    if main {
        tracing::info!("resolved config:\n{}", cfg.to_toml());
    }
    if cfg.optim.micro_batch_threads > 1 {
        crate::micro_threads::single_threaded_candle();
    }
    let ordinal = if cfg.model.device == DeviceKind::Cpu { 0 } else { world.gpu_ordinal()? };
    let (device, dtype) = pick_device(&cfg.model, ordinal)?;
    world.connect(&device)?;
    let mut model = load_model(cfg, &device, dtype)?;
    let run = Run::load(cfg, device, &model, world)?;

    // Adapter and optimiser, fresh or from the snapshot.
    let ckpt = control.resume.as_deref().map(snapshot::find).transpose()?;
    let (mut opt, state) = adapter_and_optimiser(&mut model, cfg, ckpt.as_deref())?;
    check_resume(ckpt.as_deref(), &state, world)?;
    if main {
        run.log_start(ckpt.as_ref().map(|_| &state), opt.len(), state.step);
    }
    let total_steps = run.schedule.total;
    let mut logs = main.then(|| open_output(cfg, ckpt.is_some(), state.step, total_steps)).transpose()?;

    let mut summary = TrainSummary {
        steps: vec![],
        val_losses: vec![],
        agent_metrics: vec![],
        samples: vec![],
        train_data: run.planner.data.stats.clone(),
        val_data: run.val.as_ref().map(|v| v.stats.clone()),
        total_steps,
        last_checkpoint: ckpt.clone(),
        stopped_early: false,
        interrupted: false,
    };
    let mut state = TrainerState { total_steps, seed: cfg.run.seed, world_size: world.size(), ..state };
    let started = Instant::now();
    let mut saved_at = ckpt.as_ref().map(|_| state.step);
    // The micro-batches of the steps this invocation can run, made ahead while the steps run.
    let end = control.stop_after.map_or(total_steps, |n| n.min(total_steps));
    let (from, images) = ((state.step, state.position), &model.image_config);
    let mut batches = run.planner.micro_batches(from, end, images, &run.device, cfg.data.prefetch)?;

    while state.step < total_steps {
        if control.stop_after.is_some_and(|n| state.step >= n) {
            summary.stopped_early = true;
            break;
        }
        // Every rank stops after the same step when any of them was interrupted.
        if data_parallel::any(world, control.interrupted.is_some_and(|f| f()))? {
            tracing::warn!(step = state.step, "interrupted: stopping after this step with a checkpoint");
            (summary.stopped_early, summary.interrupted) = (true, true);
            break;
        }
        let last = summary.last_checkpoint.as_deref();
        let log = train_step(&model, &mut opt, &mut state, (&run, world, &mut batches), last, started)?;
        summary.steps.push(log);
        // Rank 0 alone logs, evaluates and saves.
        let Some(logs) = logs.as_mut() else { continue };
        logs.step(summary.steps.last().expect("pushed"))?;
        let last = state.step == total_steps;
        if let Some(val) = run.val.as_ref().filter(|_| due(cfg.run.eval_every, state.step, last)) {
            model = periodic_eval(model, val, &run, state.step, logs, &mut summary)?;
        }
        if cfg.run.save_checkpoints && due(cfg.run.save_every, state.step, last) {
            summary.last_checkpoint = Some(save_snapshot(&model, &opt, &state, cfg, &logs.bar)?);
            saved_at = Some(state.step);
        }
    }
    // Stops the prefetch thread before the last snapshot.
    drop(batches);
    let Some(logs) = logs else { return Ok(summary) };
    if summary.stopped_early && cfg.run.save_checkpoints && saved_at != Some(state.step) {
        summary.last_checkpoint = Some(save_snapshot(&model, &opt, &state, cfg, &logs.bar)?);
    }
    draw_curves(&cfg.run.output_dir)?;
    logs.bar.finish_and_clear();
    Ok(summary)
}

/// Refuses a resume from a snapshot of another world size, or ranks that resumed at different steps.
fn check_resume(ckpt: Option<&Path>, state: &TrainerState, world: &World) -> Result<()> {
    if let Some(dir) = ckpt.filter(|_| state.world_size != world.size()) {
        return Err(TrainError::Checkpoint {
            path: dir.to_path_buf(),
            reason: format!(
                "it was written by a run of {} rank(s) and this run has {}; resume with the same number of ranks \
                 (the data order and the step's batch depend on it)",
                state.world_size,
                world.size()
            ),
        });
    }
    if !world.all_equal_u64(state.step as u64)? {
        return Err(TrainError::Config(format!(
            "rank {} resumed at step {} but another rank did not: every rank must read the same --resume folder",
            world.rank(),
            state.step
        )));
    }
    Ok(())
}
