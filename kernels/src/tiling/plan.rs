//! Batched tiling: the configuration, the CPU batch reference, and the host-side plan of the CUDA path.
//!
//! [`tile_batch_reference`] is the CPU path over a batch (per image: `smart_resize`, the antialiased bicubic
//! resize, normalise + patchify, rows concatenated in batch order, `grid_thw = [1, gh, gw]`), the spec of
//! the CUDA twin.
//!
//! [`BatchPlan`] is everything the CUDA kernels need that is cheap to compute on the host: the target size
//! of each image, the int16 fixed-point filter taps of both passes (computed by the very same `taps`
//! function as the CPU reference, so the integer arithmetic on the device is identical and the resized
//! pixels are bit-exact), and one descriptor row per image (offsets into the concatenated input, the
//! intermediate and the output). Validation happens here, in the CPU path's order, so both paths return
//! the same errors. A CPU replay of the kernels' index arithmetic over the plan (tests below) checks the
//! tables against the reference without a GPU.

use super::{
    normalize_patchify_reference, resize_bicubic_reference, scaled_mean_std, smart_resize, taps, PatchGeometry,
    TilingError, CLIP_MEAN, CLIP_STD,
};

/// Preprocessing settings of the tiling path (transformers' `Qwen2VLImageProcessor` class defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TilingConfig {
    pub min_pixels: usize,
    pub max_pixels: usize,
    pub geometry: PatchGeometry,
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

impl Default for TilingConfig {
    fn default() -> Self {
        Self {
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 1280,
            geometry: PatchGeometry::default(),
            mean: CLIP_MEAN,
            std: CLIP_STD,
        }
    }
}

impl TilingConfig {
    /// The defaults with other pixel bounds.
    pub fn with_pixels(min_pixels: usize, max_pixels: usize) -> Self {
        Self { min_pixels, max_pixels, ..Self::default() }
    }

    fn check(&self) -> Result<(), TilingError> {
        let g = self.geometry;
        if g.patch_size == 0 || g.merge_size == 0 || g.temporal_patch_size == 0 {
            return Err(TilingError::Geometry(g));
        }
        Ok(())
    }
}

/// An interleaved RGB8 image in host memory, row-major, `width * height * 3` bytes.
#[derive(Debug, Clone, Copy)]
pub struct ImageRef<'a> {
    pub rgb: &'a [u8],
    pub width: usize,
    pub height: usize,
}

fn in_batch(index: usize) -> impl Fn(TilingError) -> TilingError {
    move |e| TilingError::InBatch { index, source: Box::new(e) }
}

/// The CPU path over a batch: `pixel_values (sum of gh*gw, patch_dim)` f32 row-major, and each image's
/// `grid_thw`. Errors name the image's index in the batch.
pub fn tile_batch_reference(
    images: &[ImageRef],
    cfg: &TilingConfig,
) -> Result<(Vec<f32>, Vec<[usize; 3]>), TilingError> {
    if images.is_empty() {
        return Err(TilingError::EmptyBatch);
    }
    cfg.check()?;
    let mut values = Vec::new();
    let mut grids = Vec::with_capacity(images.len());
    for (i, img) in images.iter().enumerate() {
        let e = in_batch(i);
        let (w, h) = (img.width, img.height);
        let (nh, nw) = smart_resize(h, w, cfg.geometry.factor(), cfg.min_pixels, cfg.max_pixels).map_err(&e)?;
        let resized = resize_bicubic_reference(img.rgb, w, h, nw, nh).map_err(&e)?;
        let (pv, (gh, gw)) =
            normalize_patchify_reference(&resized, nw, nh, cfg.geometry, cfg.mean, cfg.std).map_err(&e)?;
        values.extend_from_slice(&pv);
        grids.push([1, gh, gw]);
    }
    Ok((values, grids))
}

/// Field indices of a descriptor row (`D_FIELDS` i64 per image). `cuda/tiling.cu` has the same `#define`s.
pub(crate) mod desc {
    /// Byte offset of the image in the concatenated input.
    pub const SRC: usize = 0;
    pub const W: usize = 1;
    pub const H: usize = 2;
    pub const NW: usize = 3;
    pub const NH: usize = 4;
    /// Byte offset of the image's horizontally resized `h x nw x 3` intermediate.
    pub const INTER: usize = 5;
    /// Index of the first (start, count, weight offset) triple of the horizontal / vertical taps.
    pub const HTAPS: usize = 6;
    pub const VTAPS: usize = 7;
    pub const HPREC: usize = 8;
    pub const HROUND: usize = 9;
    pub const VPREC: usize = 10;
    pub const VROUND: usize = 11;
    /// First `pixel_values` row of the image.
    pub const ROW: usize = 12;
    pub const GH: usize = 13;
    pub const GW: usize = 14;
    pub const FIELDS: usize = 15;
}

