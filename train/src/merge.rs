//! `askgui-train merge`: folds a PEFT LoRA adapter into its base checkpoint and writes a plain Hugging
//! Face checkpoint folder that loads without PEFT (transformers' `from_pretrained`, vLLM, askgui's own
//! loader).
//!
//! The merge itself is askgui-model's ([`Qwen2Vl::merge_adapter`]: `W += (alpha / r) B A`, computed in
//! f32); its [`Qwen2Vl::base_tensors`] then lists every weight under its hub-layout checkpoint name with
//! the merged values. Each tensor is written back in the dtype the base checkpoint stored it in (a bf16
//! checkpoint stays bf16: the merged weight is rounded once, as PEFT's `merge_and_unload` on a bf16 model
//! does); tensors of the base file that the model does not load are copied through unchanged. Keys are the
//! family's checkpoint layout whichever layout the base used ([`askgui_model::Arch::checkpoint_key`]): for
//! Qwen2/2.5-VL the hub's (`model.layers.N...`, `visual.*`), which transformers 5 renames on load with an
//! empty load report (no missing or unused weight; `scripts/checks/check_merged.py` checks it); for
//! Qwen3-VL `model.language_model.*` and `model.visual.*`, as its released checkpoints are. One `model.safetensors` is written even when the
//! base was sharded. `config.json`, the tokenizer files, `preprocessor_config.json`
//! and `generation_config.json` are copied when present, and the adapter's `askgui.json` (the prompt and
//! image settings it was trained with).
//!
//! The folder is filled under a temporary name and renamed into place when complete (as checkpoints
//! are), so an interrupted merge leaves no half checkpoint. An existing non-empty `--out` is refused.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use askgui_model::peft::hub_name;
use askgui_model::Qwen2Vl;
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use clap::{CommandFactory, FromArgMatches, Parser};

use crate::error::{io, Result, TrainError};

/// The files besides the weights that make a checkpoint folder usable, copied when the base has them.
pub const COPIED_FILES: [&str; 11] = [
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
];

/// The merged weights' file.
pub const WEIGHTS_FILE: &str = "model.safetensors";

/// `askgui-train merge`.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "askgui-train merge",
    about = "Merge a PEFT LoRA adapter into its base checkpoint and write a plain Hugging Face checkpoint"
)]
pub struct MergeArgs {
    /// The base checkpoint folder or hub id the adapter was trained on.
    #[arg(long)]
    pub model: String,
    /// The PEFT adapter folder (adapter_config.json + adapter_model.safetensors), e.g. a training checkpoint:
    /// DIR, or NAME=DIR as askgui-serve takes it.
    #[arg(long, value_parser = askgui_data::AdapterArg::dir_of)]
    pub adapter: PathBuf,
    /// The folder to write (must not exist, or be empty).
    #[arg(long)]
    pub out: PathBuf,
}

/// What a merge wrote.
#[derive(Debug, Clone)]
pub struct MergeSummary {
    pub out: PathBuf,
    /// Linear weights the adapter changed.
    pub merged_modules: usize,
    /// Tensors written.
    pub tensors: usize,
    /// Base tensors copied unchanged because the model does not load them.
    pub passed_through: Vec<String>,
    /// The side files copied.
    pub copied: Vec<String>,
}

