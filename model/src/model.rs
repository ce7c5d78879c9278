//! Qwen2-VL / Qwen2.5-VL for conditional generation: the vision tower, the decoder, the LM head, and the
//! glue between them (image embeddings spliced in at `<|image_pad|>` tokens, M-RoPE position ids).

use candle_core::{DType, Device, Tensor};

use crate::chat::QwenTokenizer;
use crate::config::{Arch, ModelConfig};
use crate::device::KernelChoice;
use crate::error::{ModelError, Result};
use crate::image::{ImageProcessorConfig, ProcessedImage};
use crate::kv_cache::KvCache;
use crate::text::{NewRows, TextDecoder};
use crate::vision::VisionTower;
use crate::weights::{CheckpointFiles, Weights};

pub struct Qwen2Vl {
    pub cfg: ModelConfig,
    pub files: CheckpointFiles,
    pub vision: VisionTower,
    pub text: TextDecoder,
    /// `(V, H)`; the embedding matrix itself when the checkpoint ties them.
    pub(crate) lm_head: Tensor,
    pub image_config: ImageProcessorConfig,
    /// Stop ids: config.json's and generation_config.json's end-of-sequence ids.
    pub eos_token_ids: Vec<u32>,
    pub device: Device,
    /// LoRA adapters held by the linear layers: which are loaded, active, merged ([`crate::lora`]).
    pub(crate) lora: crate::peft::LoraState,
}

/// M-RoPE positions of one unpadded prompt: `(t, h, w)` per token, and the next text position.
///
/// Text tokens get the same running position on all three axes. The tokens of an image (a run of
/// `t * h * w / merge^2` image pads) get `start + (frame, row, column)` of their merged patch, and the text
/// after it continues at `start + max(rows, columns)` (transformers' `get_rope_index`).
pub fn mrope_positions(ids: &[u32], grid_thw: &[[usize; 3]], cfg: &ModelConfig) -> Result<(Vec<[u32; 3]>, u32)> {
    let m = cfg.vision.spatial_merge_size;
    let mut pos = Vec::with_capacity(ids.len());
    let mut grids = grid_thw.iter();
    let mut next = 0u32;
    let mut i = 0;
    while i < ids.len() {
        if ids[i] != cfg.image_token_id {
            pos.push([next; 3]);
            next += 1;
            i += 1;
            continue;
        }
        let &[t, h, w] = grids.next().ok_or_else(|| {
            ModelError::Prompt(format!("the prompt has more images than the {} given", grid_thw.len()))
        })?;
        let (gh, gw) = (h / m, w / m);
        let n = t * gh * gw;
        let run = ids[i..].iter().take_while(|&&x| x == cfg.image_token_id).count();
        if run < n {
            return Err(ModelError::Prompt(format!(
                "image {} needs {n} image tokens but the prompt has a run of {run}",
                pos.len()
            )));
        }
        for f in 0..t {
            for y in 0..gh {
                for x in 0..gw {
                    pos.push([next + f as u32, next + y as u32, next + x as u32]);
                }
            }
        }
        next += gh.max(gw) as u32;
        i += n;
    }
    if grids.next().is_some() {
        return Err(ModelError::Prompt(format!(
            "{} images were given but the prompt has fewer image placeholders",
            grid_thw.len()
        )));
    }
    Ok((pos, next))
}

impl Qwen2Vl {
    /// Loads a local directory or hub id, with askgui's kernels.
    pub fn load(model: &str, device: &Device, dtype: DType) -> Result<Self> {
        Self::load_with(model, device, dtype, KernelChoice::Askgui)
    }

    /// [`Self::load`] with the ops `kernels` (`--kernels`), for inference and training alike.
    pub fn load_with(model: &str, device: &Device, dtype: DType, kernels: KernelChoice) -> Result<Self> {
        Self::load_files_with(CheckpointFiles::resolve(model)?, device, dtype, kernels)
    }

    pub fn load_files(files: CheckpointFiles, device: &Device, dtype: DType) -> Result<Self> {
        Self::load_files_with(files, device, dtype, KernelChoice::Askgui)
    }

