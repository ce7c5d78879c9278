//! The GPU executor of launch plans (feature `cuda`): allocates a [`Plan`]'s buffers on candle's CUDA
//! device, uploads its host tables, and runs its launches in order on candle's stream through cudarc.
//!
//! It decides nothing: kernel, grid, block, shared bytes and arguments all come from the plan, the same
//! plan the CPU executor (`emu`) runs in the tests. It only checks the plan against this device's limits
//! ([`caps`]) and that every input storage holds the elements the plan reads, and opts a kernel in to
//! more than 48 KiB of dynamic shared memory when its launch asks for it.

use crate::cuda::ptx;
use crate::plan::{pod_words, table_bytes, Arg, Caps, Elem, Init, Module, Plan};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, CudaView, DevicePtr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, Result};
use half::bf16;

/// The PTX module of a plan's kernels: candle's module name and the PTX text.
fn module(m: Module) -> (&'static str, &'static str) {
    match m {
        Module::AdamW => ("askgui_adamw", ptx::ADAMW),
        Module::Attention => ("askgui_attention", ptx::ATTENTION),
        Module::AttentionTc => ("askgui_attention_tc", ptx::ATTENTION_TC),
        Module::Norm => ("askgui_norm", ptx::NORM),
        Module::PagedAttention => ("askgui_paged_attention", ptx::PAGED_ATTENTION),
        Module::Rope => ("askgui_rope", ptx::ROPE),
        Module::CrossEntropy => ("askgui_cross_entropy", ptx::CROSS_ENTROPY),
        Module::Dropout => ("askgui_dropout", ptx::DROPOUT),
        Module::Tiling => ("askgui_tiling", ptx::TILING),
    }
}

/// This device's launch limits, for building and checking plans.
pub fn caps(dev: &CudaDevice) -> Result<Caps> {
    let ctx = dev.cuda_stream().context().clone();
    let optin = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN).w()?;
    let threads = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK).w()?;
    Ok(Caps { name: "this GPU", smem_optin: optin.max(0) as usize, max_threads: threads.max(0) as u32 })
}

/// A buffer of a running plan: a view of an input storage, or memory the plan owns.
enum Buf<'a> {
    F32(CudaView<'a, f32>),
    Bf16(CudaView<'a, bf16>),
    U8(CudaView<'a, u8>),
    U32(CudaView<'a, u32>),
    I64(CudaView<'a, i64>),
    OwnF32(CudaSlice<f32>),
    OwnBf16(CudaSlice<bf16>),
    /// Host tables and integer scratch: the kernels only see a pointer, so bytes will do.
    OwnBytes(CudaSlice<u8>),
}

/// A typed view of `b` from element `offset`, to push as a kernel argument.
fn view<'b>(b: &'b Buf<'_>, offset: usize, elem_size: usize) -> Buf<'b> {
    match b {
        Buf::F32(v) => Buf::F32(v.slice(offset..)),
        Buf::Bf16(v) => Buf::Bf16(v.slice(offset..)),
        Buf::U8(v) => Buf::U8(v.slice(offset..)),
        Buf::U32(v) => Buf::U32(v.slice(offset..)),
        Buf::I64(v) => Buf::I64(v.slice(offset..)),
        Buf::OwnF32(s) => Buf::F32(s.slice(offset..)),
        Buf::OwnBf16(s) => Buf::Bf16(s.slice(offset..)),
        Buf::OwnBytes(s) => Buf::U8(s.slice(offset * elem_size..)),
    }
}

/// Input `i`'s `len` elements of `elem` from element `start` of its storage.
fn input<'a>(op: &str, (s, start): (&'a CudaStorage, usize), elem: Elem, len: usize) -> Result<Buf<'a>> {
    let end = start + len;
    macro_rules! take {
        ($slice:expr, $variant:ident) => {{
            if end > $slice.len() {
                bail!(
                    "{op}: an input holds {} elements from {start}, the plan reads {len}",
                    $slice.len() - start.min($slice.len())
                )
            }
            Buf::$variant($slice.slice(start..end))
        }};
    }
    Ok(match (&s.slice, elem) {
        (CudaStorageSlice::F32(x), Elem::F32) => take!(x, F32),
        (CudaStorageSlice::BF16(x), Elem::Bf16) => take!(x, Bf16),
        (CudaStorageSlice::U8(x), Elem::U8) => take!(x, U8),
        (CudaStorageSlice::U32(x), Elem::U32) => take!(x, U32),
        (CudaStorageSlice::I64(x), Elem::I64) => take!(x, I64),
        _ => bail!("{op}: an input is {:?}, the plan reads it as {}", s.dtype(), elem.name()),
    })
}

/// The device address of `b`'s first element. The stream is the one every launch of the plan runs on, so
/// the read is ordered after whatever wrote the buffer.
fn address(b: &Buf<'_>, stream: &std::sync::Arc<CudaStream>) -> u64 {
    match b {
        Buf::F32(v) => v.device_ptr(stream).0,
        Buf::Bf16(v) => v.device_ptr(stream).0,
        Buf::U8(v) => v.device_ptr(stream).0,
        Buf::U32(v) => v.device_ptr(stream).0,
        Buf::I64(v) => v.device_ptr(stream).0,
        Buf::OwnF32(s) => s.device_ptr(stream).0,
        Buf::OwnBf16(s) => s.device_ptr(stream).0,
        Buf::OwnBytes(s) => s.device_ptr(stream).0,
    }
}

fn allocate(dev: &CudaDevice, elem: Elem, len: usize, zeroed: bool) -> Result<Buf<'static>> {
    let n = len.max(1);
    // SAFETY (uninitialised): the plan's contract for `Init::Uninit` is that a launch writes every element
    // before anything reads it; its builders say which kernel does, and the CPU executor fills such
    // buffers with NaN so that a violation shows in the tests.
    Ok(match (elem, zeroed) {
        (Elem::F32, true) => Buf::OwnF32(dev.alloc_zeros::<f32>(n)?),
        (Elem::F32, false) => Buf::OwnF32(unsafe { dev.alloc::<f32>(n)? }),
        (Elem::Bf16, true) => Buf::OwnBf16(dev.alloc_zeros::<bf16>(n)?),
        (Elem::Bf16, false) => Buf::OwnBf16(unsafe { dev.alloc::<bf16>(n)? }),
        (e, true) => Buf::OwnBytes(dev.alloc_zeros::<u8>(n * e.size())?),
        (e, false) => Buf::OwnBytes(unsafe { dev.alloc::<u8>(n * e.size())? }),
    })
}

