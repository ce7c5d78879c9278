//! A step's micro-batches, planned and made ahead: while a step runs, a background thread decodes the
//! screenshots of the micro-batches after it, tiles them ([`data::example`]: the GPU kernels on a CUDA
//! device) and packs them, `--prefetch N` of them ready ahead (0: each is made inline when its turn comes).
//!
//! Key choice: what a step trains on is a function of (seed, step, data position) ([`Planner::plan`]), so
//! the thread walks the loop's plan on its own and the loop checks each micro-batch it takes against its
//! plan ([`take`]): prefetching changes when a batch is made, never which batch or its values, and the
//! losses are bitwise those of `--prefetch 0`. The unit is the micro-batch, not the step, so that the
//! pixels held ahead stay a few micro-batches' worth (on a GPU they are device memory). An error is sent
//! in its turn and ends the stream, so it stops the run at the step that needs that sample, before the
//! step computes anything; the thread stops when the loop drops its end (the run ended, failed or was
//! interrupted), after at most the micro-batch in hand.

use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;

use askgui_model::{ImageProcessorConfig, TrainExample};
use candle_core::Device;

use crate::config::TrainConfig;
use crate::data::{self, DataPosition, Dataset, PreparedSample};
use crate::data_parallel;
use crate::error::{Result, TrainError};
use crate::pack;

/// Which samples a step trains on and how this rank cuts its share into micro-batches: all but pixels.
#[derive(Debug, Clone, PartialEq)]
pub struct StepPlan {
    /// Optimiser steps done before this one.
    pub step: usize,
    /// The data position after the step.
    pub next: DataPosition,
    /// Sequences, tokens and supervised tokens of the whole step, over every rank.
    pub sequences: usize,
    pub tokens: usize,
    pub supervised: usize,
    /// Index in the step of this rank's first sample (it numbers the dropout seeds across ranks).
    pub first: usize,
    /// Supervised tokens of this rank's samples.
    pub mine_supervised: usize,
    /// This rank's micro-batches, as indices into the training set.
    pub micro: Vec<Vec<usize>>,
}

/// One micro-batch, ready for the model.
pub struct MicroBatch {
    /// Its step (steps done before it) and its index in that step's plan.
    pub step: usize,
    pub index: usize,
    pub examples: Vec<TrainExample>,
    /// Decoder rows it computes, padding included.
    pub rows: usize,
}

/// Plans steps: the training set, the options the plan depends on, and this rank's place.
#[derive(Clone)]
pub struct Planner {
    pub data: Arc<Dataset>,
    cfg: TrainConfig,
    /// Sequences an optimiser step takes over all ranks.
    pub per_step: usize,
    rank: usize,
    ranks: usize,
}

impl Planner {
    /// The planner of rank `rank` of `ranks`.
    pub fn new(data: Dataset, cfg: &TrainConfig, (rank, ranks): (usize, usize)) -> Self {
        let per_step = cfg.sequences_per_step() * ranks;
        Self { data: Arc::new(data), cfg: cfg.clone(), per_step, rank, ranks }
    }

    /// The plan of the step after `step` steps, which starts at data position `pos`.
    pub fn plan(&self, step: usize, pos: DataPosition) -> StepPlan {
        let (indices, next) = data::step_samples(self.data.samples.len(), self.per_step, self.cfg.run.seed, pos);
        let samples: Vec<&PreparedSample> = indices.iter().map(|&i| &self.data.samples[i]).collect();
        let mine = data_parallel::shard(samples.len(), self.rank, self.ranks);
        let first = mine.start;
        let micro = micro_batch_plan(&samples[mine.clone()], &self.cfg);
        StepPlan {
            step,
            next,
            sequences: samples.len(),
            tokens: samples.iter().map(|s| s.ids.len()).sum(),
            supervised: samples.iter().map(|s| s.supervised_tokens()).sum(),
            first,
            mine_supervised: samples[mine].iter().map(|s| s.supervised_tokens()).sum(),
            micro: micro.into_iter().map(|m| m.into_iter().map(|i| indices[first + i]).collect()).collect(),
        }
    }

    /// The micro-batches of the steps from `step` (at data position `pos`) up to `end`, in order, their
    /// pixels on `device`; `depth` of them made ahead on a thread ([`Prefetch`]).
    pub fn micro_batches(
        &self,
        (step, pos): (usize, DataPosition),
        end: usize,
        images: &ImageProcessorConfig,
        device: &Device,
        depth: usize,
    ) -> Result<Prefetch<MicroBatch>> {
        let (images, device) = (images.clone(), device.clone());
        let producer = Producer { planner: self.clone(), images, device, step, pos, end, plan: None, index: 0 };
        Prefetch::new(depth, producer)
    }
}

