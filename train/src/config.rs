//! The training configuration: clap derive + serde on the same grouped structs, so that a flag, a key of
//! `--config FILE.toml` and a line of the saved `config.toml` are one thing.
//!
//! Resolution, lowest to highest: the defaults (clap's `default_value`s, the one place they are written),
//! a `--preset`, the `config.toml` of the checkpoint given to `--resume`, the `--config` file, then the
//! flags given on the command line. A layer only sets what it names: a file is a partial TOML document
//! (`[optim]\nlr = 1e-4`), and a flag counts only when clap says its value came from the command line,
//! so a flag's default never overrides a file. Unknown keys are errors (a typo must not be ignored).
//! The resolved config is logged at start and written beside every checkpoint.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use askgui_data::{ActionLanguage, FrameKind, SystemPrompt, TaskMode};
use askgui_model::AdapterLayout;
use clap::parser::ValueSource;
use clap::{ArgMatches, Args, FromArgMatches, ValueEnum};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Result, TrainError};

/// What is trained.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// A LoRA adapter on the targeted linears; the base weights stay frozen.
    Lora,
    /// Every weight of the model (no adapter); checkpoints are model folders.
    Full,
}

/// Named recipes that set several options at once.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Preset {
    /// Navi-plus' LoRA recipe: rank 64, alpha 128, one epoch, batch 64 (8 x 8 accumulation), lr 2e-4.
    NaviPlus,
    /// LoRA of a Qwen3-VL agent: Navi-plus' recipe at lr 1e-4, in its native relative 0-1000 frame, with
    /// screenshots at up to 1,280 tokens of 32x32 pixels (max_pixels 1,310,720, as Qwen2.5-VL's 1,280 x 28^2).
    Qwen3VlLora,
}

/// The tensor key layout of saved adapters (askgui reads both); the default is [`AdapterLayout`]'s.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum AdapterKeys {
    /// `base_model.model.model.layers.N...`: hub checkpoints, vLLM, SGLang, PEFT on transformers 4.
    Hub,
    /// `base_model.model.model.language_model.layers.N...`: PEFT on transformers 5.
    Transformers5,
}

impl Default for AdapterKeys {
    fn default() -> Self {
        match AdapterLayout::default() {
            AdapterLayout::Hub => Self::Hub,
            AdapterLayout::Transformers5 => Self::Transformers5,
        }
    }
}

impl From<AdapterKeys> for AdapterLayout {
    fn from(k: AdapterKeys) -> Self {
        match k {
            AdapterKeys::Hub => Self::Hub,
            AdapterKeys::Transformers5 => Self::Transformers5,
        }
    }
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Args)]
#[serde(deny_unknown_fields)]
pub struct ModelArgs {
    /// Checkpoint folder or hub id (Qwen2.5-VL / Qwen2-VL).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub model: Option<String>,
    /// What to train.
    #[arg(long, value_enum, default_value_t = Mode::Lora)]
    pub mode: Mode,
    /// Train from scratch instead of --model: a config.json whose random initialisation is written to
    /// OUTPUT_DIR/init-model and trained (with --mode full).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub init_config: Option<PathBuf>,
    /// With --init-config: the new model's tokenizer.json instead of the byte-level one (its special
    /// tokens must keep their byte-level ids).
    #[arg(long, requires = "init_config")]
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub init_tokenizer: Option<PathBuf>,
    /// Where to train: `auto` is the first CUDA GPU when the binary is built with `--features cuda` and
    /// one is present, else the CPU.
    #[arg(long, value_enum, default_value_t = DeviceKind::Auto)]
    #[serde(default)]
    pub device: DeviceKind,
    /// Weight dtype: `auto` is bf16 on a GPU and f32 on the CPU (--mode full: f32 on the CPU; bf16 on a GPU,
    /// with f32 masters in the optimiser).
    #[arg(long, value_enum, default_value_t = DTypeChoice::Auto)]
    #[serde(default)]
    pub dtype: DTypeChoice,
    /// On a CUDA GPU of sm_80 or newer, f32 GEMMs (the LoRA products) on TF32 tensor cores: inputs rounded
    /// to 10 mantissa bits, f32 sums. `false` keeps full f32. No effect on the CPU.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    #[serde(default = "yes")]
    pub tf32: bool,
    /// `reference` runs plain-candle ops instead of askgui's kernels (slower; for a GPU they fail on).
    #[arg(long, value_enum, default_value_t = KernelChoice::Askgui)]
    #[serde(default)]
    pub kernels: KernelChoice,
}

