//! The CPU executor of launch plans (feature `cpu-exec`): runs a [`Plan`] with the `cuda/*.cu` kernels
//! compiled by the host C++ compiler (`emu/`, built by build.rs), so that the CUDA path executes, and is
//! checked, on machines with no GPU.
//!
//! Before each launch it checks the plan against the [`Caps`] it runs with (the same check the GPU
//! executor makes) and every argument against the kernel's C signature (kind, size, element type): on a
//! GPU a mismatch is silent memory corruption, here it is an error naming the argument. Buffers are
//! separate allocations of exactly their size (AddressSanitizer sees every overrun); uninitialised ones
//! are filled with 0xff bytes (NaN in f32 and bf16), so an element a kernel forgets to write shows.
//! The C++ side (`emu/runtime.cpp`) checks barriers, warp masks, deadlock, wmma operands and shared
//! memory bounds. Tests: `cargo test -p askgui-kernels --features cpu-exec --test emu`.

use crate::plan::{pod_words, table_bytes, Arg, Caps, Elem, Init, Plan};
use std::alloc::{alloc, dealloc, Layout};
use std::ffi::{c_char, c_void, CStr, CString};
use std::fmt;

/// The order in which a block's threads run between two barriers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    Forward,
    Reverse,
    /// A permutation drawn anew for every block and every round, from the seed.
    Random(u64),
}

/// How to run a plan.
#[derive(Clone, Debug)]
pub struct Options {
    pub caps: Caps,
    pub order: Order,
    /// OS threads that run blocks in parallel.
    pub host_threads: usize,
    /// Run module `.0`'s kernels from the module named `.1` instead (the planted-bug mutants of the tests).
    pub redirect: Option<(crate::plan::Module, &'static str)>,
}

impl Options {
    pub fn new(caps: Caps) -> Self {
        let host_threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        Self { caps, order: Order::Forward, host_threads, redirect: None }
    }
}

/// A plan the executor refused or a launch that failed, with the executor's message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmuError(pub String);

impl fmt::Display for EmuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for EmuError {}

#[repr(C)]
struct ArgSig {
    kind: u32,
    size: u32,
    type_name: *const c_char,
}

#[repr(C)]
struct KernelEntry {
    name: *const c_char,
    nargs: u32,
    args: *const ArgSig,
    invoke: *const c_void,
}

#[repr(C)]
struct EmuLaunch {
    module: *const c_char,
    kernel: *const c_char,
    grid: [u32; 3],
    block: [u32; 3],
    shared_bytes: u64,
    args: *const *mut c_void,
    nargs: u32,
    order: u32,
    seed: u64,
    host_threads: u32,
}

extern "C" {
    fn askgui_emu_find(module: *const c_char, kernel: *const c_char) -> *const KernelEntry;
    fn askgui_emu_launch(launch: *const EmuLaunch, err: *mut c_char, err_len: usize) -> i32;
    fn askgui_emu_sanitized() -> i32;
}

/// Whether the kernels were built with AddressSanitizer and UBSan (`ASKGUI_EMU_SANITIZE=1`): then a
/// memory error aborts the process with the sanitizer's report instead of returning an error.
pub fn sanitized() -> bool {
    // SAFETY: a constant-returning C function.
    unsafe { askgui_emu_sanitized() != 0 }
}

const ARG_POINTER: u32 = 0;
const ARG_INT: u32 = 1;
const ARG_FLOAT: u32 = 2;
const ARG_STRUCT: u32 = 3;

/// One buffer: a separate allocation of exactly `len` bytes, 256-byte aligned as `cudaMalloc`'s.
struct HostBuf {
    ptr: *mut u8,
    len: usize,
}

impl HostBuf {
    const ALIGN: usize = 256;

