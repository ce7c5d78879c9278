//! `--init-config` + `--mode full`: training from scratch changes every base weight, the loss falls, and
//! the checkpoint is a model folder that the model loader reads back.

mod common;

use std::path::Path;

use askgui_model::Qwen2Vl;
use askgui_train::cli::from_args;
use askgui_train::RunControl;
use candle_core::{DType, Device};
use common::{episodes, scratch};

#[test]
fn full_training_from_scratch_writes_a_loadable_model() -> anyhow::Result<()> {
    let dir = scratch("full");
    let data = episodes(&dir, 1);
    // The test fixture's small config (its special-token ids are the byte-level tokenizer's).
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/tiny-qwen2_5_vl/config.json");
    let out = dir.join("run");
    let argv = format!(
        "askgui-train --init-config {} --mode full --data {} --output-dir {} --max-pixels 12544 --progress false \
         --lr 1e-2 --warmup-steps 0 --min-lr-ratio 1 --max-steps 8 --batch-size 2 --grad-accum 1 --save-every 0",
        config.display(),
        data.display(),
        out.display()
    );
    let (cfg, _) = from_args(argv.split_whitespace())?;
    let s = askgui_train::train(&cfg, &RunControl::default())?;
    let losses: Vec<f64> = s.steps.iter().map(|l| l.loss).collect();
    eprintln!("losses: {losses:?}");
    assert!(losses.iter().all(|l| l.is_finite()));
    assert!(losses[6..].iter().sum::<f64>() < 0.7 * losses[..2].iter().sum::<f64>(), "{losses:?}");

    let ckpt = s.last_checkpoint.expect("a final checkpoint");
    let trained = Qwen2Vl::load(ckpt.to_str().unwrap(), &Device::Cpu, DType::F32)?;
    assert_eq!(trained.image_config.max_pixels, 12544, "the preprocessor config travels with the model");
    let init = candle_core::safetensors::load(out.join("init-model").join("model.safetensors"), &Device::Cpu)?;
    let now = trained.base_checkpoint_tensors()?;
    assert_eq!(now.len(), init.len());
    for (name, t) in &now {
        let d = (t - &init[name])?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        assert!(d > 0.0, "`{name}` did not change in training");
    }
    Ok(())
}