/// Original and target size of one image of a plan.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlannedImage {
    pub width: usize,
    pub height: usize,
    pub new_width: usize,
    pub new_height: usize,
}

/// Host-side tables of one batch for the CUDA kernels (see the module header).
#[derive(Debug, Clone)]
pub struct BatchPlan {
    pub images: Vec<PlannedImage>,
    pub grid_thw: Vec<[usize; 3]>,
    /// `FIELDS` i64 per image, see [`desc`].
    pub(crate) desc: Vec<i64>,
    /// (first input index, tap count, offset into `weights`) per output column (horizontal pass) and per
    /// output row (vertical pass) of every image.
    pub(crate) taps: Vec<i32>,
    /// int16 fixed-point weights, stored as i32.
    pub(crate) weights: Vec<i32>,
    /// Bytes of the concatenated input / of all intermediates.
    pub input_len: usize,
    pub inter_len: usize,
    /// Rows of `pixel_values` and their length.
    pub rows: usize,
    pub patch_dim: usize,
    pub geometry: PatchGeometry,
    /// Mean and std times 255, in f32, as the CPU reference normalises: a level `v` becomes
    /// `(v as f32 - mean255[c]) / std255[c]`.
    pub mean255: [f32; 3],
    pub std255: [f32; 3],
    /// Largest per-image work of the horizontal pass (output pixels) and of the fused vertical pass
    /// (output values before the temporal copy), to size the launch grids.
    pub(crate) max_h_work: usize,
    pub(crate) max_v_work: usize,
}

impl BatchPlan {
    /// Plans a batch of `(width, height)` images. With `rgb_lens`, each image's buffer length is checked
    /// where the CPU path checks it (after `smart_resize`), so both paths fail with the same error.
    pub fn new(sizes: &[(usize, usize)], rgb_lens: Option<&[usize]>, cfg: &TilingConfig) -> Result<Self, TilingError> {
        if sizes.is_empty() {
            return Err(TilingError::EmptyBatch);
        }
        cfg.check()?;
        let geo = cfg.geometry;
        let (mean255, std255) = scaled_mean_std(cfg.mean, cfg.std);
        let mut plan = BatchPlan {
            images: Vec::with_capacity(sizes.len()),
            grid_thw: Vec::with_capacity(sizes.len()),
            desc: Vec::with_capacity(sizes.len() * desc::FIELDS),
            taps: Vec::new(),
            weights: Vec::new(),
            input_len: 0,
            inter_len: 0,
            rows: 0,
            patch_dim: geo.patch_dim(),
            geometry: geo,
            mean255,
            std255,
            max_h_work: 0,
            max_v_work: 0,
        };
        for (i, &(w, h)) in sizes.iter().enumerate() {
            let e = in_batch(i);
            let (nh, nw) = smart_resize(h, w, geo.factor(), cfg.min_pixels, cfg.max_pixels).map_err(&e)?;
            if let Some(lens) = rgb_lens {
                let want = w * h * 3;
                if lens[i] != want {
                    return Err(e(TilingError::Buffer { got: lens[i], want, width: w, height: h }));
                }
            }
            if nw == 0 || nh == 0 {
                // As `resize_bicubic_reference` reports it.
                return Err(e(TilingError::Empty { width: nw.min(w), height: nh.min(h) }));
            }
            let (gh, gw) = (nh / geo.patch_size, nw / geo.patch_size);
            let h_work = h * nw;
            let v_work = gh * gw * 3 * geo.patch_size * geo.patch_size;
            let limit = i32::MAX as usize;
            if h_work > limit || v_work * geo.temporal_patch_size > limit {
                return Err(e(TilingError::TooLarge { width: w, height: h, new_width: nw, new_height: nh }));
            }
            let htaps = plan.taps.len() / 3;
            let (hprec, hround) = plan.push_taps(w, nw);
            let vtaps = plan.taps.len() / 3;
            let (vprec, vround) = plan.push_taps(h, nh);
            let mut row = [0usize; desc::FIELDS];
            row[desc::SRC] = plan.input_len;
            (row[desc::W], row[desc::H], row[desc::NW], row[desc::NH]) = (w, h, nw, nh);
            row[desc::INTER] = plan.inter_len;
            (row[desc::HTAPS], row[desc::VTAPS]) = (htaps, vtaps);
            (row[desc::HPREC], row[desc::HROUND], row[desc::VPREC], row[desc::VROUND]) = (hprec, hround, vprec, vround);
            (row[desc::ROW], row[desc::GH], row[desc::GW]) = (plan.rows, gh, gw);
            plan.desc.extend(row.iter().map(|&x| x as i64));
            plan.input_len += w * h * 3;
            plan.inter_len += h_work * 3;
            plan.rows += gh * gw;
            plan.max_h_work = plan.max_h_work.max(h_work);
            plan.max_v_work = plan.max_v_work.max(v_work);
            plan.images.push(PlannedImage { width: w, height: h, new_width: nw, new_height: nh });
            plan.grid_thw.push([1, gh, gw]);
        }
        if plan.weights.len() > i32::MAX as usize {
            return Err(TilingError::Device(format!("{} filter weights exceed the i32 offsets", plan.weights.len())));
        }
        Ok(plan)
    }

