//! Launch plans: every decision about a CUDA launch as plain data, built without the `cuda` feature.
//!
//! A [`Plan`] lists the buffers an op needs (its inputs, host tables to upload, zeroed or uninitialised
//! scratch), the kernel launches in order (module, kernel name, grid, block, dynamic shared bytes, and the
//! arguments: buffers with an offset, scalars, POD structs) and which buffers are the op's outputs. The
//! builders in the submodules make every choice (head-dim bucket, tensor or CUDA cores, shared-memory
//! opt-in, logsumexp recompute, reduction passes) from the problem and the device's [`Caps`].
//!
//! Two executors run a plan: `cuda::exec` on a GPU through cudarc, and `emu` (feature `cpu-exec`) on the
//! CPU with the same `.cu` sources compiled by the host compiler. Both get the same launches, so what the
//! CPU executor checks (argument kinds and sizes against the kernels' C signatures, launch limits,
//! barriers, shared memory bounds) is what the GPU will run.

pub mod adamw;
pub mod attention;
pub mod cross_entropy;
pub mod dropout;
pub mod norm;
pub mod paged_attention;
pub mod rope;
pub mod tiling;

use std::fmt;

/// Element type of a buffer, as the kernels' C parameter types name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    F32,
    Bf16,
    U8,
    I32,
    U32,
    I64,
    U64,
}

impl Elem {
    pub fn size(self) -> usize {
        match self {
            Elem::U8 => 1,
            Elem::Bf16 => 2,
            Elem::F32 | Elem::I32 | Elem::U32 => 4,
            Elem::I64 | Elem::U64 => 8,
        }
    }

    /// The name of the C type (`float` is `f32`, `__nv_bfloat16` is `bf16`, `long long` is `i64`, ...),
    /// which is also the suffix of the kernels compiled for that storage type (`rms_norm_fwd_bf16`).
    pub fn name(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::Bf16 => "bf16",
            Elem::U8 => "u8",
            Elem::I32 => "i32",
            Elem::U32 => "u32",
            Elem::I64 => "i64",
            Elem::U64 => "u64",
        }
    }
}

/// What a buffer holds before the first launch.
#[derive(Clone, Debug, PartialEq)]
pub enum Init {
    /// The op's input number `i` (its storage, as the caller passes it).
    Input(usize),
    /// Bytes computed on the host (masks, tables), uploaded once.
    Host(Vec<u8>),
    Zeroed,
    /// Allocated but not written: a kernel of the plan writes every element before anything reads it.
    Uninit,
    /// A `u64` table of earlier buffers' device addresses and plain values, uploaded once: how a kernel
    /// reaches a number of inputs its signature cannot list (the blocks of a paged KV cache).
    Table(Vec<Word>),
}

/// One entry of an [`Init::Table`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Word {
    /// The device address of element 0 of buffer `.0` (an earlier buffer of the plan).
    Address(usize),
    Value(u64),
}

/// The table's bytes, with `address(i)` the address of buffer `i` (each executor knows its own).
pub fn table_bytes(words: &[Word], mut address: impl FnMut(usize) -> u64) -> Vec<u8> {
    let word = |w: &Word| match *w {
        Word::Address(i) => address(i),
        Word::Value(v) => v,
    };
    words.iter().map(word).flat_map(u64::to_le_bytes).collect()
}

/// One buffer of a plan: `len` elements of `elem`.
#[derive(Clone, Debug, PartialEq)]
pub struct Buffer {
    pub name: &'static str,
    pub elem: Elem,
    pub len: usize,
    pub init: Init,
}

/// One kernel argument.
#[derive(Clone, Debug, PartialEq)]
pub enum Arg {
    /// A pointer to element `offset` of buffer `buf`.
    Buf {
        buf: usize,
        offset: usize,
    },
    I32(i32),
    U32(u32),
    I64(i64),
    U64(u64),
    F32(f32),
    /// A struct passed by value (`#[repr(C)]` bytes, 8-byte aligned fields at most).
    Pod {
        name: &'static str,
        bytes: Vec<u8>,
    },
}