/// Merges `args.adapter` into `args.model` and writes `args.out`.
pub fn merge(args: &MergeArgs) -> Result<MergeSummary> {
    let bad = |m: String| Err(TrainError::Merge(m));
    if !args.adapter.is_dir() {
        return bad(format!(
            "--adapter {}: no such folder (pass a PEFT adapter folder: adapter_config.json + adapter_model.safetensors)",
            args.adapter.display()
        ));
    }
    let (parent, name) = crate::snapshot::fresh_folder(&args.out, "--out", TrainError::Merge)?;

    let device = Device::Cpu;
    let mut model = Qwen2Vl::load(&args.model, &device, DType::F32)?;
    model.load_adapter("merge", &args.adapter)?;
    let merged_modules = model.adapter("merge").map(|a| a.modules.len()).unwrap_or(0);
    model.merge_adapter("merge")?;

    // The dtype and shape each tensor is stored in (the model keeps some reshaped: the patch embedding's
    // conv3d kernel is a (out, 3*2*14*14) matrix), and the base tensors the model does not load, by hub name.
    let mut stored: BTreeMap<String, (DType, Vec<usize>, PathBuf, String)> = BTreeMap::new();
    for path in &model.files.weights {
        // SAFETY: read-only map of a file nobody truncates during the merge (as the model loader does).
        let st = unsafe { MmapedSafetensors::new(path) }
            .map_err(|e| TrainError::Merge(format!("{}: not a readable safetensors file: {e}", path.display())))?;
        for (key, view) in st.tensors() {
            // safetensors' dtype names (`BF16`, `F32`) lower-cased are candle's.
            let dtype = format!("{:?}", view.dtype()).to_lowercase().parse::<DType>().unwrap_or(DType::F32);
            stored.insert(hub_name(&key), (dtype, view.shape().to_vec(), path.clone(), key));
        }
    }
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for (name, t) in model.base_tensors() {
        let t = match stored.get(&name) {
            Some((dtype, shape, _, _)) => t.to_dtype(*dtype)?.reshape(shape.as_slice())?,
            None => t,
        };
        tensors.insert(model.cfg.arch.checkpoint_key(&name), t.contiguous()?);
    }
    let mut passed_through = Vec::new();
    for (hub, (_, _, path, key)) in &stored {
        if tensors.contains_key(&model.cfg.arch.checkpoint_key(hub)) {
            continue;
        }
        // SAFETY: as above.
        let st = unsafe { MmapedSafetensors::new(path) }
            .map_err(|e| TrainError::Merge(format!("{}: not a readable safetensors file: {e}", path.display())))?;
        let t =
            st.load(key, &Device::Cpu).map_err(|e| TrainError::Merge(format!("{}: `{key}`: {e}", path.display())))?;
        tensors.insert(model.cfg.arch.checkpoint_key(hub), t);
        passed_through.push(hub.clone());
    }
    if !passed_through.is_empty() {
        tracing::warn!(?passed_through, "base tensors the model does not load were copied unchanged");
    }

    let mut copied = Vec::new();
    let n = tensors.len();
    let out = crate::snapshot::write_atomically(&parent, &name, |tmp| {
        let weights = tmp.join(WEIGHTS_FILE);
        candle_core::safetensors::save(&tensors, &weights)
            .map_err(|e| TrainError::Merge(format!("{}: cannot write: {e}", weights.display())))?;
        for f in COPIED_FILES {
            let src = model.files.dir.join(f);
            if src.is_file() {
                let dst = tmp.join(f);
                std::fs::copy(&src, &dst).map_err(io(&dst))?;
                copied.push(f.to_string());
            }
        }
        // The settings the adapter was trained with travel with the merged model.
        let card = args.adapter.join(askgui_data::adapter_card::FILE);
        if card.is_file() {
            let dst = tmp.join(askgui_data::adapter_card::FILE);
            std::fs::copy(&card, &dst).map_err(io(&dst))?;
            copied.push(askgui_data::adapter_card::FILE.to_string());
        }
        Ok(())
    })?;
    tracing::info!(out = %out.display(), merged_modules, tensors = n, ?copied, "merged checkpoint");
    Ok(MergeSummary { out, merged_modules, tensors: n, passed_through, copied })
}

/// Parses `askgui-train merge ...` (argv without the binary name) and merges.
pub fn run_cli<I, T>(argv: I) -> Result<MergeSummary>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = |e| TrainError::Cli(Box::new(e));
    // The usage line names the subcommand as it is typed, not argv[0] (`merge`).
    let matches = MergeArgs::command().bin_name("askgui-train merge").try_get_matches_from(argv).map_err(cli)?;
    merge(&MergeArgs::from_arg_matches(&matches).map_err(cli)?)
}