    /// [`Self::load_files`] with the ops `kernels`; logs the choice.
    pub fn load_files_with(
        files: CheckpointFiles,
        device: &Device,
        dtype: DType,
        kernels: KernelChoice,
    ) -> Result<Self> {
        let cfg = ModelConfig::from_file(&files.config)?;
        let weights = Weights::open(&files, dtype, device)?;
        let mut vision = VisionTower::load(&weights, &cfg.vision, cfg.arch)?;
        let mut text = TextDecoder::load(&weights, &cfg.text)?;
        (vision.kernels, text.kernels) = (kernels, kernels);
        let (v, h) = (cfg.text.vocab_size, cfg.text.hidden_size);
        let lm_head = if cfg.tie_word_embeddings {
            text.embed_tokens.clone()
        } else if weights.contains("lm_head.weight") {
            weights.get("lm_head.weight", &[v, h])?
        } else {
            return Err(ModelError::MissingTensor {
                dir: files.dir.clone(),
                name: "lm_head.weight".into(),
                tried: "`lm_head.weight` (config.json says tie_word_embeddings is false)".into(),
            });
        };
        let image_config = match &files.preprocessor {
            Some(p) => ImageProcessorConfig::from_file_over(p, ImageProcessorConfig::for_arch(cfg.arch))?,
            None => ImageProcessorConfig::for_arch(cfg.arch),
        };
        let mut eos_token_ids = cfg.eos_token_ids.clone();
        for id in files.generation_eos_ids() {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
        // The path is chosen here, once: the kernels' ops run where they have a kernel for the device and
        // dtype (`layers::has_kernel`), the plain-candle references elsewhere and with `--kernels reference`.
        tracing::info!("kernels: {}", kernels.describe());
        let kernels = match (device, dtype) {
            _ if kernels == KernelChoice::Reference => "plain-candle references (--kernels reference)",
            (Device::Cpu, DType::F32 | DType::F64 | DType::BF16) => "askgui CPU kernels (attention, norms, rope)",
            (Device::Cuda(_), DType::F32 | DType::BF16) => "askgui CUDA kernels (attention, norms, rope)",
            _ => "plain-candle references (no askgui kernel for this device and dtype)",
        };
        tracing::info!(arch = ?cfg.arch, dir = %files.dir.display(), ?dtype, ?device, kernels, "loaded model");
        Ok(Self {
            cfg,
            files,
            vision,
            text,
            lm_head,
            image_config,
            eos_token_ids,
            device: device.clone(),
            lora: Default::default(),
        })
    }

    /// Every linear layer (vision tower, then decoder), each named as in the hub checkpoint layout.
    pub fn linears(&self) -> Vec<&crate::layers::Linear> {
        let mut out = self.vision.linears();
        out.extend(self.text.linears());
        out
    }

    /// Quantises every linear of the vision tower and the decoder to int8 weight-only (per output row,
    /// [`crate::layers::Linear::quantize_int8`]); returns how many. CPU inference only: the training
    /// forward refuses int8 weights.
    pub fn quantize_int8(&mut self) -> Result<usize> {
        if !self.device.is_cpu() {
            return Err(ModelError::Device(format!(
                "int8 weights run on the CPU only; the model is on {:?}: use --dtype bf16 on a GPU",
                self.device
            )));
        }
        let linears = self.linears_mut();
        let n = linears.len();
        for l in linears {
            l.quantize_int8()?;
        }
        Ok(n)
    }

    /// [`Self::linears`], mutable (same order).
    pub fn linears_mut(&mut self) -> Vec<&mut crate::layers::Linear> {
        let mut out = self.vision.linears_mut();
        out.extend(self.text.linears_mut());
        out
    }

    pub fn arch(&self) -> Arch {
        self.cfg.arch
    }

    /// Which ops the model runs ([`KernelChoice`]), inference and training alike.
    pub fn kernels(&self) -> KernelChoice {
        self.text.kernels
    }

    /// Switches the ops of a loaded model (e.g. to compare the two paths on one model); logs the choice.
    pub fn set_kernels(&mut self, kernels: KernelChoice) {
        tracing::info!("kernels: {}", kernels.describe());
        (self.vision.kernels, self.text.kernels) = (kernels, kernels);
    }

    /// The checkpoint's tokenizer, checked against the config's image token id.
    pub fn tokenizer(&self) -> Result<QwenTokenizer> {
        let path = self.files.tokenizer.as_ref().ok_or_else(|| ModelError::Checkpoint {
            dir: self.files.dir.clone(),
            reason: "no tokenizer.json".into(),
        })?;
        QwenTokenizer::from_file(path, Some(&self.cfg))
    }

    pub fn dtype(&self) -> DType {
        self.text.dtype()
    }

    /// Vision tower output for a batch of images: `(sum of image tokens, H)`.
    pub fn image_features(&self, pixel_values: &Tensor, grid_thw: &[[usize; 3]]) -> Result<Tensor> {
        self.vision.forward(pixel_values, grid_thw)
    }

    /// [`Self::image_features`] of whole preprocessed images, image after image; on the CPU their pixels
    /// are read where they lie, not copied into one tensor first.
    pub fn images_features(&self, images: &[&ProcessedImage]) -> Result<Tensor> {
        self.vision.forward_images(images)
    }

    /// [`Self::images_features`] with each image's own LoRA adapter (`adapters[i]` for image `i`, None:
    /// the base model) in one vision forward, whatever adapter is active.
    pub fn images_features_adapters(&self, images: &[&ProcessedImage], adapters: &[Option<&str>]) -> Result<Tensor> {
        if adapters.len() != images.len() {
            return Err(ModelError::Prompt(format!("{} adapters for {} images", adapters.len(), images.len())));
        }
        let runs: Vec<(usize, Option<&str>)> =
            images.iter().zip(adapters).map(|(i, &a)| (i.grid_thw.iter().product(), a)).collect();
        self.vision.forward_images_rows(images, self.row_adapters(&runs)?)
    }

    /// Token embeddings with image features spliced in at the image tokens, in order: `(B, T, W)`, where
    /// `W` is [`ModelConfig::embed_width`]: the hidden size, and for DeepStack families the feature sets
    /// the decoder adds after its first layers, carried beside it (zeros on text rows).
    pub fn embed(&self, ids: &Tensor, image_features: Option<&Tensor>) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let text = self.text.embed(ids)?;
        let (h, width) = (self.cfg.text.hidden_size, self.cfg.embed_width());
        // (B, T, H) -> (B, T, W)
        let text = match width > h {
            true => Tensor::cat(&[&text, &Tensor::zeros((b, t, width - h), text.dtype(), text.device())?], 2)?,
            false => text,
        };
        if let Some(f) = image_features.filter(|f| f.dims().last() != Some(&width)) {
            return Err(ModelError::Prompt(format!("image features {:?} are not {width} wide", f.dims())));
        }
        let flat_ids: Vec<u32> = ids.flatten_all()?.to_vec1()?;
        let n_img = flat_ids.iter().filter(|&&x| x == self.cfg.image_token_id).count();
        let have = image_features.map(|f| f.dim(0)).transpose()?.unwrap_or(0);
        if n_img != have {
            return Err(ModelError::Prompt(format!(
                "the prompt has {n_img} image tokens but the images give {have} embeddings"
            )));
        }
        let Some(feat) = image_features.filter(|_| n_img > 0) else { return Ok(text) };
        // One gather over [text rows; image rows]: differentiable, no scatter.
        let h = width;
        let mut k = 0u32;
        let idx: Vec<u32> = flat_ids
            .iter()
            .enumerate()
            .map(|(p, &x)| {
                if x == self.cfg.image_token_id {
                    k += 1;
                    (b * t) as u32 + k - 1
                } else {
                    p as u32
                }
            })
            .collect();
        let all = Tensor::cat(&[&text.reshape((b * t, h))?, &feat.to_dtype(text.dtype())?], 0)?;
        Ok(all.index_select(&Tensor::from_vec(idx, b * t, ids.device())?, 0)?.reshape((b, t, h))?)
    }