/// The device, dtype and kernel options of [`ModelArgs`] (shared with the server and the evaluator).
pub use askgui_model::{DTypeChoice, DeviceKind, KernelChoice};

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Args)]
#[serde(deny_unknown_fields)]
pub struct DataArgs {
    /// Training episodes (JSONL, one episode a line, screenshots beside the file).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub data: Option<PathBuf>,
    /// Validation episodes for the periodic eval loss.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub val: Option<PathBuf>,
    /// Skip (and count) unreadable lines and episodes with missing screenshots instead of stopping.
    #[arg(long, default_value_t = false)]
    pub skip_bad_records: bool,
    /// Which samples the episodes give (the possible values below).
    #[arg(long, value_enum, default_value_t = TaskMode::Ambiguous)]
    pub task_mode: TaskMode,
    /// More samples of the same episodes in other task modes, mixed in (comma-separated, e.g.
    /// `steps,language`).
    #[arg(long, value_enum, value_delimiter = ',')]
    #[serde(default)]
    pub extra_task_modes: Vec<TaskMode>,
    /// Coordinate frame the model reads and writes [default: the action language's own (ui-tars: resized
    /// pixels, tool-call: 0-1000), else the family's: resized pixels for Qwen2/2.5-VL, 0-1000 for Qwen3-VL].
    #[arg(long, value_enum)]
    #[serde(default)]
    pub frame: Option<FrameKind>,
    /// The image processor's min_pixels (0: the checkpoint's).
    #[arg(long, default_value_t = 0)]
    pub min_pixels: usize,
    /// The image processor's max_pixels (0: the checkpoint's).
    #[arg(long, default_value_t = 0)]
    pub max_pixels: usize,
    /// Earlier screenshots shown besides the current one.
    #[arg(long, default_value_t = 0)]
    pub history_images: usize,
    /// Most recent history lines (actions, ASK, SAY) kept in the prompt (0: all).
    #[arg(long, default_value_t = 0)]
    pub history_length: usize,
    /// Include the element list when a step has one.
    #[arg(long, default_value_t = false)]
    pub elements: bool,
    /// The system prompt (`compact`: one line, for small models trained from scratch); serve and eval
    /// must be given the same.
    #[arg(long, value_enum, default_value_t = SystemPrompt::Full)]
    #[serde(default)]
    pub system_prompt: SystemPrompt,
    /// The action language the model writes: askgui's JSON, or an existing agent's own (`ui-tars`,
    /// `tool-call`) so that its front end parses it; recorded in the adapter's askgui.json.
    #[arg(long, value_enum, default_value_t = ActionLanguage::AskguiJson)]
    #[serde(default)]
    pub action_language: ActionLanguage,
    /// Context length in tokens: longer samples lose their oldest history until they fit.
    #[arg(long, default_value_t = 8192)]
    pub max_seq_len: usize,
    /// Copies of each ask sample in the training data (1: the natural mix; validation keeps one).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    #[serde(default = "one")]
    pub ask_repeat: u32,
    /// Copies of each sample that acts on the user's answer, the asked step after its SAY turn (1: the
    /// natural mix; validation keeps one).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    #[serde(default = "one")]
    pub say_repeat: u32,
    /// Copies of each later step of an ambiguous task, acted with the user's answer in its history (1: the
    /// natural mix; validation keeps one).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    #[serde(default = "one")]
    pub dialog_repeat: u32,
    /// Weight of the region-word loss (0: off): each image token inside a listed element's box also
    /// predicts a word of that element's text. Needs episodes with elements.
    #[arg(long, default_value_t = 0.0)]
    #[serde(default)]
    pub region_weight: f64,
    /// The decoder layer (1-based, clamped to the model's depth) whose output the region loss reads.
    #[arg(long, default_value_t = 1)]
    #[serde(default = "one_usize")]
    pub region_layer: usize,
    /// Micro-batches made ahead on a background thread (screenshots decoded, tiled and packed) while the
    /// step runs; 0 makes each when its turn comes. The losses are the same either way.
    #[arg(long, default_value_t = 2)]
    #[serde(default = "two")]
    pub prefetch: usize,
}

