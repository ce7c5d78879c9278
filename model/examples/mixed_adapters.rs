//! Several LoRA adapters in one batch, timed: one packed decode step of `--seqs` sequences on a random
//! checkpoint with a 3B-shaped decoder layer (hidden 2048, MLP 11008, 16 heads, 2 KV heads; `--layers`
//! of them), in four ways: the base model; one adapter for every row; rows of `--adapters` adapters mixed
//! in one forward (`Qwen2Vl::decode_packed_adapters`); and one forward per adapter with it made the
//! active one (what the server did before batches mixed adapters). Adapters are rank `--rank` on the
//! seven decoder projections, with B non-zero.
//!
//! cargo run -p askgui-model --example mixed_adapters -- [--layers 2] [--seqs 16] [--adapters 4]
//!     [--rank 64] [--steps 5]
//!
//! The dev profile builds this crate and its dependencies at opt-level 3, so `--release` is not needed.
//! Prints one JSON line with the median milliseconds of each way over `--steps` timed steps (after one
//! warm-up), each step on fresh copies of the prompts' caches.

use std::path::Path;
use std::time::Instant;

use anyhow::Result;
use askgui_model::model::positions_tensor;
use askgui_model::random_init::{random_weights, write_checkpoint};
use askgui_model::{KvCache, LoraConfig, ModelConfig, NewRows, Qwen2Vl};
use candle_core::{DType, Device, Tensor};
use clap::Parser;

#[derive(Parser)]
struct Args {
    /// Decoder layers of the random checkpoint.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Sequences in the decode step.
    #[arg(long, default_value_t = 16)]
    seqs: usize,
    /// Adapters the sequences are spread over (round robin).
    #[arg(long, default_value_t = 4)]
    adapters: usize,
    /// LoRA rank.
    #[arg(long, default_value_t = 64)]
    rank: usize,
    /// Timed steps per way (the median is reported).
    #[arg(long, default_value_t = 5)]
    steps: usize,
}

/// The tiny Qwen2.5-VL fixture's config with a 3B-shaped decoder, written with random weights to `dir`.
fn checkpoint(dir: &Path, layers: usize) -> Result<Qwen2Vl> {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-qwen2_5_vl");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture.join("config.json"))?)?;
    let text = &mut cfg["text_config"];
    text["hidden_size"] = 2048.into();
    text["intermediate_size"] = 11008.into();
    text["num_attention_heads"] = 16.into();
    text["num_key_value_heads"] = 2.into();
    text["num_hidden_layers"] = layers.into();
    text["layer_types"] = vec!["full_attention"; layers].into();
    text["rope_parameters"]["mrope_section"] = vec![16, 24, 24].into();
    cfg["vision_config"]["out_hidden_size"] = 2048.into();
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&cfg)?)?;
    let parsed = ModelConfig::from_file(&dir.join("config.json"))?;
    write_checkpoint(&random_weights(&parsed, 1)?, dir)?;
    Ok(Qwen2Vl::load(dir.to_str().unwrap_or_default(), &Device::Cpu, DType::F32)?)
}

/// Each sequence's cache after a 32-token prompt.
fn prompts(m: &Qwen2Vl, seqs: usize) -> Result<Vec<KvCache>> {
    let mut caches = Vec::new();
    for s in 0..seqs {
        let ids: Vec<u32> = (0..32u32).map(|i| (s as u32 * 31 + i * 7) % 250 + 1).collect();
        let emb = m.embed(&Tensor::from_slice(&ids, (1, 32), &Device::Cpu)?, None)?;
        let mut cache = m.new_cache();
        let pos = (0..32u32).map(|p| [p; 3]).collect();
        m.decode(&emb, &positions_tensor(&[pos], 32)?, None, &mut cache)?;
        caches.push(cache);
    }
    Ok(caches)
}

/// One decode step of the sequences `seqs` (token 7 at position 32 each), with `adapters` per sequence
/// (None: the active adapter for all); milliseconds.
fn step(m: &Qwen2Vl, caches: &[KvCache], seqs: &[usize], adapters: Option<&[Option<&str>]>) -> Result<f64> {
    let n = seqs.len();
    let emb = m.embed(&Tensor::from_vec(vec![7u32; n], (1, n), &Device::Cpu)?, None)?;
    let pos = positions_tensor(&[vec![[32; 3]; n]], n)?;
    let mut own: Vec<KvCache> = seqs.iter().map(|&s| caches[s].clone()).collect();
    let mut refs: Vec<&mut KvCache> = own.iter_mut().collect();
    let rows = vec![NewRows::Append(1); n];
    let t = Instant::now();
    let hidden = match adapters {
        Some(a) => m.decode_packed_adapters(&emb, &pos, (&rows, a), &mut refs)?,
        None => m.decode_packed(&emb, &pos, &rows, &mut refs)?,
    };
    m.logits(&hidden)?.to_vec3::<f32>()?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dir = std::env::temp_dir().join(format!("askgui-mixed-adapters-{}", std::process::id()));
    let mut m = checkpoint(&dir, args.layers)?;
    let names: Vec<String> = (0..args.adapters).map(|a| format!("a{a}")).collect();
    let targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];
    for (i, name) in names.iter().enumerate() {
        m.add_trainable_adapter(name, LoraConfig::new(args.rank, 2.0 * args.rank as f64, &targets), i as u64)?;
        for (key, v) in m.trainable_vars(name)? {
            if key.ends_with("lora_B") {
                v.set(&(v.ones_like()? * 0.01)?)?;
            }
        }
    }
    let caches = prompts(&m, args.seqs)?;
    let all: Vec<usize> = (0..args.seqs).collect();
    let own: Vec<Option<&str>> = all.iter().map(|s| Some(names[s % names.len()].as_str())).collect();
    let timed = |f: &mut dyn FnMut() -> Result<f64>| -> Result<f64> {
        f()?;
        Ok(median((0..args.steps).map(|_| f()).collect::<Result<_>>()?))
    };
    m.set_active_adapter(None)?;
    let base = timed(&mut || step(&m, &caches, &all, None))?;
    m.set_active_adapter(Some(&names[0]))?;
    let one = timed(&mut || step(&m, &caches, &all, None))?;
    m.set_active_adapter(None)?;
    let mixed = timed(&mut || step(&m, &caches, &all, Some(&own)))?;
    let per_adapter = timed(&mut || {
        let mut ms = 0.0;
        for (a, name) in names.iter().enumerate() {
            m.set_active_adapter(Some(name))?;
            let seqs: Vec<usize> = all.iter().copied().filter(|s| s % names.len() == a).collect();
            ms += step(&m, &caches, &seqs, None)?;
        }
        Ok(ms)
    })?;
    println!(
        "{}",
        serde_json::json!({
            "layers": args.layers, "seqs": args.seqs, "adapters": args.adapters, "rank": args.rank,
            "base_ms": base, "one_adapter_ms": one, "mixed_ms": mixed, "one_forward_per_adapter_ms": per_adapter,
        })
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