/// A struct argument's bytes as little-endian u64 words: 8-byte aligned storage that both executors pass
/// the kernel a pointer to (the kernel copies the parameter's size from there).
pub fn pod_words(bytes: &[u8]) -> Vec<u64> {
    bytes
        .chunks(8)
        .map(|c| {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            u64::from_le_bytes(w)
        })
        .collect()
}

/// The `.cu` file (and PTX module) a kernel lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Module {
    AdamW,
    Attention,
    AttentionTc,
    Norm,
    PagedAttention,
    Rope,
    CrossEntropy,
    Dropout,
    Tiling,
}

impl Module {
    /// The file stem: `cuda/<name>.cu`.
    pub fn name(self) -> &'static str {
        match self {
            Module::AdamW => "adamw",
            Module::Attention => "attention",
            Module::AttentionTc => "attention_tc",
            Module::Norm => "norm",
            Module::PagedAttention => "paged_attention",
            Module::Rope => "rope",
            Module::CrossEntropy => "cross_entropy",
            Module::Dropout => "dropout",
            Module::Tiling => "tiling",
        }
    }
}

/// One kernel launch.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    pub module: Module,
    pub kernel: String,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
    pub args: Vec<Arg>,
}

/// An op's launches, buffers and outputs.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub op: &'static str,
    pub buffers: Vec<Buffer>,
    pub launches: Vec<Launch>,
    /// The buffers the op returns, in order.
    pub outputs: Vec<usize>,
}

/// What a device allows a launch: the limits a plan is built for and checked against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    pub name: &'static str,
    /// Dynamic shared memory a block may opt in to (`MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`).
    pub smem_optin: usize,
    pub max_threads: u32,
}

impl Caps {
    /// A100.
    pub const SM80: Caps = Caps { name: "sm_80", smem_optin: 166_912, max_threads: 1024 };
    /// RTX 30xx/40xx, A10, L4, L40: the smallest opt-in of the GPUs we support.
    pub const SM86: Caps = Caps { name: "sm_86/sm_89", smem_optin: 101_376, max_threads: 1024 };
    /// H100, H200.
    pub const SM90: Caps = Caps { name: "sm_90", smem_optin: 232_448, max_threads: 1024 };
}

/// A plan that cannot be built or run: the message says which op, launch and limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanError(pub String);

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PlanError {}

impl From<PlanError> for candle_core::Error {
    fn from(e: PlanError) -> Self {
        candle_core::Error::Msg(e.0)
    }
}

macro_rules! plan_err {
    ($($t:tt)*) => { $crate::plan::PlanError(format!($($t)*)) };
}
pub(crate) use plan_err;

/// `v` as a kernel's `int`, or an error naming the op and the quantity.
pub fn int(op: &str, what: &str, v: usize) -> Result<i32, PlanError> {
    i32::try_from(v).map_err(|_| plan_err!("{op}: {what} = {v} exceeds a CUDA int"))
}

impl Plan {
    pub(crate) fn new(op: &'static str) -> Self {
        Self { op, buffers: Vec::new(), launches: Vec::new(), outputs: Vec::new() }
    }

    /// Adds a buffer and returns its index.
    pub(crate) fn buffer(&mut self, name: &'static str, elem: Elem, len: usize, init: Init) -> usize {
        self.buffers.push(Buffer { name, elem, len, init });
        self.buffers.len() - 1
    }

    pub(crate) fn launch(
        &mut self,
        module: Module,
        kernel: String,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: usize,
        args: Vec<Arg>,
    ) -> Result<(), PlanError> {
        let shared_bytes = u32::try_from(shared_bytes).map_err(|_| plan_err!("{}: {kernel}: shared bytes", self.op))?;
        self.launches.push(Launch { module, kernel, grid, block, shared_bytes, args });
        Ok(())
    }

    /// The number of inputs the plan reads (`Init::Input` indices are `0..inputs()`).
    pub fn inputs(&self) -> usize {
        self.buffers
            .iter()
            .filter_map(|b| if let Init::Input(i) = b.init { Some(i + 1) } else { None })
            .max()
            .unwrap_or(0)
    }

