//! `--init-config`: a checkpoint folder of any family with random weights, for training from scratch.
//!
//! The weights are askgui-model's [`askgui_model::random_init::random_weights`] (transformers' initialisation:
//! N(0, 0.02) weights and embeddings, zero biases, unit norms). The tokenizer is the byte-level one of the
//! model's test fixture (256 bytes + the 8 Qwen special tokens, vocab 272), embedded in the binary so that
//! nothing is downloaded; a config for it must use its special-token ids (`image_token_id` 262, ...).
//! [`DEMO_CONFIG`] is the small model of `askgui-train demo`.

use std::path::Path;

use askgui_model::{random_init as init, ModelConfig, Qwen2Vl};

use crate::config::TrainConfig;
use crate::error::{io, Result, TrainError};
use crate::optim::{AdamW, AdamWParams};
use crate::snapshot::TrainerState;

/// The byte-level tokenizer (from `model/tests/fixtures/tiny-qwen2_5_vl`).
pub const TOKENIZER_JSON: &str = include_str!("../assets/byte-tokenizer/tokenizer.json");
pub const TOKENIZER_CONFIG_JSON: &str = include_str!("../assets/byte-tokenizer/tokenizer_config.json");
/// The demo's model: text hidden 128, 3 layers; vision hidden 64, depth 2; tied embeddings.
pub const DEMO_CONFIG: &str = include_str!("../assets/demo-config.json");
/// The demo's model as Qwen3-VL (`askgui-train demo --arch qwen3_vl`): the same widths and depths, head_dim
/// 32, DeepStack from vision block 0, an 8x8 position table, 16-px patches.
pub const DEMO_CONFIG_QWEN3_VL: &str = include_str!("../assets/demo-config-qwen3_vl.json");

/// The files beside the weights that a model folder carries.
const SIDE_FILES: [&str; 5] =
    ["config.json", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json", "generation_config.json"];

/// Writes a random checkpoint for `config_json` (config.json text) into `out` (created): config.json,
/// model.safetensors, the tokenizer (`tokenizer_json`, or the byte-level one), a preprocessor_config.json
/// with the given pixel bounds and a generation_config.json with the config's end-of-sequence ids.
pub fn write_random_model(
    config_json: &str,
    tokenizer_json: Option<&str>,
    out: &Path,
    seed: u64,
    (min_pixels, max_pixels): (usize, usize),
) -> Result<()> {
    let cfg = ModelConfig::from_json_str(config_json, &out.join("config.json"))?;
    let tokenizer_json = tokenizer_json.unwrap_or(TOKENIZER_JSON);
    let vocab = tokenizers::Tokenizer::from_bytes(tokenizer_json.as_bytes())
        .map_err(|e| TrainError::Config(format!("--init-tokenizer: {e}")))?
        .get_vocab_size(true);
    if cfg.text.vocab_size < vocab || cfg.image_token_id != 262 || cfg.vision_start_token_id != 259 {
        return Err(TrainError::Config(format!(
            "--init-config: the tokenizer needs vocab_size >= {vocab}, image_token_id 262 and \
             vision_start_token_id 259; the config has {}, {} and {}",
            cfg.text.vocab_size, cfg.image_token_id, cfg.vision_start_token_id
        )));
    }
    std::fs::create_dir_all(out).map_err(io(out))?;
    init::write_checkpoint(&init::random_weights(&cfg, seed)?, out)?;
    let (mean, std) = cfg.arch.image_mean_std();
    let preprocessor = serde_json::json!({
        "min_pixels": min_pixels, "max_pixels": max_pixels, "patch_size": cfg.vision.patch_size,
        "temporal_patch_size": cfg.vision.temporal_patch_size, "merge_size": cfg.vision.spatial_merge_size,
        "image_mean": mean, "image_std": std, "image_processor_type": "Qwen2VLImageProcessor"
    });
    let generation = serde_json::json!({ "eos_token_id": cfg.eos_token_ids, "pad_token_id": 256 });
    let pretty = |v: &serde_json::Value| serde_json::to_string_pretty(v).expect("json");
    for (name, text) in [
        ("config.json", config_json.to_string()),
        ("tokenizer.json", tokenizer_json.to_string()),
        ("tokenizer_config.json", TOKENIZER_CONFIG_JSON.to_string()),
        ("preprocessor_config.json", pretty(&preprocessor)),
        ("generation_config.json", pretty(&generation)),
    ] {
        let p = out.join(name);
        std::fs::write(&p, text).map_err(io(&p))?;
    }
    Ok(())
}

/// Saves `model`'s base weights as a model folder `out` (full training's checkpoint): model.safetensors
/// and the side files of the folder it was loaded from.
pub fn save_model(model: &Qwen2Vl, out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).map_err(io(out))?;
    model.save_base(out)?;
    for name in SIDE_FILES {
        let from = model.files.dir.join(name);
        if from.exists() {
            let to = out.join(name);
            std::fs::copy(&from, &to).map_err(io(&to))?;
        }
    }
    Ok(())
}

