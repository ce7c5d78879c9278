//! The decoder's KV cache, kept in blocks of [`KV_BLOCK`] positions that caches share by reference, with an
//! optional pool that bounds the bytes all caches hold together.
//!
//! Why blocks: a serving step appends one position per sequence, and a fork (a session's next step, a
//! cached prompt prefix) continues from its parent's cache (the forks that score options append nothing:
//! [`crate::NewRows::Forks`]). With one tensor per
//! layer, each append copied the whole cache (`Tensor::cat`) and each fork its own copy of it. Here an
//! append writes into the last block only (copying at most `KV_BLOCK` positions: the block a fork shares
//! with its parent is copied when one of them writes into it, never the full ones), and a fork clones a
//! list of block handles. Attention reads the blocks where they are
//! ([`askgui_kernels::ops::paged_attention`], on the CPU and on CUDA) on the decode path; prefills
//! concatenate them, and elsewhere a layer is one block (see [`KvCache`]).
//!
//! Accounting: every block holds a ticket from its [`KvPool`]; the ticket goes back when the last cache
//! holding the block drops it, so [`KvPool::blocks_in_use`] is the reference count of the whole pool and
//! returns to zero when every sequence and cached prefix is gone, whatever ended them (a panic unwinds
//! through the same drops). A pool with a byte budget refuses a block past it with
//! [`ModelError::KvCacheFull`]: the caller decides whether to wait, drop cached prefixes or answer busy;
//! a cache whose append failed may hold some layers' new positions and not others', and is dropped.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::{Device, Tensor};

use crate::error::{ModelError, Result};

/// Positions per block.
pub const KV_BLOCK: usize = 32;

/// Whether caches on `dev` are kept in [`KV_BLOCK`]s that attention reads in place: the devices the paged
/// attention runs on (the CPU, and CUDA with its kernel).
pub(crate) fn paged_device(dev: &Device) -> bool {
    dev.is_cpu() || dev.is_cuda()
}

/// Where the blocks of a set of caches come from: a count of live blocks (one layer's keys and values of
/// [`KV_BLOCK`] positions each) and an optional budget.
#[derive(Debug, Default)]
pub struct KvPool {
    in_use: AtomicUsize,
    /// Blocks promised to prompts admitted but not yet run ([`KvPool::reserve`]).
    reserved: AtomicUsize,
    /// Most blocks at once; 0: no bound.
    capacity: usize,
}

impl KvPool {
    /// A pool of at most `capacity` blocks (0: unbounded).
    pub fn new(capacity: usize) -> Arc<Self> {
        Arc::new(Self { in_use: AtomicUsize::new(0), reserved: AtomicUsize::new(0), capacity })
    }

    /// Blocks held by some cache now (a block shared by several caches counts once).
    pub fn blocks_in_use(&self) -> usize {
        self.in_use.load(Ordering::SeqCst)
    }

    /// The budget in blocks; 0 when unbounded.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Promises `blocks` to a prompt about to run, so that prompts admitted together cannot together
    /// overrun the budget before any of them has allocated; refused with [`ModelError::KvCacheFull`] when
    /// the blocks in use and promised leave too little. An unbounded pool promises anything.
    pub fn reserve(self: &Arc<Self>, blocks: usize) -> Result<Reservation> {
        if self.capacity == 0 {
            return Ok(Reservation { pool: self.clone(), blocks: 0 });
        }
        let promised = self.reserved.fetch_add(blocks, Ordering::SeqCst) + blocks;
        if self.blocks_in_use() + promised > self.capacity {
            self.reserved.fetch_sub(blocks, Ordering::SeqCst);
            return Err(ModelError::KvCacheFull { capacity: self.capacity });
        }
        Ok(Reservation { pool: self.clone(), blocks })
    }

    /// A ticket for `blocks` blocks' worth of positions.
    fn ticket(self: &Arc<Self>, blocks: usize) -> Result<Arc<Ticket>> {
        let taken = self.in_use.fetch_add(blocks, Ordering::SeqCst);
        if self.capacity > 0 && taken + blocks > self.capacity {
            self.in_use.fetch_sub(blocks, Ordering::SeqCst);
            return Err(ModelError::KvCacheFull { capacity: self.capacity });
        }
        Ok(Arc::new(Ticket { pool: self.clone(), blocks }))
    }
}

/// Blocks promised by [`KvPool::reserve`], released on drop (once the prompt has run and its blocks
/// count as in use).
#[derive(Debug)]
pub struct Reservation {
    pool: Arc<KvPool>,
    blocks: usize,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.pool.reserved.fetch_sub(self.blocks, Ordering::SeqCst);
    }
}

