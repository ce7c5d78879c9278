//! `Qwen2Vl::quantize_int8` on the tiny Qwen2.5-VL fixture's image prompt (all 36 linears of the vision
//! tower and the decoder): the int8 model computes exactly the model whose weights are the dequantised
//! int8 values, and its logits stay close to f32's.
//! Run: `cargo test -p askgui-model --test int8 -- --nocapture` (prints the measured differences).

mod common;

use askgui_kernels::ops::dequantize_int8;
use askgui_model::Qwen2Vl;
use candle_core::{DType, Device, Tensor};
use common::*;

fn model() -> Qwen2Vl {
    Qwen2Vl::load(fixtures().join("tiny-qwen2_5_vl").to_str().unwrap(), &Device::Cpu, DType::F32).unwrap()
}

/// The fixture's image prompt: ids, pixel values, grids.
fn prompt() -> (Vec<u32>, Tensor, Vec<[usize; 3]>) {
    let st = load_st("tiny-qwen2_5_vl/case.safetensors");
    (to_u32(get(&st, "input_ids")), get(&st, "pixel_values").clone(), grids(get(&st, "image_grid_thw")))
}

/// Tolerances:
/// - against the dequantised model: 1e-4 of the largest logit. Both compute `x (q * s)^T` in f32 with
///   the same values; only the summation order differs (panels against one matmul).
/// - against f32: 5% of the largest logit. Each weight moves by at most half its row's step
///   (`max |w_row| / 254`), about 0.2% of the row's scale on average with independent signs, and the
///   error of 36 linears in a chain adds up; a wrong scale or offset is off by 50% or more.
#[test]
fn int8_logits_are_the_dequantised_models_and_close_to_f32() {
    let (ids, pv, g) = prompt();
    let f32_logits = model().forward_prompt(&ids, Some(&pv), &g).unwrap();

    let mut int8 = model();
    assert_eq!(int8.quantize_int8().unwrap(), 36);
    let int8_logits = int8.forward_prompt(&ids, Some(&pv), &g).unwrap();

    // The same model with every weight replaced by its dequantised f32 value, through the f32 path.
    let mut deq = model();
    for (l, q) in deq.linears_mut().into_iter().zip(int8.linears()) {
        l.weight = dequantize_int8(&q.weight, q.scales.as_ref().unwrap()).unwrap();
    }
    let deq_logits = deq.forward_prompt(&ids, Some(&pv), &g).unwrap();

    let (exact, _, scale) = diff(&int8_logits, &deq_logits);
    let (max, mean, _) = diff(&int8_logits, &f32_logits);
    eprintln!(
        "int8 vs dequantised: max {exact:.2e}; int8 vs f32: max {max:.4} mean {mean:.4} (largest |logit| {scale:.3})"
    );
    assert!(exact <= 1e-4 * scale, "int8 path vs dequantised weights: {exact} of {scale}");
    assert!(max <= 0.05 * scale, "int8 vs f32: {max} of {scale}");
    let argmax = |t: &Tensor| t.argmax(1).unwrap().to_vec1::<u32>().unwrap();
    let (a, b) = (argmax(&int8_logits), argmax(&f32_logits));
    let agree = a.iter().zip(&b).filter(|(x, y)| x == y).count();
    eprintln!("next-token argmax agrees at {agree} of {} positions", a.len());
}

/// The training forward refuses int8 weights with a message that says what to do.
#[test]
fn training_an_int8_model_is_refused() {
    let mut m = model();
    m.quantize_int8().unwrap();
    m.add_trainable_adapter("t", askgui_model::LoraConfig::new(2, 4.0, &["q_proj"]), 1).unwrap();
    let (ids, pv, g) = prompt();
    let example = askgui_model::TrainExample {
        labels_mask: ids.iter().map(|_| true).collect(),
        ids,
        pixel_values: Some(pv),
        grid_thw: g,
        region_targets: vec![],
    };
    let Err(e) = m.loss_and_grads(&[example], &Default::default()) else { panic!("an int8 model trained") };
    let message = e.to_string();
    assert!(message.contains("int8 weights are for inference"), "{message}");
}
