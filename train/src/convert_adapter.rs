//! `askgui-train convert-adapter`: rewrites a PEFT LoRA adapter's tensor keys into the other layout, for
//! an adapter made anywhere (an askgui checkpoint, an old hub adapter for Qwen2.5-VL): `transformers5` is
//! what PEFT on transformers 5 reads, `hub` what PEFT on transformers 4, vLLM and SGLang read.
//!
//! The rewrite is askgui-model's ([`askgui_model::peft::convert_adapter`], the key mapping adapters are
//! saved with): the adapter is first checked against the base model's config.json as loading does, so an
//! adapter whose modules the base lacks, or of other shapes, is refused with the module named. Tensors
//! keep their bytes; the model card records the new layout; a training checkpoint's optimiser and trainer
//! state are left out (the result is an adapter to load, not a run to resume). The folder is filled under
//! a temporary name and renamed into place, as merge's; an existing non-empty `--out` is refused.

use std::path::{Path, PathBuf};

use askgui_model::peft::{Conversion, CONFIG_FILE};
use askgui_model::{AdapterLayout, CheckpointFiles, LoraConfig, ModelConfig};
use clap::{CommandFactory, FromArgMatches, Parser};

use crate::config::AdapterKeys;
use crate::error::{Result, TrainError};

/// `askgui-train convert-adapter`.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "askgui-train convert-adapter",
    about = "Rewrite a PEFT LoRA adapter's tensor keys for transformers 5 (PEFT today) or the hub layout"
)]
pub struct ConvertArgs {
    /// The PEFT adapter folder to read (adapter_config.json + adapter_model.safetensors).
    #[arg(long = "in")]
    pub input: PathBuf,
    /// The folder to write (must not exist, or be empty).
    #[arg(long)]
    pub out: PathBuf,
    /// The key layout to write: transformers5 (PEFT on transformers 5) or hub (transformers 4, vLLM, SGLang).
    #[arg(long, value_enum)]
    pub to: AdapterKeys,
    /// The base checkpoint folder or hub id the adapter is checked against (default: its base_model_name_or_path).
    #[arg(long)]
    pub model: Option<String>,
}

/// What a conversion wrote.
#[derive(Debug, Clone)]
pub struct ConvertSummary {
    pub out: PathBuf,
    /// The layout written.
    pub to: AdapterLayout,
    pub conversion: Conversion,
}

/// Converts `args.input` into `args.out`.
pub fn convert(args: &ConvertArgs) -> Result<ConvertSummary> {
    if !args.input.is_dir() {
        return Err(TrainError::Convert(format!(
            "--in {}: no such folder (pass a PEFT adapter folder: adapter_config.json + adapter_model.safetensors)",
            args.input.display()
        )));
    }
    let (parent, name) = crate::snapshot::fresh_folder(&args.out, "--out", TrainError::Convert)?;
    let cfg = base_config(args)?;
    let to = AdapterLayout::from(args.to);
    let mut conversion = None;
    let out = crate::snapshot::write_atomically(&parent, &name, |tmp| {
        let mut c = askgui_model::peft::convert_adapter(&args.input, tmp, &cfg, to)?;
        drop_training_state(tmp, &mut c.copied)?;
        conversion = Some(c);
        Ok(())
    })?;
    let conversion = conversion.expect("write_atomically ran the fill");
    let from = conversion.from.map(AdapterLayout::name).unwrap_or("unknown");
    if conversion.from == Some(to) {
        tracing::warn!(layout = to.name(), "the adapter was already in this layout; it was copied with the same keys");
    }
    tracing::info!(out = %out.display(), from, to = to.name(), modules = conversion.modules, copied = ?conversion.copied, "converted adapter");
    Ok(ConvertSummary { out, to, conversion })
}

/// Removes what only resumes a training run (the optimiser and trainer state of a checkpoint) from the
/// converted folder `dir` and from `copied`: a converted adapter is for loading by another stack.
fn drop_training_state(dir: &Path, copied: &mut Vec<String>) -> Result<()> {
    for file in [crate::snapshot::OPTIMIZER_FILE, crate::snapshot::STATE_FILE] {
        if let Some(i) = copied.iter().position(|c| c == file) {
            let path = dir.join(file);
            std::fs::remove_file(&path).map_err(crate::error::io(path))?;
            copied.remove(i);
        }
    }
    Ok(())
}

/// The base model's config: `--model`, or the adapter's `base_model_name_or_path`.
fn base_config(args: &ConvertArgs) -> Result<ModelConfig> {
    let base = match &args.model {
        Some(m) => m.clone(),
        None => LoraConfig::from_file(&args.input.join(CONFIG_FILE))?.base_model_name_or_path.ok_or_else(|| {
            TrainError::Convert(format!(
                "{}: no base_model_name_or_path; pass --model with the base checkpoint the adapter was trained on",
                args.input.join(CONFIG_FILE).display()
            ))
        })?,
    };
    let local = Path::new(&base).join("config.json");
    let config = if local.is_file() {
        local
    } else {
        match CheckpointFiles::resolve(&base) {
            Ok(files) => files.config,
            Err(e) if args.model.is_none() => {
                return Err(TrainError::Convert(format!(
                    "the adapter's base_model_name_or_path `{base}` is not a local folder nor a hub model found ({e}); \
                     pass --model with the base checkpoint"
                )))
            }
            Err(e) => return Err(e.into()),
        }
    };
    Ok(ModelConfig::from_file(&config)?)
}

/// Parses `askgui-train convert-adapter ...` (argv without the binary name) and converts.
pub fn run_cli<I, T>(argv: I) -> Result<ConvertSummary>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = |e| TrainError::Cli(Box::new(e));
    let matches =
        ConvertArgs::command().bin_name("askgui-train convert-adapter").try_get_matches_from(argv).map_err(cli)?;
    convert(&ConvertArgs::from_arg_matches(&matches).map_err(cli)?)
}