    /// `len` bytes, each set to `byte`.
    fn filled(len: usize, byte: u8) -> Self {
        let layout = Layout::from_size_align(len.max(1), Self::ALIGN).expect("a buffer size below isize::MAX");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc(layout) };
        assert!(!ptr.is_null(), "out of memory allocating {len} bytes");
        // SAFETY: `ptr` holds `len.max(1)` writable bytes; every one of the `len` used is written here.
        unsafe { std::ptr::write_bytes(ptr, byte, len) };
        Self { ptr, len }
    }

    fn from_bytes(bytes: &[u8]) -> Self {
        let b = Self::filled(bytes.len(), 0);
        // SAFETY: `b` holds `bytes.len()` bytes and does not overlap `bytes`.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), b.ptr, bytes.len()) };
        b
    }

    fn to_vec(&self) -> Vec<u8> {
        // SAFETY: `ptr` holds `len` initialised bytes (filled or copied at creation).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }.to_vec()
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this very layout.
        unsafe { dealloc(self.ptr, Layout::from_size_align(self.len.max(1), Self::ALIGN).expect("as allocated")) };
    }
}

fn sig_name(s: &ArgSig) -> String {
    // SAFETY: the C++ registry's type names are static NUL-terminated strings.
    let t = unsafe { CStr::from_ptr(s.type_name) }.to_string_lossy();
    match s.kind {
        ARG_POINTER => format!("a pointer to {t}"),
        ARG_STRUCT => format!("a struct of {} bytes", s.size),
        _ => format!("{t} ({} bytes)", s.size),
    }
}

/// Checks a plan argument against the kernel's C parameter.
fn check_arg(plan: &Plan, a: &Arg, s: &ArgSig) -> Result<(), String> {
    let (kind, size, name): (u32, usize, String) = match a {
        Arg::Buf { buf, .. } => {
            let e: Elem = plan.buffers[*buf].elem;
            (ARG_POINTER, e.size(), e.name().to_string())
        }
        Arg::I32(_) => (ARG_INT, 4, "i32".into()),
        Arg::U32(_) => (ARG_INT, 4, "u32".into()),
        Arg::I64(_) => (ARG_INT, 8, "i64".into()),
        Arg::U64(_) => (ARG_INT, 8, "u64".into()),
        Arg::F32(_) => (ARG_FLOAT, 4, "f32".into()),
        Arg::Pod { bytes, .. } => (ARG_STRUCT, bytes.len(), "struct".into()),
    };
    // SAFETY: as in `sig_name`.
    let want = unsafe { CStr::from_ptr(s.type_name) }.to_string_lossy();
    if kind != s.kind || size != s.size as usize || (kind != ARG_STRUCT && name != want) {
        let got = match a {
            Arg::Buf { buf, .. } => format!("buffer `{}` of {name}", plan.buffers[*buf].name),
            Arg::Pod { name: n, bytes } => format!("struct {n} of {} bytes", bytes.len()),
            _ => format!("{name} ({size} bytes)"),
        };
        return Err(format!("the plan passes {got}, the kernel's C signature takes {}", sig_name(s)));
    }
    Ok(())
}