fn two() -> usize {
    2
}

/// The most micro-batches `--prefetch` holds ahead: each holds its screenshots' pixels (device memory on a
/// GPU), and a few suffice to hide one micro-batch's decoding behind a step.
pub const MAX_PREFETCH: usize = 16;

fn one_usize() -> usize {
    1
}

fn one() -> u32 {
    1
}

fn yes() -> bool {
    true
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Args)]
#[serde(deny_unknown_fields)]
pub struct LoraArgs {
    /// LoRA rank r.
    #[arg(long, default_value_t = 16)]
    pub lora_rank: usize,
    /// LoRA alpha (the update is scaled by alpha / r).
    #[arg(long, default_value_t = 32.0)]
    pub lora_alpha: f64,
    /// Dropout on the LoRA input (PEFT's lora_dropout).
    #[arg(long, default_value_t = 0.05)]
    pub lora_dropout: f64,
    /// Target module names (PEFT suffix match), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")]
    pub lora_targets: Vec<String>,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Args)]
#[serde(deny_unknown_fields)]
pub struct OptimArgs {
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-4)]
    pub lr: f64,
    /// Decoupled weight decay (torch.optim.AdamW's).
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    /// AdamW's beta1 (decay of the gradient's running mean).
    #[arg(long, default_value_t = 0.9)]
    pub beta1: f64,
    /// AdamW's beta2 (decay of the squared gradient's running mean).
    #[arg(long, default_value_t = 0.999)]
    pub beta2: f64,
    /// AdamW's epsilon (added to the denominator).
    #[arg(long, default_value_t = 1e-8)]
    pub eps: f64,
    /// Warmup steps as a fraction of all steps (rounded up; used unless --warmup-steps is given).
    #[arg(long, default_value_t = 0.03)]
    pub warmup_ratio: f64,
    /// Warmup steps (overrides --warmup-ratio; 0 is no warmup).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub warmup_steps: Option<usize>,
    /// The cosine decays to lr x this.
    #[arg(long, default_value_t = 0.0)]
    pub min_lr_ratio: f64,
    /// Clip the global gradient norm to this (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    pub max_grad_norm: f64,
    /// Sequences per micro-batch (one forward and backward).
    #[arg(long, default_value_t = 1)]
    pub batch_size: usize,
    /// Micro-batches per optimiser step.
    #[arg(long, default_value_t = 8)]
    pub grad_accum: usize,
    /// Pack each step's `batch-size x grad-accum` sequences back to back into micro-batches of up to
    /// `--max-seq-len` tokens (first-fit decreasing) instead of right-padding `--batch-size` of them: no
    /// padding is computed, and the step's loss and gradient stay those of the same sequences.
    #[arg(long, default_value_t = false)]
    #[serde(default)]
    pub packing: bool,
    /// Micro-batches of a step computed at once on the CPU, each whole on a thread of its own with
    /// single-threaded kernels: faster for a small model, whose kernels cannot keep every core busy, at N x
    /// the activation memory. With `--packing` a step is cut into at least N packs. 1: one at a time.
    #[arg(long, default_value_t = 1)]
    #[serde(default = "one_usize")]
    pub micro_batch_threads: usize,
    /// Passes over the training data.
    #[arg(long, default_value_t = 1)]
    pub epochs: usize,
    /// Stop after this many optimiser steps (0: the epochs decide); it also sets the schedule's length.
    #[arg(long, default_value_t = 0)]
    pub max_steps: usize,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Args)]
#[serde(deny_unknown_fields)]
pub struct RunArgs {
    /// Where checkpoints, metrics.jsonl and the config go.
    #[arg(long, default_value = "runs/askgui-train")]
    pub output_dir: PathBuf,
    /// Seeds the adapter's initialisation, the data order and the dropout masks.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Recompute each block in the backward instead of keeping its activations.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub grad_checkpointing: bool,
    /// Write a checkpoint every this many steps (0: only at the end).
    #[arg(long, default_value_t = 500)]
    pub save_every: usize,
    /// Write checkpoints at all.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub save_checkpoints: bool,
    /// Key layout of the saved adapter: transformers5 for PEFT on transformers 5, hub for older stacks.
    #[arg(long, value_enum, default_value_t = AdapterKeys::default())]
    pub adapter_keys: AdapterKeys,
    /// Eval loss on --val every this many steps (0: only at the end).
    #[arg(long, default_value_t = 200)]
    pub eval_every: usize,
    /// Validation samples used per eval (0: all).
    #[arg(long, default_value_t = 0)]
    pub eval_samples: usize,
    /// Validation episodes run as an agent at each eval (SSR, SR and ASK scores in metrics.jsonl; 0: off).
    #[arg(long, default_value_t = 32)]
    pub eval_episodes: usize,
    /// The longest answer, in tokens, of the agent eval and of the sample prediction.
    #[arg(long, default_value_t = 128)]
    pub eval_max_new_tokens: usize,
    /// Draw the progress bar (it is hidden anyway when stderr is not a terminal).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub progress: bool,
}