/// `--init-config`: writes the random model for `config` to `OUTPUT_DIR/init-model` (replacing an old
/// one) with `--seed` and the pixel bounds of `cfg`, and returns the folder.
pub(crate) fn init_model_dir(cfg: &TrainConfig, config: &Path) -> Result<String> {
    let text = std::fs::read_to_string(config).map_err(io(config))?;
    let tokenizer = match &cfg.model.init_tokenizer {
        Some(p) => Some(std::fs::read_to_string(p).map_err(io(p))?),
        None => None,
    };
    let dir = cfg.run.output_dir.join("init-model");
    let d = &cfg.data;
    let min = if d.min_pixels > 0 { d.min_pixels } else { 3136 };
    let max = if d.max_pixels > 0 { d.max_pixels } else { 1_003_520 };
    write_random_model(&text, tokenizer.as_deref(), &dir, cfg.run.seed, (min, max))?;
    tracing::info!("random initialisation of {} written to {}", config.display(), dir.display());
    Ok(dir.to_string_lossy().into_owned())
}

/// `--mode full`: every base weight becomes trainable and the optimiser holds them all. Resuming a full
/// run is not supported yet (its checkpoints are model folders: pass one as `--model` to continue with a
/// fresh optimiser).
pub(crate) fn full_optimiser(
    model: &mut Qwen2Vl,
    cfg: &TrainConfig,
    ckpt: Option<&Path>,
) -> Result<(AdamW, TrainerState)> {
    if let Some(dir) = ckpt {
        return Err(TrainError::Config(format!(
            "--resume is not supported with --mode full yet; {} is a model folder: pass it as --model",
            dir.display()
        )));
    }
    model.make_base_trainable()?;
    let o = &cfg.optim;
    let params = AdamWParams { beta1: o.beta1, beta2: o.beta2, eps: o.eps, weight_decay: o.weight_decay };
    Ok((AdamW::new(model.base_vars()?, params)?, TrainerState::fresh(cfg.run.seed)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// A random checkpoint loads with the model's own loader, holds exactly the tensors the model reads
    /// (nothing missing, nothing extra), and saving the loaded model gives the same tensors back.
    #[test]
    fn random_model_loads_and_round_trips() -> anyhow::Result<()> {
        let dir = std::env::temp_dir().join(format!("askgui-init-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        write_random_model(DEMO_CONFIG, None, &dir, 3, (3136, 50176))?;
        let model = Qwen2Vl::load(dir.to_str().unwrap(), &Device::Cpu, DType::F32)?;
        assert_eq!(model.image_config.max_pixels, 50176);
        let written = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)?;
        let read = model.base_checkpoint_tensors()?;
        let mut names: Vec<_> = read.iter().map(|(n, _)| n.clone()).collect();
        let mut want: Vec<_> = written.keys().cloned().collect();
        names.sort();
        want.sort();
        assert_eq!(names, want);
        let again = dir.join("saved");
        save_model(&model, &again)?;
        let back = candle_core::safetensors::load(again.join("model.safetensors"), &Device::Cpu)?;
        for (n, t) in &written {
            assert_eq!(back[n].dims(), t.dims(), "{n}");
            let d = (&back[n] - t)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            assert_eq!(d, 0.0, "{n} differs after a save");
        }
        assert!(again.join("tokenizer.json").exists() && again.join("config.json").exists());
        model.tokenizer()?;
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }

    /// A config whose special-token ids do not fit the byte-level tokenizer is refused with the reason.
    #[test]
    fn refuses_a_config_for_another_tokenizer() {
        let cfg = DEMO_CONFIG.replace("\"image_token_id\": 262", "\"image_token_id\": 151655");
        let dir = std::env::temp_dir().join(format!("askgui-init-bad-{}", std::process::id()));
        let err = write_random_model(&cfg, None, &dir, 0, (3136, 50176)).unwrap_err().to_string();
        assert!(err.contains("image_token_id 262"), "{err}");
    }
}
