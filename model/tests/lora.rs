//! LoRA adapters against PEFT (fixtures from `scripts/fixtures/make_lora_fixtures.py`): loading both key layouts,
//! applied logits, several adapters held at once, merge / unmerge, save -> load, and clear errors for
//! bad adapters.
//!
//! Tolerance (f32 on CPU): logits are compared at 1e-4 of the reference's largest magnitude, as in
//! `tests/parity.rs` (different summation orders over a few layers; a wrong scale, transposed A/B or a
//! missing module shows up at 1e-1 or more). Merged vs unmerged logits use the same tolerance (folding
//! `scale * B A` into `W` changes the rounding, not the function); unmerge must restore `W` bit-exactly.

mod common;

use std::path::{Path, PathBuf};

use askgui_model::{AdapterLayout, ModelError, Qwen2Vl};
use candle_core::{DType, Device, Tensor};
use common::*;

const PEFT: &str = "lora/tiny-qwen2_5_vl-peft";
const PEFT_QV: &str = "lora/tiny-qwen2_5_vl-peft-qv";

struct Case {
    model: Qwen2Vl,
    ids: Vec<u32>,
    pv: Tensor,
    grid: Vec<[usize; 3]>,
    /// Prompt positions the PEFT logits were recorded at.
    rows: Tensor,
}

fn case(dir: &str) -> anyhow::Result<Case> {
    case_with(dir, "lora/peft_logits.safetensors")
}

/// The case of checkpoint `dir` at the rows of the PEFT logits file `logits`.
fn case_with(dir: &str, logits: &str) -> anyhow::Result<Case> {
    let st = load_st(&format!("{dir}/case.safetensors"));
    let model = Qwen2Vl::load(fixtures().join(dir).to_str().unwrap(), &Device::Cpu, DType::F32)?;
    let lo = load_st(logits);
    let rows = get(&lo, "rows").to_dtype(DType::U32)?;
    Ok(Case {
        model,
        ids: to_u32(get(&st, "input_ids")),
        pv: get(&st, "pixel_values").clone(),
        grid: grids(get(&st, "image_grid_thw")),
        rows,
    })
}

impl Case {
    /// Prompt logits at the recorded rows `(rows, V)`.
    fn logits(&self) -> anyhow::Result<Tensor> {
        Ok(self.model.forward_prompt(&self.ids, Some(&self.pv), &self.grid)?.index_select(&self.rows, 0)?)
    }
}

fn check(what: &str, got: &Tensor, want: &Tensor) {
    let (max, mean, scale) = diff(got, want);
    eprintln!("{what}: logits max abs diff {max:.3e} (mean {mean:.3e}, scale {scale:.3})");
    assert!(max <= 1e-4 * scale, "{what}: logits differ by {max} (scale {scale}); {REGENERATE_LORA}");
}

const REGENERATE_LORA: &str =
    "regenerate with `python scripts/fixtures/make_lora_fixtures.py` (needs torch, transformers, peft)";

