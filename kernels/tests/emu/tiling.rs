//! The tiling plan (`cuda/tiling.cu`) against the CPU reference `tile_batch_reference`: bit-exact in f32
//! (integer filters with the CPU's rounding, IEEE division), and bf16 equal to the f32 values rounded to
//! nearest even, for a batch of images of different sizes and aspect ratios in one launch pair.

use crate::common::tol::{compare, EXACT};
use crate::{from_bytes, rounded, run, Failures, ORDERS};
use askgui_kernels::plan::tiling::plan;
use askgui_kernels::plan::{Caps, Elem};
use askgui_kernels::tiling::{tile_batch_reference, BatchPlan, ImageRef, TilingConfig};

#[test]
fn tiling_batch_bit_exact() {
    let sizes = [(97, 61), (56, 56), (300, 41), (28, 200), (640, 480)];
    let images: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(k, &(w, h))| (0..w * h * 3).map(|i| ((i * 31 + k * 17 + (i / (3 * w)) * 7) % 256) as u8).collect())
        .collect();
    let refs: Vec<ImageRef> =
        images.iter().zip(&sizes).map(|(rgb, &(width, height))| ImageRef { rgb, width, height }).collect();
    let cfg = TilingConfig::with_pixels(56 * 56, 28 * 28 * 160);
    let (want, grids) = tile_batch_reference(&refs, &cfg).unwrap();
    let want: Vec<f64> = want.into_iter().map(f64::from).collect();
    let lens: Vec<usize> = images.iter().map(|i| i.len()).collect();
    let bp = BatchPlan::new(&sizes, Some(&lens), &cfg).unwrap();
    assert_eq!(bp.grid_thw, grids, "the plan's grids are the reference's");
    let input = vec![images.concat()];
    let mut f = Failures::default();
    for (n, elem) in [Elem::F32, Elem::Bf16].into_iter().enumerate() {
        let got = from_bytes(&run(&plan(&bp, elem).unwrap(), &input, Caps::SM86, ORDERS[n])[0], elem);
        f.check(compare(&format!("tiling {elem:?}"), &[bp.rows, bp.patch_dim], &got, &rounded(&want, elem), EXACT));
    }
    f.finish("tiling_batch_bit_exact");
}
