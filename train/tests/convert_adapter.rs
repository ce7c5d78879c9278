//! `askgui-train convert-adapter` on a small generated adapter for the tiny Qwen2.5-VL fixture (text and
//! vision linears, f32 and bf16 tensors, an adapter name in the keys as older PEFT wrote them) and on
//! PEFT's own fixture adapter: hub -> transformers5 -> hub gives the tensors back byte for byte, each step
//! writes the layout asked for and a model card that says it, the config keeps every field; an adapter
//! that does not fit the base model is refused with the module named.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use askgui_model::random_init::linear_shapes;
use askgui_model::ModelConfig;
use askgui_train::config::AdapterKeys;
use askgui_train::convert_adapter::{convert, run_cli, ConvertArgs};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures")
}

fn base() -> PathBuf {
    fixtures().join("tiny-qwen2_5_vl")
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("askgui-convert-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The hub layout as PEFT on transformers 4 wrote it, spelled out here rather than taken from the code
/// under test: `base_model.model.<module>.lora_X.<adapter name>.weight`, modules `model.layers.N...` and
/// `visual.blocks.N...`.
fn hub_key(module: &str, half: &str) -> String {
    format!("base_model.model.{module}.{half}.default.weight")
}

/// A rank-3 adapter on q_proj, v_proj, qkv and gate_proj (text and vision MLP) of the tiny fixture, seeded
/// values, A in f32 and B in bf16, saved in the hub layout with extra PEFT config fields.
fn hub_adapter(dir: &Path) {
    let cfg = ModelConfig::from_file(&base().join("config.json")).unwrap();
    let targets = ["q_proj", "v_proj", "qkv", "gate_proj"];
    let r = 3;
    let mut tensors = HashMap::new();
    let mut state = 7u64;
    // A small linear congruential generator: seeded values in [-1, 1).
    let mut values = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    };
    for (module, (out, inp)) in linear_shapes(&cfg) {
        if !targets.iter().any(|t| module.ends_with(&format!(".{t}"))) {
            continue;
        }
        let a = Tensor::from_vec(values(r * inp), (r, inp), &Device::Cpu).unwrap();
        let b = Tensor::from_vec(values(out * r), (out, r), &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();
        tensors.insert(hub_key(&module, "lora_A"), a);
        tensors.insert(hub_key(&module, "lora_B"), b);
    }
    assert!(
        tensors.keys().any(|k: &String| k.contains(".visual.blocks."))
            && tensors.keys().any(|k| k.contains(".layers."))
    );
    std::fs::create_dir_all(dir).unwrap();
    candle_core::safetensors::save(&tensors, dir.join("adapter_model.safetensors")).unwrap();
    let config = serde_json::json!({
        "peft_type": "LORA", "r": r, "lora_alpha": 6, "lora_dropout": 0.05, "target_modules": targets,
        "base_model_name_or_path": base().display().to_string(), "task_type": "CAUSAL_LM", "bias": "none",
        "inference_mode": true, "revision": null, "peft_version": "0.6.2"
    });
    std::fs::write(dir.join("adapter_config.json"), serde_json::to_string_pretty(&config).unwrap()).unwrap();
    std::fs::write(dir.join("askgui.json"), "{\"version\": 1}\n").unwrap();
}

/// Every tensor of an adapter file: key -> (dtype, shape, raw bytes).
type Raw = BTreeMap<String, (String, Vec<usize>, Vec<u8>)>;

fn raw_tensors(dir: &Path) -> Raw {
    // SAFETY: read-only map of a file this test wrote and nobody changes.
    let st = unsafe { MmapedSafetensors::new(dir.join("adapter_model.safetensors")) }.unwrap();
    st.tensors()
        .into_iter()
        .map(|(k, v)| (k, (format!("{:?}", v.dtype()), v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

fn card_layout(dir: &Path) -> String {
    let card = std::fs::read_to_string(dir.join("README.md")).unwrap();
    let line = card.lines().find(|l| l.starts_with("askgui_key_layout:")).expect("the card records the layout");
    line["askgui_key_layout:".len()..].trim().to_string()
}

fn args(input: &Path, out: &Path, to: AdapterKeys) -> ConvertArgs {
    ConvertArgs { input: input.into(), out: out.into(), to, model: None }
}

/// `base_model.model.<module>.lora_X.weight` -> module, for comparing keys across layouts.
fn module_of(key: &str) -> &str {
    let m = key.strip_prefix("base_model.model.").unwrap();
    &m[..m.find(".lora_").unwrap()]
}

#[test]
fn hub_to_transformers5_to_hub_keeps_every_tensor_byte_for_byte() {
    let dir = scratch("round-trip");
    let hub = dir.join("hub");
    hub_adapter(&hub);
    let original = raw_tensors(&hub);

    let t5 = dir.join("t5");
    let s = convert(&args(&hub, &t5, AdapterKeys::Transformers5)).unwrap();
    assert_eq!(s.conversion.modules * 2, original.len());
    assert_eq!(s.conversion.from.map(|l| l.name()), Some("hub"));
    let mid = raw_tensors(&t5);
    // transformers 5 names: the decoder under model.language_model, the vision tower under model.visual.
    for k in mid.keys() {
        assert!(
            k.starts_with("base_model.model.model.language_model.layers.")
                || k.starts_with("base_model.model.model.visual.blocks."),
            "{k} is not in the transformers 5 layout"
        );
        assert!(k.ends_with(".lora_A.weight") || k.ends_with(".lora_B.weight"), "{k}");
    }
    let renamed = |k: &str| {
        let m = module_of(k);
        let m = match m.strip_prefix("visual.") {
            Some(r) => format!("model.visual.{r}"),
            None => format!("model.language_model.{}", m.strip_prefix("model.").unwrap()),
        };
        format!("base_model.model.{m}{}", &k[k.find(".lora_").unwrap()..].replace(".default", ""))
    };
    for (k, v) in &original {
        assert_eq!(mid.get(&renamed(k)), Some(v), "{k} did not arrive unchanged as {}", renamed(k));
    }
    assert_eq!(card_layout(&t5), "transformers5");
    assert_eq!(std::fs::read(t5.join("askgui.json")).unwrap(), std::fs::read(hub.join("askgui.json")).unwrap());

    let back = dir.join("back");
    convert(&args(&t5, &back, AdapterKeys::Hub)).unwrap();
    let round: Raw = original.into_iter().map(|(k, v)| (k.replace(".default.weight", ".weight"), v)).collect();
    assert_eq!(raw_tensors(&back), round, "hub -> transformers5 -> hub changed a tensor");
    assert_eq!(card_layout(&back), "hub");

    // The config keeps every field, the ones askgui ignores included.
    let json = |d: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(d.join("adapter_config.json")).unwrap()).unwrap()
    };
    assert_eq!(json(&back), json(&hub));
}

#[test]
fn peft_written_adapter_round_trips_and_full_target_names_follow_the_layout() {
    let dir = scratch("peft");
    let peft = dir.join("peft");
    std::fs::create_dir_all(&peft).unwrap();
    let fixture = fixtures().join("lora/tiny-qwen2_5_vl-peft");
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(fixture.join(f), peft.join(f)).unwrap();
    }
    // A target given as a full module name must name the module in the layout it is written for.
    let p = peft.join("adapter_config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    cfg["target_modules"].as_array_mut().unwrap().push("model.language_model.layers.0.self_attn.q_proj".into());
    std::fs::write(&p, serde_json::to_string(&cfg).unwrap()).unwrap();

    let model = base().display().to_string();
    let hub = dir.join("hub");
    let (i, o) = (peft.display().to_string(), hub.display().to_string());
    let s = run_cli(["convert-adapter", "--in", &i, "--out", &o, "--to", "hub", "--model", &model]).unwrap();
    assert_eq!(s.conversion.from.map(|l| l.name()), Some("transformers5"));
    let targets = |d: &Path| -> Vec<String> {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("adapter_config.json")).unwrap()).unwrap();
        serde_json::from_value(v["target_modules"].clone()).unwrap()
    };
    assert!(targets(&hub).contains(&"model.layers.0.self_attn.q_proj".to_string()), "{:?}", targets(&hub));

    let back = dir.join("back");
    convert(&ConvertArgs { model: Some(model), ..args(&hub, &back, AdapterKeys::Transformers5) }).unwrap();
    assert_eq!(raw_tensors(&back), raw_tensors(&peft), "PEFT's adapter changed in the round trip");
    assert_eq!(targets(&back), targets(&peft));
}

#[test]
fn an_adapter_that_does_not_fit_the_base_is_refused_with_the_module_named() {
    let dir = scratch("refused");
    let hub = dir.join("hub");
    hub_adapter(&hub);

    // Qwen2-VL's tiny vision tower has fewer blocks and an fc1/fc2 MLP: vision modules of the adapter are
    // not there (which one is named first depends on the file's order).
    let qwen2 = fixtures().join("tiny-qwen2_vl").display().to_string();
    let out = dir.join("o1");
    let e = convert(&ConvertArgs { model: Some(qwen2), ..args(&hub, &out, AdapterKeys::Transformers5) })
        .unwrap_err()
        .to_string();
    assert!(e.contains("is for module `visual.blocks.") && e.contains("which this Qwen2Vl model does not have"), "{e}");
    assert!(!out.exists(), "a refused conversion writes nothing");

    // Without --model the adapter's base_model_name_or_path is used; when it is nowhere, the error says
    // to pass --model.
    let p = hub.join("adapter_config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    cfg["base_model_name_or_path"] = "/nonexistent/base".into();
    std::fs::write(&p, serde_json::to_string(&cfg).unwrap()).unwrap();
    std::env::set_var("HF_HUB_OFFLINE", "1");
    let e = convert(&args(&hub, &out, AdapterKeys::Transformers5)).unwrap_err().to_string();
    assert!(e.contains("/nonexistent/base") && e.contains("--model"), "{e}");

    let busy = dir.join("busy");
    std::fs::create_dir_all(&busy).unwrap();
    std::fs::write(busy.join("keep.txt"), "x").unwrap();
    let with_base =
        |out: &Path| ConvertArgs { model: Some(base().display().to_string()), ..args(&hub, out, AdapterKeys::Hub) };
    let e = convert(&with_base(&busy)).unwrap_err().to_string();
    assert!(e.contains("--out") && e.contains("already exists"), "{e}");

    let e = run_cli(["convert-adapter", "--in", "x", "--out", "y"]).unwrap_err().to_string();
    assert!(e.contains("--to"), "{e}");
}
