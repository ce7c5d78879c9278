//! The LoRA state one linear layer holds: each loaded adapter's low-rank delta ([`LoraDelta`]), which one
//! is active and which one is merged into the weight ([`LoraSlot`]); and which adapter each row of a
//! batch that mixes adapters applies ([`RowAdapters`], Punica / S-LoRA style).
//!
//! Key choice: this sits below [`crate::layers`] so that `Linear` can hold and apply adapters without
//! knowing where they come from; reading, merging and switching them is [`crate::lora`] (the PEFT format is
//! [`crate::peft`]), and making them trainable is [`crate::train`]. A delta is `scale * (x A^T) B^T` with
//! `A (r, in)`, `B (out, r)` (Hu et al. 2021, "LoRA"; PEFT's `LoraLayer`).

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};

/// The dtype trainable adapter weights are kept in: f32 master copies for a half-precision (bf16 / f16)
/// model, so that small AdamW updates are not rounded away; the model's own dtype otherwise.
pub fn master_dtype(model: DType) -> DType {
    match model {
        DType::BF16 | DType::F16 => DType::F32,
        d => d,
    }
}

/// One adapter's low-rank update of one linear: `A (r, in)`, `B (out, r)`.
#[derive(Debug, Clone)]
pub struct LoraDelta {
    pub a: Tensor,
    pub b: Tensor,
    pub scale: f64,
}

impl LoraDelta {
    /// `x (..., in) -> scale * (x A^T) B^T (..., out)`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        // Trainable adapters of a bf16 model keep f32 masters ([`master_dtype`]): the product runs
        // in the adapter's dtype and comes back in the activations' (both casts are differentiable). On
        // the CPU, which has no bf16 matmul, a bf16 adapter (loaded for inference) runs in f32 too.
        let dtype = x.dtype();
        let master = match x.device().is_cpu() {
            true => master_dtype(self.a.dtype()),
            false => self.a.dtype(),
        };
        let x = if dtype == master { x.clone() } else { x.to_dtype(master)? };
        let (a, b) = (self.a.to_dtype(master)?, self.b.to_dtype(master)?);
        // (..., in) -> (..., r) -> (..., out)
        let y = (x.broadcast_matmul(&a.t()?)?.broadcast_matmul(&b.t()?)? * self.scale)?;
        if dtype == master {
            Ok(y)
        } else {
            y.to_dtype(dtype)
        }
    }

    /// `scale * B A`, `(out, in)`, computed in f32 and returned in `dtype`.
    pub(crate) fn dense(&self, dtype: DType) -> candle_core::Result<Tensor> {
        (self.b.to_dtype(DType::F32)?.matmul(&self.a.to_dtype(DType::F32)?)? * self.scale)?.to_dtype(dtype)
    }
}

/// The adapters loaded for one linear layer.
#[derive(Debug, Clone, Default)]
pub struct LoraSlot {
    pub(crate) adapters: BTreeMap<String, LoraDelta>,
    pub(crate) active: Option<String>,
    /// The merged adapter's name and the original weight it replaced.
    pub(crate) merged: Option<(String, Tensor)>,
}

impl LoraSlot {
    /// The delta to add in the forward: the active adapter's, unless it is already merged into `W`.
    pub fn active_delta(&self) -> Option<&LoraDelta> {
        self.delta(self.active.as_deref())
    }

    /// The delta adapter `name` adds (None: the base model, an adapter with no delta for this layer, or
    /// the adapter merged into `W`).
    pub fn delta(&self, name: Option<&str>) -> Option<&LoraDelta> {
        let name = name?;
        if self.merged.as_ref().is_some_and(|(m, _)| m == name) {
            return None;
        }
        self.adapters.get(name)
    }
}

/// Which adapter each row of a forward applies, for a batch that mixes adapters and the base model.
/// A linear computes the base product once for all rows, then, for each adapter present, gathers that
/// adapter's rows, computes its delta on them and adds it back in place (`index_select` + `index_add`):
/// Punica's and S-LoRA's gathered LoRA, written with plain candle ops. Built once per forward (the row
/// indices go to the device once), by [`crate::model::Qwen2Vl::row_adapters`], which checks the names.
#[derive(Debug, Clone)]
pub enum RowAdapters {
    /// Every row applies this adapter (None: the base model): one delta over all rows, the path of one
    /// active adapter.
    Uniform(Option<String>),
    /// Rows of several adapters.
    Mixed {
        /// Consecutive runs of rows and their adapter, in row order.
        runs: Vec<(usize, Option<String>)>,
        /// Each adapter's rows, `u32` indices into the rows on the model's device; rows of no group run
        /// the base model.
        groups: Vec<(String, Tensor)>,
    },
}