    /// Hidden states `(B, T, H)` -> logits `(B, T, V)`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(crate::layers::matmul_t(hidden, &self.lm_head)?)
    }

    /// Runs the decoder over embeddings, appending to `cache`; see [`TextDecoder::forward`].
    pub fn decode(
        &self,
        embeds: &Tensor,
        positions: &Tensor,
        key_padding: Option<&Tensor>,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        self.text.forward(embeds, positions, key_padding, cache)
    }

    /// Several sequences' new tokens in one decoder pass, each over its own cache; see
    /// [`TextDecoder::forward_packed`].
    pub fn decode_packed(
        &self,
        embeds: &Tensor,
        positions: &Tensor,
        rows: &[NewRows],
        caches: &mut [&mut KvCache],
    ) -> Result<Tensor> {
        self.decode_packed_rows(embeds, positions, rows, caches, None)
    }

    /// [`Self::decode_packed`] with each sequence's own LoRA adapter (`adapters[i]` for sequence `i`,
    /// None: the base model), whatever adapter is active: one pass for a batch that mixes adapters
    /// ([`crate::adapter_slot::RowAdapters`]).
    pub fn decode_packed_adapters(
        &self,
        embeds: &Tensor,
        positions: &Tensor,
        (rows, adapters): (&[NewRows], &[Option<&str>]),
        caches: &mut [&mut KvCache],
    ) -> Result<Tensor> {
        if adapters.len() != rows.len() {
            return Err(ModelError::Prompt(format!(
                "packed decode: {} adapters for {} sequences",
                adapters.len(),
                rows.len()
            )));
        }
        let runs: Vec<(usize, Option<&str>)> = rows.iter().zip(adapters).map(|(r, &a)| (r.len(), a)).collect();
        let plan = self.row_adapters(&runs)?;
        self.decode_packed_rows(embeds, positions, rows, caches, Some(&plan))
    }

    fn decode_packed_rows(
        &self,
        embeds: &Tensor,
        positions: &Tensor,
        rows: &[NewRows],
        caches: &mut [&mut KvCache],
        adapters: Option<&crate::adapter_slot::RowAdapters>,
    ) -> Result<Tensor> {
        let total: usize = rows.iter().map(NewRows::len).sum();
        if rows.len() != caches.len() || total != embeds.dim(1)? {
            return Err(ModelError::Prompt(format!(
                "packed decode: {} lengths summing to {total} for {} caches and {} rows",
                rows.len(),
                caches.len(),
                embeds.dim(1)?
            )));
        }
        if let Some(forks) = rows.iter().find_map(|r| match r {
            NewRows::Forks(f) if f.is_empty() || f.contains(&0) => Some(f),
            _ => None,
        }) {
            return Err(ModelError::Prompt(format!("packed decode: forks {forks:?}: each needs at least one row")));
        }
        self.text.forward_packed_rows(embeds, positions, rows, caches, adapters)
    }

    pub fn new_cache(&self) -> KvCache {
        self.text.new_cache()
    }

    /// Full forward of one prompt: logits `(T, V)` at every position.
    pub fn forward_prompt(
        &self,
        ids: &[u32],
        pixel_values: Option<&Tensor>,
        grid_thw: &[[usize; 3]],
    ) -> Result<Tensor> {
        let feats = match pixel_values {
            Some(pv) if !grid_thw.is_empty() => Some(self.image_features(pv, grid_thw)?),
            _ => None,
        };
        let t = ids.len();
        let ids_t = Tensor::from_slice(ids, (1, t), &self.device)?;
        let embeds = self.embed(&ids_t, feats.as_ref())?;
        let (pos, _) = mrope_positions(ids, grid_thw, &self.cfg)?;
        let positions = positions_tensor(&[pos], t)?;
        let mut cache = self.new_cache();
        let hidden = self.decode(&embeds, &positions, None, &mut cache)?;
        Ok(self.logits(&hidden)?.squeeze(0)?)
    }
}

/// `(3, B, T)` f32 positions from per-sequence `(t, h, w)` lists, each left-padded with zeros to `T`.
pub fn positions_tensor(seqs: &[Vec<[u32; 3]>], t: usize) -> Result<Tensor> {
    let b = seqs.len();
    let mut data = vec![0f32; 3 * b * t];
    for (i, s) in seqs.iter().enumerate() {
        let pad = t - s.len();
        for (j, p) in s.iter().enumerate() {
            for (a, &v) in p.iter().enumerate() {
                data[(a * b + i) * t + pad + j] = v as f32;
            }
        }
    }
    Ok(Tensor::from_vec(data, (3, b, t), &Device::Cpu)?)
}