    /// Checks every launch against `caps` and the buffers: threads per block, block and grid dimensions,
    /// dynamic shared bytes within the device's opt-in, buffer arguments inside their buffers. A GPU
    /// would refuse the first three at launch time and corrupt memory silently on the last.
    pub fn check(&self, caps: &Caps) -> Result<(), PlanError> {
        for (n, l) in self.launches.iter().enumerate() {
            let at = format!("{}: launch {n} ({})", self.op, l.kernel);
            let threads = l.block.iter().map(|&x| x as u64).product::<u64>();
            if threads == 0 || threads > caps.max_threads as u64 || l.block[2] > 64 {
                return Err(plan_err!(
                    "{at}: block {:?} is {threads} threads; {} allows 1..={} (z <= 64)",
                    l.block,
                    caps.name,
                    caps.max_threads
                ));
            }
            if l.grid.contains(&0) || l.grid[0] > i32::MAX as u32 || l.grid[1] > 65_535 || l.grid[2] > 65_535 {
                return Err(plan_err!("{at}: grid {:?} is empty or past CUDA's limits (2^31-1, 65535, 65535)", l.grid));
            }
            if l.shared_bytes as usize > caps.smem_optin {
                return Err(plan_err!(
                    "{at}: needs {} bytes of dynamic shared memory per block; {} allows {}",
                    l.shared_bytes,
                    caps.name,
                    caps.smem_optin
                ));
            }
            for (i, a) in l.args.iter().enumerate() {
                if let Arg::Buf { buf, offset } = a {
                    let Some(b) = self.buffers.get(*buf) else {
                        return Err(plan_err!(
                            "{at}: argument {i} names buffer {buf}, the plan has {}",
                            self.buffers.len()
                        ));
                    };
                    if *offset > b.len {
                        return Err(plan_err!(
                            "{at}: argument {i} starts at {offset} of `{}` ({} elements)",
                            b.name,
                            b.len
                        ));
                    }
                }
            }
        }
        for (n, b) in self.buffers.iter().enumerate() {
            if let Init::Table(words) = &b.init {
                let later = words.iter().any(|w| matches!(*w, Word::Address(i) if i >= n));
                if b.elem != Elem::U64 || b.len != words.len() || later {
                    return Err(plan_err!(
                        "{}: table `{}` must be {} u64 words, its addresses those of earlier buffers",
                        self.op,
                        b.name,
                        words.len()
                    ));
                }
            }
        }
        for &o in &self.outputs {
            if o >= self.buffers.len() {
                return Err(plan_err!("{}: output {o} is not a buffer", self.op));
            }
        }
        Ok(())
    }
}

/// Little-endian bytes of plain values, for `Init::Host` tables.
pub fn bytes_of<T: HostBytes>(v: &[T]) -> Vec<u8> {
    v.iter().flat_map(|x| x.le_bytes()).collect()
}

/// A value with a fixed little-endian byte form (what a device buffer of its `Elem` holds).
pub trait HostBytes: Copy {
    fn le_bytes(self) -> Vec<u8>;
}

macro_rules! host_bytes {
    ($($t:ty),*) => {$(impl HostBytes for $t { fn le_bytes(self) -> Vec<u8> { self.to_le_bytes().to_vec() } })*};
}
host_bytes!(u8, i32, u32, i64, u64, f32);

/// Refuses a storage type the kernels are not compiled for (they exist for f32 and bf16).
pub(crate) fn float_elem(op: &str, elem: Elem) -> Result<(), PlanError> {
    match elem {
        Elem::F32 | Elem::Bf16 => Ok(()),
        other => Err(plan_err!("{op}: CUDA kernels exist for f32 and bf16 storage, got {}", other.name())),
    }
}

/// One block of `threads` threads per row, as the row kernels launch.
pub(crate) fn per_row(op: &str, rows: usize, threads: u32) -> Result<([u32; 3], [u32; 3]), PlanError> {
    let rows = u32::try_from(rows).ok().filter(|&r| r <= i32::MAX as u32);
    let rows = rows.ok_or_else(|| plan_err!("{op}: too many rows for a CUDA grid"))?;
    Ok(([rows.max(1), 1, 1], [threads, 1, 1]))
}

/// Threads of a block that reduces rows of `d` elements: about 4 elements per thread, a multiple of 32
/// (the block reductions need whole warps), between 32 and `max`.
pub(crate) fn row_threads(d: usize, max: u32) -> u32 {
    (d.div_ceil(4).next_multiple_of(32)).clamp(32, max as usize) as u32
}