/// Every option of a training run.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Args)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    #[command(flatten, next_help_heading = "Model")]
    pub model: ModelArgs,
    #[command(flatten, next_help_heading = "Data")]
    pub data: DataArgs,
    #[command(flatten, next_help_heading = "LoRA")]
    pub lora: LoraArgs,
    #[command(flatten, next_help_heading = "Optimiser")]
    pub optim: OptimArgs,
    #[command(flatten, next_help_heading = "Run")]
    pub run: RunArgs,
}

/// A training command line: the config's flags plus what only makes sense for one invocation
/// (`crate::cli::Cli` flattens it beside the subcommands).
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// A TOML file with the same options, grouped as in the saved config.toml; flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// A named recipe (files and flags override it).
    #[arg(long, value_enum)]
    pub preset: Option<Preset>,
    /// Continue from a checkpoint folder (or the newest checkpoint in an output folder), writing into the
    /// folder that holds it unless --output-dir is given.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Stop with a checkpoint after this many steps, as if interrupted, keeping the full run's schedule
    /// (to train in chunks with --resume).
    #[arg(long)]
    pub stop_after: Option<usize>,
    #[command(flatten)]
    pub cfg: TrainConfig,
}

/// What one invocation adds to the config: where it continues from and where it stops.
#[derive(Debug, Clone, Default)]
pub struct RunControl {
    pub resume: Option<PathBuf>,
    pub stop_after: Option<usize>,
    /// Polled between optimiser steps: true stops the run there with a checkpoint
    /// ([`crate::interrupt`] sets it on Ctrl-C and SIGTERM).
    pub interrupted: Option<fn() -> bool>,
}

impl Default for TrainConfig {
    /// The defaults of the flags (parsed from an empty command line).
    fn default() -> Self {
        let cmd = TrainConfig::augment_args(clap::Command::new("defaults"));
        let m = cmd.try_get_matches_from(["defaults"]).expect("the defaults parse");
        TrainConfig::from_arg_matches(&m).expect("the defaults parse")
    }
}

/// The values a preset sets, as a partial config.
pub fn preset_layer(p: Preset) -> Value {
    match p {
        Preset::NaviPlus => serde_json::json!({
            "lora": {"lora_rank": 64, "lora_alpha": 128.0},
            "optim": {"lr": 2e-4, "epochs": 1, "batch_size": 8, "grad_accum": 8},
        }),
        Preset::Qwen3VlLora => serde_json::json!({
            "lora": {"lora_rank": 64, "lora_alpha": 128.0},
            "optim": {"lr": 1e-4, "epochs": 1, "batch_size": 8, "grad_accum": 8},
            "data": {"frame": "relative1000", "max_pixels": 1_310_720},
        }),
    }
}

/// Reads a partial config from a TOML file.
pub fn file_layer(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|source| TrainError::Io { path: path.to_path_buf(), source })?;
    let t: toml::Table =
        toml::from_str(&text).map_err(|e| TrainError::Config(format!("{}: not valid TOML: {e}", path.display())))?;
    serde_json::to_value(t).map_err(|e| TrainError::Config(format!("{}: {e}", path.display())))
}