impl RowAdapters {
    /// From consecutive runs of `(rows, adapter)` in row order: [`Self::Uniform`] when they all share one.
    pub fn from_runs(runs: &[(usize, Option<&str>)], device: &Device) -> candle_core::Result<Self> {
        let runs: Vec<(usize, Option<&str>)> = runs.iter().copied().filter(|(n, _)| *n > 0).collect();
        let first = runs.first().map(|r| r.1).unwrap_or_default();
        if runs.iter().all(|r| r.1 == first) {
            return Ok(Self::Uniform(first.map(str::to_string)));
        }
        let mut rows: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
        let mut start = 0u32;
        for &(n, name) in &runs {
            if let Some(name) = name {
                rows.entry(name).or_default().extend(start..start + n as u32);
            }
            start += n as u32;
        }
        let groups = rows
            .into_iter()
            .map(|(name, idx)| {
                let n = idx.len();
                Ok((name.to_string(), Tensor::from_vec(idx, n, device)?))
            })
            .collect::<candle_core::Result<_>>()?;
        Ok(Self::Mixed { runs: runs.iter().map(|&(n, a)| (n, a.map(str::to_string))).collect(), groups })
    }

    /// The plan for the same rows taken `unit` at a time (the vision merger's rows are groups of
    /// `merge^2` patch rows); every run must be a whole number of units.
    pub fn grouped(&self, unit: usize, device: &Device) -> candle_core::Result<Self> {
        let Self::Mixed { runs, .. } = self else { return Ok(self.clone()) };
        if let Some((n, _)) = runs.iter().find(|(n, _)| n % unit != 0) {
            candle_core::bail!("a run of {n} rows of one adapter is not a whole number of {unit}-row groups")
        }
        let runs: Vec<(usize, Option<&str>)> = runs.iter().map(|(n, a)| (n / unit, a.as_deref())).collect();
        Self::from_runs(&runs, device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn groups(plan: &RowAdapters) -> Vec<(String, Vec<u32>)> {
        match plan {
            RowAdapters::Uniform(_) => vec![],
            RowAdapters::Mixed { groups, .. } => {
                groups.iter().map(|(n, idx)| (n.clone(), idx.to_vec1::<u32>().unwrap())).collect()
            }
        }
    }

    #[test]
    fn runs_become_each_adapters_rows() {
        let dev = Device::Cpu;
        // One adapter (empty runs aside) is the one-adapter path, the base model too.
        let one = RowAdapters::from_runs(&[(2, Some("a")), (0, None), (3, Some("a"))], &dev).unwrap();
        assert!(matches!(one, RowAdapters::Uniform(Some(ref a)) if a == "a"));
        assert!(matches!(RowAdapters::from_runs(&[(4, None)], &dev).unwrap(), RowAdapters::Uniform(None)));
        // Rows 0-1 and 5 are `a`, 2-4 the base, 6-9 `b`: the base's rows are in no group.
        let runs = [(2, Some("a")), (3, None), (1, Some("a")), (4, Some("b"))];
        let mixed = RowAdapters::from_runs(&runs, &dev).unwrap();
        assert_eq!(groups(&mixed), [("a".into(), vec![0, 1, 5]), ("b".into(), vec![6, 7, 8, 9])]);
        // Taken 2 at a time (runs of whole units only).
        let runs = [(2, Some("a")), (4, None), (2, Some("b"))];
        let grouped = RowAdapters::from_runs(&runs, &dev).unwrap().grouped(2, &dev).unwrap();
        assert_eq!(groups(&grouped), [("a".into(), vec![0]), ("b".into(), vec![3])]);
        let err = RowAdapters::from_runs(&runs, &dev).unwrap().grouped(4, &dev).unwrap_err().to_string();
        assert!(err.contains("run of 2 rows") && err.contains("4-row groups"), "{err}");
    }
}