/// A block's place in its pool (several [`KV_BLOCK`]s' worth for a longer block, see [`KvCache`]), given
/// back on drop.
#[derive(Debug)]
struct Ticket {
    pool: Arc<KvPool>,
    blocks: usize,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.pool.in_use.fetch_sub(self.blocks, Ordering::SeqCst);
    }
}

/// Keys and values `(B, Hkv, n, D)` of one layer: up to [`KV_BLOCK`] positions, a prefill's on CUDA, or
/// all of the layer's where it is one block. Contiguous, except a block a prefix cut short (a view).
#[derive(Clone, Debug)]
struct Block {
    k: Tensor,
    v: Tensor,
    /// Counts the block once in the pool however many layers' slices and caches share it.
    _ticket: Arc<Ticket>,
}

impl Block {
    fn len(&self) -> usize {
        self.k.dim(2).unwrap_or(0)
    }
}

/// Per-layer rotated keys and values, in blocks; cloning a cache shares its blocks.
///
/// On the CPU and on CUDA decode steps of one sequence attend through the blocks in place. On the CPU
/// every block holds up to [`KV_BLOCK`] positions; on CUDA a prefill's positions past the last block's room
/// stay one block (each block is a kernel launch to copy), and the positions decoded after it fill
/// [`KV_BLOCK`]s. A batch of sequences in one cache (`B > 1`, batched generation) on CUDA,
/// and any cache on other devices, keeps each layer as one block that every append replaces by a longer
/// copy, as a plain cache would: their attention wants one tensor, and concatenating dozens of blocks per
/// layer and step would cost a kernel launch each. Such a block holds tickets for the [`KV_BLOCK`]s its
/// positions fill, so the pool's budget means the same on every device.
#[derive(Default, Clone, Debug)]
pub struct KvCache {
    layers: Vec<Vec<Block>>,
    /// The pool new blocks come from (none: an unbounded pool of this cache's own).
    pool: Option<Arc<KvPool>>,
    /// How appends lay out the positions.
    layout: Layout,
}

/// How a cache's appends lay out the positions of a layer.
#[derive(Default, Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// As the device wants (see [`KvCache`]).
    #[default]
    Device,
    /// A prefill's positions past the last block's room as one block, as on CUDA, on any device.
    Unsplit,
    /// One block per layer whatever the device (what caches do where attention cannot read blocks).
    Whole,
}

impl KvCache {
    /// An empty cache whose blocks count against `pool`.
    pub fn in_pool(pool: Arc<KvPool>) -> Self {
        Self { layers: Vec::new(), pool: Some(pool), layout: Layout::Device }
    }

    /// [`Self::in_pool`] with one block per layer, as on devices without the paged attention, on any
    /// device (to test that layout on a machine without a GPU).
    pub fn whole_in_pool(pool: Arc<KvPool>) -> Self {
        Self { layout: Layout::Whole, ..Self::in_pool(pool) }
    }

    /// [`Self::in_pool`] with a prefill's positions kept as one block, as on CUDA, on any device (to test
    /// that layout on a machine without a GPU).
    pub fn unsplit_in_pool(pool: Arc<KvPool>) -> Self {
        Self { layout: Layout::Unsplit, ..Self::in_pool(pool) }
    }