/// A scratch copy of a fixture adapter directory that a test may break.
fn scratch(from: &str, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("askgui-lora-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(fixtures().join(from).join(f), dir.join(f)).unwrap();
    }
    dir
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("adapter_config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_string(&v).unwrap()).unwrap();
}

fn load_err(model: &mut Qwen2Vl, dir: &Path) -> String {
    match model.load_adapter("bad", dir) {
        Ok(()) => panic!("{}: a bad adapter loaded", dir.display()),
        Err(e) => {
            let msg = e.to_string();
            eprintln!("error: {msg}");
            assert!(model.adapter_names().is_empty(), "a failed load must leave the model unchanged");
            msg
        }
    }
}

#[test]
fn peft_adapters_match_peft_and_switch_per_forward() -> anyhow::Result<()> {
    let mut c = case("tiny-qwen2_5_vl")?;
    let lo = load_st("lora/peft_logits.safetensors");
    let base_case = load_st("tiny-qwen2_5_vl/case.safetensors");
    let base_want = get(&base_case, "logits").index_select(&c.rows, 0)?;
    let base = c.logits()?;

    c.model.load_adapter("all", fixtures().join(PEFT))?;
    c.model.load_adapter("qv", fixtures().join(PEFT_QV))?;
    assert_eq!(c.model.adapter_names(), ["all", "qv"]);
    assert_eq!(c.model.adapter("all").unwrap().modules.len(), 26, "14 text + 12 vision MLP modules");
    // Loading does not activate.
    assert_eq!(c.model.active_adapter(), None);
    assert_eq!(c.logits()?.to_vec2::<f32>()?, base.to_vec2::<f32>()?, "loading changed the base model");

    c.model.set_active_adapter(Some("all"))?;
    check("peft r=4 all linear targets", &c.logits()?, get(&lo, "logits"));
    c.model.set_active_adapter(Some("qv"))?;
    check("peft r=2 q/v targets", &c.logits()?, get(&lo, "logits_qv"));
    c.model.set_active_adapter(None)?;
    check("no adapter (base)", &c.logits()?, &base_want);
    assert_eq!(c.logits()?.to_vec2::<f32>()?, base.to_vec2::<f32>()?, "no adapter must be the base bit for bit");

    assert!(c.model.set_active_adapter(Some("nope")).unwrap_err().to_string().contains("no adapter named `nope`"));
    c.model.remove_adapter("qv")?;
    assert_eq!(c.model.adapter_names(), ["all"]);
    Ok(())
}

/// Qwen3-VL: PEFT adapters over the text, the vision blocks and the main and DeepStack mergers
/// (`linear_fc1/2` reach all three), and over q/v alone, give PEFT's logits; merged, the same.
#[test]
fn qwen3_peft_adapters_match_peft() -> anyhow::Result<()> {
    let logits = "lora/peft_logits_qwen3_vl.safetensors";
    let mut c = case_with("tiny-qwen3_vl", logits)?;
    let lo = load_st(logits);
    c.model.load_adapter("all", fixtures().join("lora/tiny-qwen3_vl-peft"))?;
    c.model.load_adapter("qv", fixtures().join("lora/tiny-qwen3_vl-peft-qv"))?;
    let modules = c.model.adapter("all").unwrap().modules.keys().cloned().collect::<Vec<_>>();
    assert_eq!(modules.len(), 43, "21 text + 16 vision block + 2 merger + 4 DeepStack merger modules");
    assert!(modules.iter().any(|m| m == "visual.deepstack_merger_list.1.linear_fc2"), "{modules:?}");
    c.model.set_active_adapter(Some("all"))?;
    check("qwen3 peft r=4 text, vision and merger targets", &c.logits()?, get(&lo, "logits"));
    c.model.set_active_adapter(Some("qv"))?;
    check("qwen3 peft r=2 q/v targets", &c.logits()?, get(&lo, "logits_qv"));
    c.model.merge_adapter("all")?;
    check("qwen3 peft r=4, merged", &c.logits()?, get(&lo, "logits"));
    Ok(())
}

#[test]
fn merge_equals_unmerged_and_unmerge_restores_bit_exactly() -> anyhow::Result<()> {
    let mut c = case("tiny-qwen2_5_vl")?;
    let lo = load_st("lora/peft_logits.safetensors");
    let weights = |m: &Qwen2Vl| -> Vec<(String, Vec<f32>)> {
        m.linears().iter().map(|l| (l.name.clone(), l.weight.flatten_all().unwrap().to_vec1().unwrap())).collect()
    };
    let base_w = weights(&c.model);
    let base = c.logits()?;
    c.model.load_adapter("all", fixtures().join(PEFT))?;
    c.model.load_adapter("qv", fixtures().join(PEFT_QV))?;
    c.model.set_active_adapter(Some("all"))?;
    let unmerged = c.logits()?;

    c.model.merge_adapter("all")?;
    assert_eq!(c.model.merged_adapter(), Some("all"));
    assert_ne!(weights(&c.model), base_w, "merge must change the weights");
    let merged = c.logits()?;
    check("merged vs unmerged", &merged, &unmerged);
    check("merged vs peft", &merged, get(&lo, "logits"));
    let err = c.model.set_active_adapter(Some("qv")).unwrap_err().to_string();
    assert!(err.contains("unmerge"), "{err}");
    assert!(c.model.merge_adapter("qv").unwrap_err().to_string().contains("already merged"));

    c.model.unmerge_adapter("all")?;
    assert_eq!(weights(&c.model), base_w, "unmerge must restore the base weights bit-exactly");
    assert_eq!(c.model.active_adapter(), Some("all"));
    assert_eq!(c.logits()?.to_vec2::<f32>()?, unmerged.to_vec2::<f32>()?);
    c.model.set_active_adapter(None)?;
    assert_eq!(c.logits()?.to_vec2::<f32>()?, base.to_vec2::<f32>()?, "after unmerge the base is the base");
    assert!(c.model.unmerge_adapter("all").unwrap_err().to_string().contains("not merged"));

    // For good: the same function as the unmerged adapter, and nothing of LoRA left to switch to.
    c.model.merge_and_unload("all")?;
    assert!(c.model.adapter_names().is_empty(), "every adapter is dropped");
    assert_eq!((c.model.active_adapter(), c.model.merged_adapter()), (None, None));
    assert!(c.model.linears().iter().all(|l| l.lora.active_delta().is_none()), "a delta is still applied");
    let unloaded = c.logits()?;
    check("merged and unloaded vs unmerged", &unloaded, &unmerged);
    check("merged and unloaded vs peft", &unloaded, get(&lo, "logits"));
    assert!(c.model.merge_and_unload("all").unwrap_err().to_string().contains("no adapter named `all`"));
    Ok(())
}

#[test]
fn save_then_load_round_trips_in_both_layouts() -> anyhow::Result<()> {
    let mut c = case("tiny-qwen2_5_vl")?;
    c.model.load_adapter("all", fixtures().join(PEFT))?;
    let out = std::env::temp_dir().join(format!("askgui-lora-{}-saved", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    c.model.save_adapter_as("all", &out, AdapterLayout::Hub)?;

    let saved = candle_core::safetensors::load(out.join("adapter_model.safetensors"), &Device::Cpu)?;
    assert_eq!(saved.len(), 52);
    for k in saved.keys() {
        assert!(
            k.starts_with("base_model.model.model.layers.") || k.starts_with("base_model.model.visual.blocks."),
            "saved key `{k}` is not in the hub layout"
        );
        assert!(k.ends_with(".lora_A.weight") || k.ends_with(".lora_B.weight"), "saved key `{k}` has an adapter name");
    }
    c.model.load_adapter("again", &out)?;
    let (a, b) = (c.model.adapter("all").unwrap(), c.model.adapter("again").unwrap());
    assert_eq!(a.config, b.config, "config changed in the round trip");
    assert_eq!(a.modules.keys().collect::<Vec<_>>(), b.modules.keys().collect::<Vec<_>>());
    for (m, (a1, b1)) in &a.modules {
        let (a2, b2) = &b.modules[m];
        assert_eq!(a1.to_vec2::<f32>()?, a2.to_vec2::<f32>()?, "{m}: lora_A changed");
        assert_eq!(b1.to_vec2::<f32>()?, b2.to_vec2::<f32>()?, "{m}: lora_B changed");
    }
    c.model.set_active_adapter(Some("all"))?;
    let l1 = c.logits()?;
    c.model.set_active_adapter(Some("again"))?;
    assert_eq!(c.logits()?.to_vec2::<f32>()?, l1.to_vec2::<f32>()?);
    std::fs::remove_dir_all(&out)?;

    // Keys carrying PEFT's adapter name (`.lora_A.default.weight`) read the same.
    let named = scratch(PEFT, "named");
    let st = candle_core::safetensors::load(named.join("adapter_model.safetensors"), &Device::Cpu)?;
    let st: std::collections::HashMap<String, Tensor> = st
        .into_iter()
        .map(|(k, t)| {
            (
                k.replace(".lora_A.weight", ".lora_A.default.weight")
                    .replace(".lora_B.weight", ".lora_B.default.weight"),
                t,
            )
        })
        .collect();
    candle_core::safetensors::save(&st, named.join("adapter_model.safetensors"))?;
    c.model.load_adapter("named", &named)?;
    for (m, (a1, b1)) in &c.model.adapter("all").unwrap().modules {
        let (a2, b2) = &c.model.adapter("named").unwrap().modules[m];
        assert_eq!((a1.to_vec2::<f32>()?, b1.to_vec2::<f32>()?), (a2.to_vec2::<f32>()?, b2.to_vec2::<f32>()?), "{m}");
    }
    std::fs::remove_dir_all(&named)?;

    // The default layout is the transformers 5 one: exactly the tensors PEFT wrote (PEFT on transformers 5
    // reads only that layout), with a model card that says so.
    c.model.save_adapter("all", &out)?;
    let card = std::fs::read_to_string(out.join("README.md"))?;
    assert!(card.contains("askgui_key_layout: transformers5\n"), "{card}");
    let ours = candle_core::safetensors::load(out.join("adapter_model.safetensors"), &Device::Cpu)?;
    let peft = candle_core::safetensors::load(fixtures().join(PEFT).join("adapter_model.safetensors"), &Device::Cpu)?;
    let mut keys: Vec<&String> = ours.keys().collect();
    keys.sort();
    let mut want: Vec<&String> = peft.keys().collect();
    want.sort();
    assert_eq!(keys, want, "transformers 5 layout keys differ from PEFT's");
    for (k, t) in &ours {
        assert_eq!(t.to_vec2::<f32>()?, peft[k].to_vec2::<f32>()?, "{k} differs from PEFT's");
    }
    std::fs::remove_dir_all(&out)?;
    Ok(())
}

/// The linears a LoRA can target, listed from config.json alone (what `convert-adapter` checks an adapter
/// against), are the loaded model's, names and shapes, in both architectures.
#[test]
fn linear_shapes_from_the_config_are_the_models() -> anyhow::Result<()> {
    for dir in ["tiny-qwen2_5_vl", "tiny-qwen2_vl"] {
        let model = Qwen2Vl::load(fixtures().join(dir).to_str().unwrap(), &Device::Cpu, DType::F32)?;
        let loaded: std::collections::BTreeMap<String, (usize, usize)> =
            model.linears().iter().map(|l| Ok((l.name.clone(), l.weight.dims2()?))).collect::<anyhow::Result<_>>()?;
        let cfg = askgui_model::ModelConfig::from_file(&fixtures().join(dir).join("config.json"))?;
        assert_eq!(askgui_model::random_init::linear_shapes(&cfg), loaded, "{dir}");
    }
    Ok(())
}

#[test]
fn bad_adapters_are_clear_errors() -> anyhow::Result<()> {
    let mut c = case("tiny-qwen2_5_vl")?;
    let m = &mut c.model;

    let d = scratch(PEFT, "rank");
    edit_config(&d, |v| v["r"] = 8.into());
    let e = load_err(m, &d);
    assert!(e.contains("r = 8") && e.contains("rank 4"), "{e}");

    let d = scratch(PEFT, "target");
    edit_config(&d, |v| v["target_modules"].as_array_mut().unwrap().push("c_attn".into()));
    let e = load_err(m, &d);
    assert!(e.contains("target module `c_attn` matches no linear layer"), "{e}");

    let d = scratch(PEFT, "regex");
    edit_config(&d, |v| v["target_modules"] = ".*proj".into());
    let e = load_err(m, &d);
    assert!(e.contains("`target_modules`") && e.contains("regex"), "{e}");

    for (field, value) in [
        ("use_dora", serde_json::json!(true)),
        ("use_rslora", serde_json::json!(true)),
        ("fan_in_fan_out", serde_json::json!(true)),
        ("bias", serde_json::json!("all")),
        ("peft_type", serde_json::json!("IA3")),
        ("modules_to_save", serde_json::json!(["lm_head"])),
    ] {
        let d = scratch(PEFT, field);
        edit_config(&d, |v| v[field] = value);
        let e = load_err(m, &d);
        assert!(e.contains(&format!("`{field}`")), "{field}: {e}");
    }

    // A tensor whose shape does not fit its module: named, with both shapes.
    let d = scratch(PEFT, "shape");
    let st_path = d.join("adapter_model.safetensors");
    let mut st = candle_core::safetensors::load(&st_path, &Device::Cpu)?;
    let key = "base_model.model.model.language_model.layers.1.self_attn.q_proj.lora_A.weight";
    st.insert(key.into(), Tensor::zeros((4, 65), DType::F32, &Device::Cpu)?);
    candle_core::safetensors::save(&st, &st_path)?;
    let err = m.load_adapter("bad", &d).unwrap_err();
    eprintln!("error: {err}");
    assert!(matches!(err, ModelError::AdapterShape { .. }), "{err:?}");
    let e = err.to_string();
    assert!(
        e.contains("model.layers.1.self_attn.q_proj.lora_A.weight") && e.contains("[4, 65]") && e.contains("[4, 64]"),
        "{e}"
    );

    // Missing files.
    let d = scratch(PEFT, "nofile");
    std::fs::remove_file(d.join("adapter_model.safetensors"))?;
    assert!(load_err(m, &d).contains("adapter_model.safetensors is missing"));
    std::fs::remove_file(d.join("adapter_config.json"))?;
    assert!(load_err(m, &d).contains("adapter_config.json"));
    assert!(load_err(m, &d.join("absent")).contains("not a directory"));

    // An adapter for another architecture: the Qwen2.5-VL adapter wraps the vision SwiGLU MLP, which
    // Qwen2-VL (fc1/fc2) does not have.
    let mut other = Qwen2Vl::load(fixtures().join("tiny-qwen2_vl").to_str().unwrap(), &Device::Cpu, DType::F32)?;
    let e = load_err(&mut other, &fixtures().join(PEFT));
    assert!(e.contains("visual.blocks.") && e.contains("does not have"), "{e}");

    for tag in ["rank", "target", "regex", "shape", "nofile"].into_iter().chain([
        "use_dora",
        "use_rslora",
        "fan_in_fan_out",
        "bias",
        "peft_type",
        "modules_to_save",
    ]) {
        let _ = std::fs::remove_dir_all(std::env::temp_dir().join(format!("askgui-lora-{}-{tag}", std::process::id())));
    }
    Ok(())
}