    /// Appends the taps of one pass `n_in -> n_out`; returns its (precision, rounding constant). Where the
    /// CPU reference skips a pass (same size) the taps are the identity (one weight 1, shift 0, no
    /// rounding), which leaves every pixel as it is.
    fn push_taps(&mut self, n_in: usize, n_out: usize) -> (usize, usize) {
        if n_in == n_out {
            for i in 0..n_out {
                self.taps.extend([i as i32, 1, self.weights.len() as i32]);
                self.weights.push(1);
            }
            return (0, 0);
        }
        let t = taps(n_in, n_out);
        for (lo, w) in t.start.iter().zip(&t.weights) {
            self.taps.extend([*lo as i32, w.len() as i32, self.weights.len() as i32]);
            self.weights.extend_from_slice(w);
        }
        (t.precision as usize, t.round() as usize)
    }

    /// Number of images.
    pub fn len(&self) -> usize {
        self.images.len()
    }

    /// Always false: a plan holds at least one image.
    pub fn is_empty(&self) -> bool {
        self.images.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernels of `cuda/tiling.cu`, replayed on the CPU with the same index arithmetic over the plan.
    fn replay(plan: &BatchPlan, input: &[u8]) -> Vec<f32> {
        let geo = plan.geometry;
        let (p, m, tp) = (geo.patch_size, geo.merge_size, geo.temporal_patch_size);
        let pp = p * p;
        let dim = plan.patch_dim;
        let mut inter = vec![0u8; plan.inter_len];
        let mut out = vec![f32::NAN; plan.rows * dim];
        let clamp8 = |a: i32| a.clamp(0, 255) as u8;
        for d in plan.desc.chunks(desc::FIELDS) {
            let g = |k: usize| d[k] as usize;
            // tiling_hpass: one thread per (y, x) output pixel, three channels.
            let (w, h, nw) = (g(desc::W), g(desc::H), g(desc::NW));
            let (prec, round) = (d[desc::HPREC] as u32, d[desc::HROUND] as i32);
            for i in 0..h * nw {
                let (y, x) = (i / nw, i % nw);
                let t = &plan.taps[3 * (g(desc::HTAPS) + x)..];
                let (start, count, wo) = (t[0] as usize, t[1] as usize, t[2] as usize);
                let row = &input[g(desc::SRC) + (y * w + start) * 3..];
                for c in 0..3 {
                    let mut a = round;
                    for j in 0..count {
                        a += plan.weights[wo + j] * row[3 * j + c] as i32;
                    }
                    inter[g(desc::INTER) + i * 3 + c] = clamp8(a >> prec);
                }
            }
            // tiling_vpass_patchify: one thread per (row, channel, py, px), writing every temporal copy.
            let (gh, gw) = (g(desc::GH), g(desc::GW));
            let (prec, round) = (d[desc::VPREC] as u32, d[desc::VROUND] as i32);
            for i in 0..gh * gw * 3 * pp {
                let px = i % p;
                let e = i / p;
                let py = e % p;
                let e = e / p;
                let c = e % 3;
                let r = e / 3;
                let mw = r % m;
                let e = r / m;
                let mh = e % m;
                let e = e / m;
                let bw = e % (gw / m);
                let bh = e / (gw / m);
                let (y, x) = ((bh * m + mh) * p + py, (bw * m + mw) * p + px);
                let t = &plan.taps[3 * (g(desc::VTAPS) + y)..];
                let (start, count, wo) = (t[0] as usize, t[1] as usize, t[2] as usize);
                let mut a = round;
                for j in 0..count {
                    a += plan.weights[wo + j] * inter[g(desc::INTER) + ((start + j) * nw + x) * 3 + c] as i32;
                }
                let v = (clamp8(a >> prec) as f32 - plan.mean255[c]) / plan.std255[c];
                let base = (g(desc::ROW) + r) * dim + c * tp * pp + py * p + px;
                for k in 0..tp {
                    out[base + k * pp] = v;
                }
            }
        }
        out
    }

    fn random_image(w: usize, h: usize, seed: u64) -> Vec<u8> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..w * h * 3)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (s >> 56) as u8
            })
            .collect()
    }

    #[test]
    fn plan_replay_equals_reference_bit_for_bit() {
        // Upscales, downscales, identities on one axis, extreme aspect ratios, 1x1.
        let sizes = [(1, 1), (29, 31), (28, 56), (56, 28), (300, 2), (2, 300), (640, 37), (1024, 768), (3000, 200)];
        for cfg in [TilingConfig::with_pixels(256 * 784, 1280 * 784), TilingConfig::with_pixels(3136, 128 * 784)] {
            let imgs: Vec<Vec<u8>> =
                sizes.iter().enumerate().map(|(i, &(w, h))| random_image(w, h, i as u64)).collect();
            let refs: Vec<ImageRef> =
                sizes.iter().zip(&imgs).map(|(&(width, height), rgb)| ImageRef { rgb, width, height }).collect();
            let (want, grids) = tile_batch_reference(&refs, &cfg).unwrap();
            let lens: Vec<usize> = imgs.iter().map(|x| x.len()).collect();
            let plan = BatchPlan::new(&sizes, Some(&lens), &cfg).unwrap();
            assert_eq!(plan.grid_thw, grids);
            assert_eq!(plan.rows * plan.patch_dim, want.len());
            let got = replay(&plan, &imgs.concat());
            let bad = got.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            assert_eq!(bad, 0, "{bad} of {} values differ ({cfg:?})", want.len());
        }
    }

    #[test]
    fn identity_pass_keeps_pixels() {
        // 56x56 is already a multiple of 28 inside the bounds: both passes are the identity.
        let cfg = TilingConfig::with_pixels(3136, 1 << 20);
        let plan = BatchPlan::new(&[(56, 56)], None, &cfg).unwrap();
        assert_eq!(plan.images[0], PlannedImage { width: 56, height: 56, new_width: 56, new_height: 56 });
        assert_eq!(plan.desc[desc::HROUND], 0);
        assert!(plan.weights.iter().all(|&w| w == 1));
    }

    #[test]
    fn errors_match_the_cpu_path() {
        let cfg = TilingConfig::default();
        assert_eq!(BatchPlan::new(&[], None, &cfg).unwrap_err(), TilingError::EmptyBatch);
        assert_eq!(tile_batch_reference(&[], &cfg).unwrap_err(), TilingError::EmptyBatch);
        type Case = (Vec<(usize, usize)>, Vec<usize>);
        let cases: Vec<Case> = vec![
            (vec![(10, 10), (0, 5)], vec![300, 0]),     // zero-size image
            (vec![(10, 10), (1, 300)], vec![300, 900]), // aspect ratio over 200
            (vec![(10, 10), (10, 10)], vec![300, 299]), // short buffer
        ];
        for (sizes, lens) in cases {
            let bufs: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0u8; n]).collect();
            let refs: Vec<ImageRef> =
                sizes.iter().zip(&bufs).map(|(&(width, height), rgb)| ImageRef { rgb, width, height }).collect();
            let want = tile_batch_reference(&refs, &cfg).unwrap_err();
            assert!(matches!(want, TilingError::InBatch { index: 1, .. }), "{want}");
            assert_eq!(BatchPlan::new(&sizes, Some(&lens), &cfg).unwrap_err(), want);
        }
        let bad = TilingConfig { geometry: PatchGeometry { patch_size: 0, ..PatchGeometry::default() }, ..cfg };
        assert!(matches!(BatchPlan::new(&[(10, 10)], None, &bad), Err(TilingError::Geometry(_))));
        // min_pixels 0 lets a tiny image round to 0x0, which the resize refuses.
        let zero = TilingConfig::with_pixels(0, 1 << 20);
        let e = BatchPlan::new(&[(5, 5)], None, &zero).unwrap_err();
        let rgb = vec![0u8; 75];
        assert_eq!(e, tile_batch_reference(&[ImageRef { rgb: &rgb, width: 5, height: 5 }], &zero).unwrap_err());
    }
}