    /// Number of cached positions (0 when empty).
    pub fn len(&self) -> usize {
        self.layer_len(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The cache of the first `len` positions (a prefix shared with another prompt): the full blocks below
    /// `len` are shared, a block cut by `len` is narrowed (and copied at the next append).
    pub fn truncated(&self, len: usize) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .map(|blocks| {
                let mut kept = Vec::new();
                let mut at = 0;
                for b in blocks {
                    if at >= len {
                        break;
                    }
                    let n = b.len().min(len - at);
                    kept.push(if n == b.len() {
                        b.clone()
                    } else {
                        Block { k: b.k.narrow(2, 0, n)?, v: b.v.narrow(2, 0, n)?, _ticket: b._ticket.clone() }
                    });
                    at += n;
                }
                Ok(kept)
            })
            .collect::<Result<_>>()?;
        Ok(Self { layers, pool: self.pool.clone(), layout: self.layout })
    }

    /// Bytes held by the keys and values (blocks shared with other caches included).
    pub fn bytes(&self) -> usize {
        let block = |b: &Block| (b.k.elem_count() + b.v.elem_count()) * b.k.dtype().size_in_bytes();
        self.layers.iter().flatten().map(block).sum()
    }

    /// A cache with no layer yet gets `layers` empty ones.
    pub(crate) fn fit(&mut self, layers: usize) {
        if self.layers.is_empty() {
            self.layers = vec![Vec::new(); layers];
        }
    }

    /// Appends layer `i`'s new keys and values `(B, Hkv, T, D)`: the last block is filled up to
    /// [`KV_BLOCK`] (a new tensor: whoever shares the old one keeps it), then new blocks take the rest
    /// ([`KV_BLOCK`]s on the CPU, one block on CUDA).
    pub(crate) fn append(&mut self, i: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let dev = k.device();
        let whole = match self.layout {
            Layout::Whole => true,
            // A batch in one cache (B > 1) off the CPU: the paged kernel takes one sequence.
            _ => !paged_device(dev) || (!dev.is_cpu() && k.dim(0)? > 1),
        };
        if whole {
            return self.append_whole(i, k, v);
        }
        let t = k.dim(2)?;
        let mut at = 0;
        if let Some(last) = self.layers[i].last() {
            let room = KV_BLOCK - last.len().min(KV_BLOCK);
            if room > 0 && t > 0 {
                let m = room.min(t);
                let grown = Block {
                    // `cat` of contiguous pieces is contiguous, as the paged attention wants.
                    k: Tensor::cat(&[&last.k.contiguous()?, &k.narrow(2, 0, m)?.contiguous()?], 2)?,
                    v: Tensor::cat(&[&last.v.contiguous()?, &v.narrow(2, 0, m)?.contiguous()?], 2)?,
                    _ticket: self.ticket(1)?,
                };
                *self.layers[i].last_mut().expect("a last block") = grown;
                at = m;
            }
        }
        // On a GPU each block is a copy kernel to launch: the rest of a prefill stays one block, with the
        // tickets of the KV_BLOCKs it fills (the paged kernel takes blocks of any length).
        let split = self.layout == Layout::Device && dev.is_cpu();
        while at < t {
            let m = if split { KV_BLOCK.min(t - at) } else { t - at };
            let block = Block {
                k: k.narrow(2, at, m)?.contiguous()?,
                v: v.narrow(2, at, m)?.contiguous()?,
                _ticket: self.ticket(m.div_ceil(KV_BLOCK))?,
            };
            self.layers[i].push(block);
            at += m;
        }
        Ok(())
    }

    /// [`Self::append`] for one block a layer: layer `i`'s one block replaced by itself and the new positions. The
    /// old block is let go before the new one's ticket is taken, so a growing cache does not count twice
    /// (a cache whose append failed is dropped by its caller, as on the CPU).
    fn append_whole(&mut self, i: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let (k, v) = match self.layers[i].pop() {
            Some(b) => (
                Tensor::cat(&[&b.k.contiguous()?, &k.contiguous()?], 2)?,
                Tensor::cat(&[&b.v.contiguous()?, &v.contiguous()?], 2)?,
            ),
            None => (k.contiguous()?, v.contiguous()?),
        };
        let ticket = self.ticket(k.dim(2)?.div_ceil(KV_BLOCK))?;
        self.layers[i] = vec![Block { k, v, _ticket: ticket }];
        Ok(())
    }

    /// Positions cached in layer `i` (all layers agree between forwards).
    pub(crate) fn layer_len(&self, i: usize) -> usize {
        self.layers.get(i).map_or(0, |blocks| blocks.iter().map(Block::len).sum())
    }

    /// Layer `i`'s blocks as `(k, v)` pairs, in order.
    pub(crate) fn blocks(&self, i: usize) -> Vec<(Tensor, Tensor)> {
        self.layers[i].iter().map(|b| (b.k.clone(), b.v.clone())).collect()
    }

    /// Layer `i`'s keys and values concatenated `(B, Hkv, len, D)` (a copy unless there is one block).
    pub(crate) fn keys_values(&self, i: usize) -> Result<(Tensor, Tensor)> {
        let blocks = &self.layers[i];
        match blocks.as_slice() {
            [one] => Ok((one.k.clone(), one.v.clone())),
            _ => {
                let ks: Vec<&Tensor> = blocks.iter().map(|b| &b.k).collect();
                let vs: Vec<&Tensor> = blocks.iter().map(|b| &b.v).collect();
                Ok((Tensor::cat(&ks, 2)?, Tensor::cat(&vs, 2)?))
            }
        }
    }

    fn ticket(&mut self, blocks: usize) -> Result<Arc<Ticket>> {
        self.pool.get_or_insert_with(|| KvPool::new(0)).ticket(blocks)
    }
}