/// The micro-batches of a step: `--batch-size` sequences each in data order, or with `--packing` packs of
/// up to `--max-seq-len` tokens ([`crate::pack`]), at least `--micro-batch-threads` of them when they fit.
/// Returns each micro-batch's sample indices.
fn micro_batch_plan(samples: &[&PreparedSample], cfg: &TrainConfig) -> Vec<Vec<usize>> {
    if !cfg.optim.packing {
        return (0..samples.len()).collect::<Vec<_>>().chunks(cfg.optim.batch_size).map(<[usize]>::to_vec).collect();
    }
    let lens: Vec<usize> = samples.iter().map(|s| s.ids.len()).collect();
    let (threads, cap) = (cfg.optim.micro_batch_threads, cfg.data.max_seq_len);
    let packs = pack::first_fit_decreasing(&lens, cap);
    match packs.len() < threads {
        true => pack::balanced(&lens, threads, cap).unwrap_or(packs),
        false => packs,
    }
}

/// Walks the plans of steps `step..end` and makes their micro-batches one by one.
struct Producer {
    planner: Planner,
    images: ImageProcessorConfig,
    device: Device,
    step: usize,
    pos: DataPosition,
    end: usize,
    /// The plan of `step` and the index of its next micro-batch.
    plan: Option<StepPlan>,
    index: usize,
}

impl Iterator for Producer {
    type Item = Result<MicroBatch>;

    fn next(&mut self) -> Option<Result<MicroBatch>> {
        loop {
            if let Some(plan) = &self.plan {
                if let Some(samples) = plan.micro.get(self.index) {
                    let (step, index) = (plan.step, self.index);
                    self.index += 1;
                    return Some(self.make(samples, step, index));
                }
                // A rank's share of a short last step can be empty: the loop moves on to the next step.
                (self.step, self.pos, self.plan) = (self.step + 1, plan.next, None);
            }
            if self.step >= self.end {
                return None;
            }
            self.plan = Some(self.planner.plan(self.step, self.pos));
            self.index = 0;
        }
    }
}

impl Producer {
    fn make(&self, samples: &[usize], step: usize, index: usize) -> Result<MicroBatch> {
        let data = &self.planner.data;
        let examples = samples
            .iter()
            .map(|&i| data::example(&data.samples[i], &data.path, &self.images, &self.device))
            .collect::<Result<Vec<_>>>()?;
        let lens: Vec<usize> = examples.iter().map(|e| e.ids.len()).collect();
        Ok(MicroBatch { step, index, examples, rows: pack::computed_rows(&lens, self.planner.cfg.optim.packing) })
    }
}

/// Micro-batch `index` of `plan`'s step, the next one `batches` gives; an error if the stream does not
/// follow the plan (it cannot, unless the two walks disagree: a bug, which must not train on wrong data).
pub fn take(batches: &mut Prefetch<MicroBatch>, plan: &StepPlan, index: usize) -> Result<MicroBatch> {
    let step = plan.step + 1;
    match batches.next() {
        Some(Ok(b)) if (b.step, b.index) == (plan.step, index) => Ok(b),
        Some(Ok(b)) => Err(TrainError::Data(format!(
            "step {step}: micro-batch {} of step {} came where micro-batch {index} was due; a bug of the prefetch: \
             --prefetch 0 makes each micro-batch in turn",
            b.index,
            b.step + 1
        ))),
        Some(Err(e)) => Err(e),
        None => Err(TrainError::Data(format!("step {step}: the micro-batches ended before micro-batch {index}"))),
    }
}

/// The items of an iterator in order: made ahead on a thread of their own, `depth` of them waiting, or
/// with `depth` 0 on the caller's thread when asked. The first error ends the items.
pub struct Prefetch<T: Send + 'static> {
    source: Source<T>,
}

enum Source<T> {
    /// The items, until one is an error.
    Inline(Option<Box<dyn Iterator<Item = Result<T>> + Send>>),
    Thread {
        items: Option<Receiver<Result<T>>>,
        thread: Option<JoinHandle<()>>,
    },
}