/// Runs `plan` with `inputs` (each a storage and the element its input starts at) and returns its
/// outputs as storages (f32 or bf16).
pub fn run(dev: &CudaDevice, plan: &Plan, inputs: &[(&CudaStorage, usize)]) -> Result<Vec<CudaStorage>> {
    let op = plan.op;
    plan.check(&caps(dev)?)?;
    if inputs.len() != plan.inputs() {
        bail!("{op}: the plan reads {} inputs, {} given", plan.inputs(), inputs.len())
    }
    let stream = dev.cuda_stream();
    let mut bufs: Vec<Option<Buf>> = Vec::with_capacity(plan.buffers.len());
    for b in &plan.buffers {
        bufs.push(Some(match &b.init {
            Init::Input(i) => input(op, inputs[*i], b.elem, b.len)?,
            Init::Host(bytes) => Buf::OwnBytes(dev.clone_htod(bytes)?),
            Init::Zeroed => allocate(dev, b.elem, b.len, true)?,
            Init::Uninit => allocate(dev, b.elem, b.len, false)?,
            Init::Table(words) => {
                let buf = |i: usize| bufs[i].as_ref().expect("earlier buffers are all there");
                Buf::OwnBytes(dev.clone_htod(&table_bytes(words, |i| address(buf(i), &stream)))?)
            }
        }));
    }
    for l in &plan.launches {
        let (mname, ptx) = module(l.module);
        let func = dev.get_or_load_custom_func(&l.kernel, mname, ptx)?.into_cuda_function();
        if l.shared_bytes > 48 * 1024 {
            let attr = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            func.set_attribute(attr, l.shared_bytes as i32).w()?;
        }
        // Every argument's value first (the builder keeps pointers to them until the launch).
        let mut views = Vec::new();
        let mut words: Vec<Vec<u64>> = Vec::new();
        for a in &l.args {
            match a {
                Arg::Buf { buf, offset } => {
                    let b = bufs[*buf].as_ref().expect("buffers are taken only after the launches");
                    views.push(view(b, *offset, plan.buffers[*buf].elem.size()));
                }
                Arg::Pod { bytes, .. } => words.push(pod_words(bytes)),
                _ => {}
            }
        }
        let (mut vi, mut wi) = (views.iter(), words.iter());
        let mut b = stream.launch_builder(&func);
        for a in &l.args {
            match a {
                Arg::Buf { .. } => match vi.next().expect("one view per buffer argument") {
                    Buf::F32(v) => b.arg(v),
                    Buf::Bf16(v) => b.arg(v),
                    Buf::U8(v) => b.arg(v),
                    Buf::U32(v) => b.arg(v),
                    Buf::I64(v) => b.arg(v),
                    _ => unreachable!("views are never owned"),
                },
                Arg::I32(x) => b.arg(x),
                Arg::U32(x) => b.arg(x),
                Arg::I64(x) => b.arg(x),
                Arg::U64(x) => b.arg(x),
                Arg::F32(x) => b.arg(x),
                // The struct's bytes, 8-byte aligned: CUDA copies the parameter's size from this address.
                Arg::Pod { .. } => b.arg(&wi.next().expect("one word buffer per struct")[0]),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: (l.grid[0], l.grid[1], l.grid[2]),
            block_dim: (l.block[0], l.block[1], l.block[2]),
            shared_mem_bytes: l.shared_bytes,
        };
        // SAFETY: the plan's builders pass each kernel the arguments of its C signature, in order, with
        // buffers sized for every index the kernel forms (the CPU executor checks both against the
        // compiled sources for every plan the tests build); `plan.check` bounded the launch by this
        // device's limits and every input storage was checked to hold what the plan reads.
        unsafe { b.launch(cfg) }.w()?;
    }
    let mut out = Vec::with_capacity(plan.outputs.len());
    for &o in &plan.outputs {
        out.push(match bufs[o].take() {
            Some(Buf::OwnF32(s)) => CudaStorage::wrap_cuda_slice(s, dev.clone()),
            Some(Buf::OwnBf16(s)) => CudaStorage::wrap_cuda_slice(s, dev.clone()),
            _ => bail!("{op}: output `{}` is not an f32 or bf16 buffer of the plan", plan.buffers[o].name),
        });
    }
    Ok(out)
}