/// Runs `plan` on the CPU with `inputs` (the bytes of input 0, 1, ...) and returns its outputs' bytes.
pub fn run(plan: &Plan, inputs: &[&[u8]], opts: &Options) -> Result<Vec<Vec<u8>>, EmuError> {
    let err = |m: String| EmuError(format!("{}: {m}", plan.op));
    plan.check(&opts.caps).map_err(|e| EmuError(e.0))?;
    if inputs.len() != plan.inputs() {
        return Err(err(format!("the plan reads {} inputs, {} given", plan.inputs(), inputs.len())));
    }
    let mut bufs: Vec<HostBuf> = Vec::with_capacity(plan.buffers.len());
    for b in &plan.buffers {
        let bytes = b.len * b.elem.size();
        bufs.push(match &b.init {
            Init::Input(i) if inputs[*i].len() == bytes => HostBuf::from_bytes(inputs[*i]),
            Init::Input(i) => {
                return Err(err(format!(
                    "input {i} (`{}`) has {} bytes, the plan expects {bytes}",
                    b.name,
                    inputs[*i].len()
                )))
            }
            Init::Host(h) if h.len() == bytes => HostBuf::from_bytes(h),
            Init::Host(h) => return Err(err(format!("table `{}` has {} bytes, expected {bytes}", b.name, h.len()))),
            Init::Zeroed => HostBuf::filled(bytes, 0),
            Init::Uninit => HostBuf::filled(bytes, 0xff),
            Init::Table(words) => HostBuf::from_bytes(&table_bytes(words, |i| bufs[i].ptr as u64)),
        });
    }
    for (n, l) in plan.launches.iter().enumerate() {
        let module = match opts.redirect {
            Some((m, to)) if m == l.module => to,
            _ => l.module.name(),
        };
        let at = |m: String| err(format!("launch {n} ({module}::{}): {m}", l.kernel));
        let (cm, ck) = (CString::new(module).expect("no NUL"), CString::new(l.kernel.as_str()).expect("no NUL"));
        // SAFETY: two NUL-terminated strings; the registry returns null or a static entry.
        let entry = unsafe { askgui_emu_find(cm.as_ptr(), ck.as_ptr()).as_ref() }
            .ok_or_else(|| at("no such kernel in the CPU build of the sources".into()))?;
        // SAFETY: the registry's `args` holds `nargs` signatures (static data).
        let sig = unsafe { std::slice::from_raw_parts(entry.args, entry.nargs as usize) };
        if sig.len() != l.args.len() {
            return Err(at(format!("the kernel takes {} arguments, the plan passes {}", sig.len(), l.args.len())));
        }
        // Each argument's value, 8-byte aligned (u64 words), and a pointer to each.
        let mut values: Vec<Vec<u64>> = Vec::with_capacity(l.args.len());
        for (i, (a, s)) in l.args.iter().zip(sig).enumerate() {
            check_arg(plan, a, s).map_err(|m| at(format!("argument {i}: {m}")))?;
            let words = match a {
                Arg::Buf { buf, offset } => {
                    let b = &bufs[*buf];
                    // SAFETY: `offset <= len` (checked by `Plan::check`), so the pointer stays in the allocation.
                    vec![unsafe { b.ptr.add(offset * plan.buffers[*buf].elem.size()) } as u64]
                }
                Arg::I32(v) => vec![*v as u32 as u64],
                Arg::U32(v) => vec![*v as u64],
                Arg::I64(v) => vec![*v as u64],
                Arg::U64(v) => vec![*v],
                Arg::F32(v) => vec![v.to_bits() as u64],
                Arg::Pod { bytes, .. } => pod_words(bytes),
            };
            values.push(words);
        }
        let ptrs: Vec<*mut c_void> = values.iter_mut().map(|w| w.as_mut_ptr() as *mut c_void).collect();
        let (order, seed) = match opts.order {
            Order::Forward => (0, 0),
            Order::Reverse => (1, 0),
            Order::Random(s) => (2, s),
        };
        let launch = EmuLaunch {
            module: cm.as_ptr(),
            kernel: ck.as_ptr(),
            grid: l.grid,
            block: l.block,
            shared_bytes: l.shared_bytes as u64,
            args: ptrs.as_ptr(),
            nargs: ptrs.len() as u32,
            order,
            seed,
            host_threads: opts.host_threads.max(1) as u32,
        };
        let mut msg = vec![0u8; 2048];
        // SAFETY: the launch's arguments were checked against the kernel's signature (each value is a
        // u64-aligned copy of the C type, pointers into live buffers of the checked element type), and the
        // plan check bounds the grid, block and shared bytes; `msg` holds its declared length.
        let rc = unsafe { askgui_emu_launch(&launch, msg.as_mut_ptr() as *mut c_char, msg.len()) };
        if rc != 0 {
            let text = CStr::from_bytes_until_nul(&msg).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
            return Err(at(text));
        }
    }
    Ok(plan.outputs.iter().map(|&o| bufs[o].to_vec()).collect())
}