/// The flags given on the command line, as a partial config (clap's defaults are left out).
pub fn cli_layer(cfg: &TrainConfig, matches: &ArgMatches) -> Value {
    let explicit: HashSet<&str> = matches
        .ids()
        .map(|id| id.as_str())
        .filter(|id| matches!(matches.value_source(id), Some(ValueSource::CommandLine | ValueSource::EnvVariable)))
        .collect();
    let full = serde_json::to_value(cfg).expect("the config serialises");
    let mut out = serde_json::Map::new();
    for (group, fields) in full.as_object().into_iter().flatten() {
        let picked: serde_json::Map<_, _> = fields
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(k, _)| explicit.contains(k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        if !picked.is_empty() {
            out.insert(group.clone(), Value::Object(picked));
        }
    }
    Value::Object(out)
}

/// Sets every key of `layer` in `base` (tables are merged, values replaced).
fn overlay(base: &mut Value, layer: &Value) {
    match (base, layer) {
        (Value::Object(b), Value::Object(l)) => {
            for (k, v) in l {
                match b.get_mut(k) {
                    Some(slot) if slot.is_object() && v.is_object() => overlay(slot, v),
                    _ => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (b, l) => *b = l.clone(),
    }
}

/// The defaults with `layers` applied in order, checked.
pub fn resolve(layers: &[(String, Value)]) -> Result<TrainConfig> {
    let mut v = serde_json::to_value(TrainConfig::default()).expect("the config serialises");
    for (name, layer) in layers {
        overlay(&mut v, layer);
        // Deserialise after each layer so that an unknown key or a wrong type names its source.
        serde_json::from_value::<TrainConfig>(v.clone()).map_err(|e| TrainError::Config(format!("{name}: {e}")))?;
    }
    let cfg: TrainConfig = serde_json::from_value(v).map_err(|e| TrainError::Config(e.to_string()))?;
    cfg.validate()?;
    Ok(cfg)
}

/// The training config of a parsed command line: the layers resolved, reading the files it names.
/// `matches` are the ones `cli` was parsed from (they say which flags were given).
pub fn from_matches(cli: &TrainArgs, matches: &ArgMatches) -> Result<(TrainConfig, RunControl)> {
    let mut layers = Vec::new();
    if let Some(p) = cli.preset {
        layers.push((format!("--preset {}", p.to_possible_value().expect("named").get_name()), preset_layer(p)));
    }
    let mut resumed = None;
    if let Some(dir) = &cli.resume {
        let ckpt = crate::snapshot::find(dir)?;
        let path = ckpt.join(crate::snapshot::CONFIG_FILE);
        let layer = file_layer(&path)?;
        resumed = Some((path.clone(), layer.clone()));
        layers.push((path.display().to_string(), layer));
        // The run goes on in the folder that holds the checkpoint, wherever it was moved to.
        let run_dir =
            std::path::absolute(ckpt.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")))
                .map_err(|e| TrainError::Config(format!("{}: {e}", ckpt.display())))?;
        layers.push((format!("--resume {}", dir.display()), serde_json::json!({"run": {"output_dir": run_dir}})));
    }
    if let Some(path) = &cli.config {
        layers.push((path.display().to_string(), file_layer(path)?));
    }
    layers.push(("command line".into(), cli_layer(&cli.cfg, matches)));
    let cfg = resolve(&layers)?;
    if let Some((path, layer)) = &resumed {
        check_resumed_paths(&cfg, path, layer)?;
    }
    Ok((cfg, RunControl { resume: cli.resume.clone(), stop_after: cli.stop_after, interrupted: None }))
}

/// Refuses a relative path that the resumed checkpoint's `config.toml` (`file`, read as `layer`) gives and
/// that is not there from this folder: runs before paths were stored absolute wrote them as given, relative
/// to the folder they ran in. A `--model` of the form `org/name` may be a hub id and is left to the loader.
fn check_resumed_paths(cfg: &TrainConfig, file: &Path, layer: &Value) -> Result<()> {
    let hub_like = |m: &&str| m.split('/').count() == 2 && !m.starts_with(['.', '/', '~']);
    let model = cfg.model.model.as_deref().filter(|m| !hub_like(m)).map(Path::new);
    let fields = [
        ("model", "model", model),
        ("data", "data", cfg.data.data.as_deref()),
        ("data", "val", cfg.data.val.as_deref()),
        ("model", "init_config", cfg.model.init_config.as_deref()),
        ("model", "init_tokenizer", cfg.model.init_tokenizer.as_deref()),
    ];
    for (group, key, value) in fields {
        let Some(path) = value.filter(|p| p.is_relative() && !p.exists()) else { continue };
        if layer[group][key].as_str() == path.to_str() {
            return Err(TrainError::Config(format!(
                "{} gives the relative path {key} = \"{}\" (written by an older askgui-train, relative to the folder \
                 it ran in), and there is no such path from here; run from that folder, or pass --{} with its path",
                file.display(),
                path.display(),
                key.replace('_', "-")
            )));
        }
    }
    Ok(())
}

impl TrainConfig {
    /// Checks ranges and combinations, with messages that name the option.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(TrainError::Config(m));
        match (&self.model.model, &self.model.init_config) {
            (None, None) => {
                return bad("no model: pass --model DIR|HUB_ID or --init-config FILE (or `model = ...` under \
                            [model] in --config)"
                    .into())
            }
            (Some(_), Some(_)) => return bad("--model and --init-config exclude each other".into()),
            _ => {}
        }
        if self.model.mode == Mode::Full
            && self.model.dtype == DTypeChoice::Bf16
            && self.model.device == DeviceKind::Cpu
        {
            return bad("--mode full on the CPU trains f32 weights (the CPU has no bf16 backward); drop --dtype bf16 \
                        or train on a GPU"
                .into());
        }
        if self.model.init_tokenizer.is_some() && self.model.init_config.is_none() {
            return bad("--init-tokenizer goes with --init-config (a model from scratch)".into());
        }
        if self.data.data.is_none() {
            return bad("no training data: pass --data FILE.jsonl (or `data = ...` under [data] in --config)".into());
        }
        if !(self.data.region_weight.is_finite() && self.data.region_weight >= 0.0) {
            return bad(format!("--region-weight is {}; it must be >= 0 (0: off)", self.data.region_weight));
        }
        if self.data.region_layer == 0 {
            return bad("--region-layer counts decoder layers from 1".into());
        }
        if self.data.prefetch > MAX_PREFETCH {
            return bad(format!(
                "--prefetch {} would hold that many micro-batches' pixels in memory; use at most {MAX_PREFETCH} \
                 (0 makes each micro-batch in turn)",
                self.data.prefetch
            ));
        }
        let (l, o) = (&self.lora, &self.optim);
        if o.micro_batch_threads == 0 {
            return bad("--micro-batch-threads must be at least 1 (1: one micro-batch at a time)".into());
        }
        if o.micro_batch_threads > 1 && self.model.device != DeviceKind::Cpu {
            return bad(format!(
                "--micro-batch-threads {} runs micro-batches on CPU threads; add --device cpu, or drop it on a GPU",
                o.micro_batch_threads
            ));
        }
        if l.lora_rank == 0 {
            return bad("--lora-rank must be at least 1".into());
        }
        if !(l.lora_alpha.is_finite() && l.lora_alpha > 0.0) {
            return bad(format!("--lora-alpha is {}; it must be positive", l.lora_alpha));
        }
        if !(0.0..1.0).contains(&l.lora_dropout) {
            return bad(format!("--lora-dropout is {}; it must be in [0, 1)", l.lora_dropout));
        }
        if l.lora_targets.is_empty() || l.lora_targets.iter().any(|t| t.trim().is_empty()) {
            return bad(format!("--lora-targets {:?} must name at least one module and no empty one", l.lora_targets));
        }
        if !(o.lr.is_finite() && o.lr > 0.0) {
            return bad(format!("--lr is {}; it must be positive", o.lr));
        }
        for (name, b) in [("--beta1", o.beta1), ("--beta2", o.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return bad(format!("{name} is {b}; it must be in [0, 1)"));
            }
        }
        if !(o.eps.is_finite() && o.eps > 0.0) {
            return bad(format!("--eps is {}; it must be positive", o.eps));
        }
        if !(o.weight_decay.is_finite() && o.weight_decay >= 0.0) {
            return bad(format!("--weight-decay is {}; it must be >= 0", o.weight_decay));
        }
        if !(0.0..=1.0).contains(&o.warmup_ratio) {
            return bad(format!("--warmup-ratio is {}; it must be in [0, 1]", o.warmup_ratio));
        }
        if !(0.0..=1.0).contains(&o.min_lr_ratio) {
            return bad(format!("--min-lr-ratio is {}; it must be in [0, 1]", o.min_lr_ratio));
        }
        if !(o.max_grad_norm.is_finite() && o.max_grad_norm >= 0.0) {
            return bad(format!("--max-grad-norm is {}; it must be >= 0 (0: no clipping)", o.max_grad_norm));
        }
        for (name, v) in [("--batch-size", o.batch_size), ("--grad-accum", o.grad_accum), ("--epochs", o.epochs)] {
            if v == 0 {
                return bad(format!("{name} must be at least 1"));
            }
        }
        let d = &self.data;
        if d.min_pixels > 0 && d.max_pixels > 0 && d.min_pixels > d.max_pixels {
            return bad(format!("--min-pixels {} is larger than --max-pixels {}", d.min_pixels, d.max_pixels));
        }
        if self.run.eval_max_new_tokens == 0 {
            return bad("--eval-max-new-tokens must be at least 1".into());
        }
        if d.max_seq_len < 16 {
            return bad(format!("--max-seq-len is {}; it must be at least 16", d.max_seq_len));
        }
        Ok(())
    }

    /// The config with its local paths absolute, so that the saved `config.toml` and the adapter's
    /// `base_model_name_or_path` name the same files from any folder (`--resume`, `convert-adapter`, serve
    /// and PEFT's `AutoPeftModel` read them from wherever they run). Relative paths are taken from the
    /// current folder, as the flags were; a `--model` that is no existing path (a hub id) stays as given.
    pub fn with_absolute_paths(&self) -> Result<TrainConfig> {
        let abs = |p: &Path| {
            std::path::absolute(p).map_err(|e| TrainError::Config(format!("{}: no absolute path: {e}", p.display())))
        };
        let opt = |p: &Option<PathBuf>| p.as_deref().map(abs).transpose();
        let mut c = self.clone();
        if let Some(m) = c.model.model.as_deref().filter(|m| Path::new(m).exists()) {
            c.model.model = Some(abs(Path::new(m))?.to_string_lossy().into_owned());
        }
        c.model.init_config = opt(&c.model.init_config)?;
        c.model.init_tokenizer = opt(&c.model.init_tokenizer)?;
        c.data.data = opt(&c.data.data)?;
        c.data.val = opt(&c.data.val)?;
        c.run.output_dir = abs(&c.run.output_dir)?;
        Ok(c)
    }

    /// Sequences per optimiser step.
    pub fn sequences_per_step(&self) -> usize {
        self.optim.batch_size * self.optim.grad_accum
    }

    /// The config as the TOML saved beside checkpoints.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("the config serialises to TOML")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::from_args;

    fn parse(args: &[&str]) -> Result<TrainConfig> {
        from_args(std::iter::once("askgui-train").chain(args.iter().copied())).map(|(c, _)| c)
    }

    #[test]
    fn defaults_flags_and_validation() {
        let c =
            parse(&["--model", "m", "--data", "d.jsonl", "--lr", "3e-4", "--lora-targets", "q_proj,v_proj"]).unwrap();
        assert_eq!(c.optim.lr, 3e-4);
        assert_eq!(c.lora.lora_targets, ["q_proj", "v_proj"]);
        assert_eq!(c.optim.beta2, 0.999);
        let c = parse(&["--model", "m", "--data", "d.jsonl", "--val", "v.jsonl", "--warmup-steps", "0"]).unwrap();
        assert_eq!(c.data.val.as_deref(), Some(Path::new("v.jsonl")));
        assert_eq!(c.optim.warmup_steps, Some(0));
        assert!(c.run.grad_checkpointing && c.run.save_checkpoints);
        let e = parse(&["--data", "d.jsonl"]).unwrap_err().to_string();
        assert!(e.contains("--model"), "{e}");
        let c = parse(&["--init-config", "c.json", "--data", "d", "--mode", "full"]).unwrap();
        assert_eq!((c.model.mode, c.model.init_config.as_deref()), (Mode::Full, Some(Path::new("c.json"))));
        let e = parse(&["--model", "m", "--init-config", "c.json", "--data", "d"]).unwrap_err().to_string();
        assert!(e.contains("exclude each other"), "{e}");
        let e = parse(&["--model", "m", "--data", "d", "--lora-dropout", "1.5"]).unwrap_err().to_string();
        assert!(e.contains("--lora-dropout"), "{e}");
        let e = parse(&["--model", "m", "--data", "d", "--region-weight=-1"]).unwrap_err().to_string();
        assert!(e.contains("--region-weight"), "{e}");
        let e = parse(&["--model", "m", "--data", "d", "--region-layer", "0"]).unwrap_err().to_string();
        assert!(e.contains("--region-layer"), "{e}");
        // Prefetch is on by default, recorded in the saved config, and bounded.
        assert_eq!(c.data.prefetch, 2);
        let c = parse(&["--model", "m", "--data", "d", "--prefetch", "0"]).unwrap();
        assert!(c.to_toml().contains("prefetch = 0"), "{}", c.to_toml());
        let e = parse(&["--model", "m", "--data", "d", "--prefetch", "17"]).unwrap_err().to_string();
        assert!(e.contains("--prefetch 17") && e.contains("at most 16"), "{e}");
        let c = parse(&["--model", "m", "--data", "d", "--action-language", "ui-tars"]).unwrap();
        assert_eq!(c.data.action_language, ActionLanguage::UiTars);
        // Every language has a compact prompt.
        let c = parse(&["--model", "m", "--data", "d", "--action-language", "tool-call", "--system-prompt", "compact"])
            .unwrap();
        assert_eq!((c.data.action_language, c.data.system_prompt), (ActionLanguage::ToolCall, SystemPrompt::Compact));
    }

    #[test]
    fn dtype_and_kernels_flags_reach_the_saved_config() {
        let c = parse(&["--model", "m", "--data", "d", "--dtype", "bf16", "--kernels", "reference"]).unwrap();
        assert_eq!((c.model.dtype, c.model.kernels), (DTypeChoice::Bf16, KernelChoice::Reference));
        let toml = c.to_toml();
        assert!(toml.contains("dtype = \"bf16\"") && toml.contains("kernels = \"reference\""), "{toml}");
        let d = parse(&["--model", "m", "--data", "d"]).unwrap();
        assert_eq!((d.model.dtype, d.model.kernels), (DTypeChoice::Auto, KernelChoice::Askgui));
        // bf16 full training needs a GPU (f32 masters in the optimiser): refused on the CPU, left to the
        // device choice otherwise (`pick_device` refuses it where `auto` lands on the CPU).
        let full = ["--model", "m", "--data", "d", "--mode", "full", "--dtype", "bf16"];
        let e = parse(&[&full[..], &["--device", "cpu"]].concat()).unwrap_err().to_string();
        assert!(e.contains("--dtype bf16") && e.contains("CPU"), "{e}");
        assert_eq!(parse(&[&full[..], &["--device", "cuda"]].concat()).unwrap().model.dtype, DTypeChoice::Bf16);
    }

    #[test]
    fn preset_file_and_flags_layer_in_order() {
        let dir = std::env::temp_dir().join(format!("askgui-train-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("c.toml");
        std::fs::write(&file, "[model]\nmodel = \"from-file\"\n[data]\ndata = \"d.jsonl\"\n[optim]\nlr = 5e-5\n")
            .unwrap();
        let f = file.to_str().unwrap();
        // The preset sets rank, lr and batch; the file overrides lr; a flag overrides the file's model.
        let c = parse(&["--preset", "navi-plus", "--config", f, "--model", "flag"]).unwrap();
        assert_eq!((c.lora.lora_rank, c.optim.lr, c.sequences_per_step()), (64, 5e-5, 64));
        assert_eq!(c.model.model.as_deref(), Some("flag"));
        // The Qwen3-VL preset: its native frame and token budget, and a flag over it.
        let c = parse(&["--preset", "qwen3-vl-lora", "--model", "m", "--data", "d", "--lora-rank", "32"]).unwrap();
        assert_eq!((c.data.frame, c.data.max_pixels, c.optim.lr), (Some(FrameKind::Relative1000), 1_310_720, 1e-4));
        assert_eq!((c.lora.lora_rank, c.lora.lora_alpha, c.sequences_per_step()), (32, 128.0, 64));
        // A flag left at its default does not override the file.
        let c = parse(&["--config", f]).unwrap();
        assert_eq!(c.optim.lr, 5e-5);
        // The saved TOML reads back to the same config.
        std::fs::write(&file, c.to_toml()).unwrap();
        assert_eq!(parse(&["--config", f]).unwrap(), c);
        // A typo is an error that names the file.
        std::fs::write(&file, "[optim]\nlearning_rate = 1.0\n").unwrap();
        let e = parse(&["--config", f, "--model", "m", "--data", "d"]).unwrap_err().to_string();
        assert!(e.contains("c.toml") && e.contains("learning_rate"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