impl<T: Send + 'static> Prefetch<T> {
    pub fn new(depth: usize, items: impl Iterator<Item = Result<T>> + Send + 'static) -> Result<Self> {
        if depth == 0 {
            return Ok(Self { source: Source::Inline(Some(Box::new(items))) });
        }
        let (tx, rx) = sync_channel(depth);
        let thread = std::thread::Builder::new()
            .name("askgui-prefetch".into())
            .spawn(move || {
                for item in items {
                    let failed = item.is_err();
                    // A send fails once the receiver is gone: nobody wants more.
                    if tx.send(item).is_err() || failed {
                        return;
                    }
                }
            })
            .map_err(|e| TrainError::Config(format!("--prefetch {depth}: cannot start the prefetch thread: {e}")))?;
        Ok(Self { source: Source::Thread { items: Some(rx), thread: Some(thread) } })
    }
}

impl<T: Send + 'static> Iterator for Prefetch<T> {
    type Item = Result<T>;

    fn next(&mut self) -> Option<Result<T>> {
        match &mut self.source {
            Source::Inline(items) => {
                let item = items.as_mut()?.next();
                if !matches!(item, Some(Ok(_))) {
                    *items = None;
                }
                item
            }
            Source::Thread { items, thread } => match items.as_ref()?.recv() {
                Ok(item) => Some(item),
                Err(_) => {
                    // The thread is done: the items ran out, or it panicked, which propagates here as it
                    // would have on this thread.
                    if let Some(Err(panic)) = thread.take().map(JoinHandle::join) {
                        std::panic::resume_unwind(panic);
                    }
                    None
                }
            },
        }
    }
}

impl<T: Send + 'static> Drop for Prefetch<T> {
    /// Stops the thread: without a receiver its next send fails (a send blocked on a full channel wakes
    /// and fails), and it returns after at most the item in hand.
    fn drop(&mut self) {
        if let Source::Thread { items, thread } = &mut self.source {
            drop(items.take());
            if let Some(t) = thread.take() {
                // A panic there was already reported by the panic hook; a drop must not raise it again.
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// Runs `f` on a thread and fails the test if it takes more than 10 s (instead of hanging the test).
    fn within_10s<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(f()).unwrap());
        rx.recv_timeout(Duration::from_secs(10)).expect("hung for 10 s")
    }

    #[test]
    fn items_come_in_order_from_another_thread_or_inline() {
        let me = std::thread::current().id();
        for depth in [0, 1, 3] {
            let items = (0..7).map(|i| Ok((i, std::thread::current().id())));
            let got: Vec<_> = Prefetch::new(depth, items).unwrap().map(|r| r.unwrap()).collect();
            assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), (0..7).collect::<Vec<_>>(), "depth {depth}");
            // Depth 0 makes each item on the caller's thread; otherwise none is made there.
            assert!(got.iter().all(|g| (g.1 == me) == (depth == 0)), "depth {depth}");
        }
    }

    #[test]
    fn an_error_is_delivered_in_its_turn_and_ends_the_items() {
        for depth in [0, 2] {
            let made = Arc::new(AtomicUsize::new(0));
            let counter = made.clone();
            let items = (0..10).map(move |i| {
                counter.fetch_add(1, Ordering::SeqCst);
                if i == 3 {
                    Err(TrainError::Data(format!("item {i} is bad")))
                } else {
                    Ok(i)
                }
            });
            let got: Vec<String> = within_10s(move || {
                let p = Prefetch::new(depth, items).unwrap();
                p.map(|r| r.map_or_else(|e| e.to_string(), |i| i.to_string())).collect()
            });
            assert_eq!(got, ["0", "1", "2", "data: item 3 is bad"], "depth {depth}");
            // Nothing after the error was made (the thread stopped there).
            assert_eq!(made.load(Ordering::SeqCst), 4, "depth {depth}");
        }
    }

    #[test]
    fn dropping_it_stops_a_thread_blocked_on_a_full_channel() {
        let made = Arc::new(AtomicUsize::new(0));
        let counter = made.clone();
        // Endless items: the thread fills the channel and blocks; the drop must still return.
        let items = (0..).map(move |i| {
            counter.fetch_add(1, Ordering::SeqCst);
            Ok(i)
        });
        let first = within_10s(move || {
            let mut p = Prefetch::new(2, items).unwrap();
            p.next().unwrap().unwrap()
        });
        assert_eq!(first, 0);
        // At most the taken item, the two waiting in the channel and the one in hand were made.
        assert!(made.load(Ordering::SeqCst) <= 4, "{} made", made.load(Ordering::SeqCst));
    }
}
