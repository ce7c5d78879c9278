//! `askgui-train merge` on the tiny random Qwen2.5-VL fixture and PEFT's fixture adapter (rank 4 on every
//! text and vision linear): the merged checkpoint, loaded as a plain model, gives the logits of base +
//! adapter unmerged; it holds exactly the base's tensor names (hub layout) and side files; bad input is
//! refused with a message that says what to fix.
//!
//! Tolerance: merged vs unmerged logits at 1e-5 of the largest logit magnitude. Both run in f32; folding
//! `scale * B A` into `W` only changes the summation order (`x (W + sBA)^T` against `x W^T + s (x A^T) B^T`),
//! a relative error of a few f32 ulps (~1e-7) per layer over six layers, while a wrong scale, a transposed
//! or missing module moves logits by 1e-2 of their magnitude or more.

use std::path::{Path, PathBuf};

use askgui_model::Qwen2Vl;
use askgui_train::merge::{merge, run_cli, MergeArgs};
use candle_core::{DType, Device, Tensor};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures")
}

fn base() -> PathBuf {
    fixtures().join("tiny-qwen2_5_vl")
}

fn adapter() -> PathBuf {
    fixtures().join("lora/tiny-qwen2_5_vl-peft")
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("askgui-merge-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Prompt logits `(T, V)` of the fixture's test case (text and one image), so vision linears count too.
fn logits(model: &Qwen2Vl) -> Tensor {
    let st = candle_core::safetensors::load(base().join("case.safetensors"), &Device::Cpu).unwrap();
    let ids: Vec<u32> = st["input_ids"].flatten_all().unwrap().to_dtype(DType::U32).unwrap().to_vec1().unwrap();
    let g: Vec<u32> = st["image_grid_thw"].flatten_all().unwrap().to_dtype(DType::U32).unwrap().to_vec1().unwrap();
    let grid: Vec<[usize; 3]> = g.chunks(3).map(|c| [c[0] as usize, c[1] as usize, c[2] as usize]).collect();
    model.forward_prompt(&ids, Some(&st["pixel_values"]), &grid).unwrap()
}

fn max_abs(t: &Tensor) -> f64 {
    t.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap() as f64
}

fn tensor_names(path: &Path) -> Vec<String> {
    let mut names: Vec<String> = candle_core::safetensors::load(path, &Device::Cpu).unwrap().into_keys().collect();
    names.sort();
    names
}

#[test]
fn merged_checkpoint_gives_the_logits_of_base_plus_adapter() {
    let dir = scratch("ok");
    let out = dir.join("merged");
    let s = merge(&MergeArgs { model: base().display().to_string(), adapter: adapter(), out: out.clone() }).unwrap();
    assert_eq!(s.out, out);
    // 2 decoder layers x 7 linears + 4 vision blocks x 3 MLP linears (the adapter's targets).
    assert_eq!(s.merged_modules, 26);
    assert!(s.passed_through.is_empty(), "{:?}", s.passed_through);

    // Same tensor names as the base (hub layout), same side files.
    assert_eq!(tensor_names(&out.join("model.safetensors")), tensor_names(&base().join("model.safetensors")));
    for f in ["config.json", "generation_config.json", "preprocessor_config.json", "tokenizer.json"] {
        assert_eq!(std::fs::read(out.join(f)).unwrap(), std::fs::read(base().join(f)).unwrap(), "{f}");
    }
    assert!(!out.join("adapter_config.json").exists() && !out.join("case.json").exists());

    let dev = Device::Cpu;
    let mut unmerged = Qwen2Vl::load(base().to_str().unwrap(), &dev, DType::F32).unwrap();
    let plain = logits(&unmerged);
    unmerged.load_adapter("a", adapter()).unwrap();
    unmerged.set_active_adapter(Some("a")).unwrap();
    let want = logits(&unmerged);
    let merged = Qwen2Vl::load(out.to_str().unwrap(), &dev, DType::F32).unwrap();
    let got = logits(&merged);
    let scale = max_abs(&want);
    let diff = max_abs(&(&got - &want).unwrap());
    let adapter_effect = max_abs(&(&want - &plain).unwrap());
    eprintln!(
        "merged vs unmerged: max abs diff {diff:.3e}, logit scale {scale:.3}, adapter effect {adapter_effect:.3e}"
    );
    assert!(adapter_effect > 1e-2 * scale, "the adapter must change the logits for this test to mean anything");
    assert!(diff <= 1e-5 * scale, "merged logits differ by {diff} (scale {scale})");
}

#[test]
fn bad_input_is_refused_with_what_to_fix() {
    let dir = scratch("bad");
    let args = |adapter: PathBuf, out: PathBuf| MergeArgs { model: base().display().to_string(), adapter, out };

    let e = merge(&args(dir.join("nope"), dir.join("o1"))).unwrap_err().to_string();
    assert!(e.contains("--adapter") && e.contains("no such folder"), "{e}");

    let busy = dir.join("busy");
    std::fs::create_dir_all(&busy).unwrap();
    std::fs::write(busy.join("keep.txt"), "x").unwrap();
    let e = merge(&args(adapter(), busy.clone())).unwrap_err().to_string();
    assert!(e.contains("--out") && e.contains("already exists"), "{e}");
    assert_eq!(std::fs::read_to_string(busy.join("keep.txt")).unwrap(), "x", "nothing is overwritten");

    // PEFT's Qwen2.5-VL adapter targets vision MLP linears (gate/up/down) that Qwen2-VL does not have.
    let other = MergeArgs {
        model: fixtures().join("tiny-qwen2_vl").display().to_string(),
        adapter: adapter(),
        out: dir.join("o2"),
    };
    let e = merge(&other).unwrap_err().to_string();
    assert!(e.contains("does not have") && e.contains("another architecture or size"), "{e}");
    assert!(!dir.join("o2").exists(), "a failed merge writes nothing");

    // The command line names the flags it needs; an empty existing folder is fine.
    let e = run_cli(["merge", "--model", "m"]).unwrap_err().to_string();
    assert!(e.contains("--adapter") && e.contains("--out"), "{e}");
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let (m, a, o) = (base().display().to_string(), adapter().display().to_string(), empty.display().to_string());
    run_cli(["merge", "--model", &m, "--adapter", &a, "--out", &o]).unwrap();
    assert!(empty.join("model.safetensors").is_file());
    // askgui-serve's NAME=DIR is taken too; the name is not needed to merge.
    let named =
        <MergeArgs as clap::Parser>::try_parse_from(["merge", "--model", "m", "--adapter", "ask=a/x", "--out", "o"]);
    assert_eq!(named.unwrap().adapter, PathBuf::from("a/x"));
}
