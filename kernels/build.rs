//! With the `cuda` feature: compiles every `cuda/*.cu` to PTX with nvcc and writes `$OUT_DIR/ptx.rs`,
//! one `pub const NAME: &str` (the PTX text) per file, for `src/cuda.rs` to include.
//!
//! nvcc is `$NVCC`, else `$CUDA_HOME/bin/nvcc` (also `CUDA_PATH`, `CUDA_ROOT`), else `nvcc` on `PATH`. The
//! target is `compute_$CUDA_COMPUTE_CAP` (default 80: PTX for sm_80 is JIT-compiled by the driver for
//! sm_90 too). Without the feature this does nothing, so a plain build needs no CUDA at all.
//!
//! With the `cpu-exec` feature: also compiles the same sources with the host C++ compiler for the CPU
//! executor of the launch plans (`emu/build.rs`, included below).

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=cuda");
    for var in ["NVCC", "CUDA_HOME", "CUDA_PATH", "CUDA_ROOT", "CUDA_COMPUTE_CAP"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let mut sources: Vec<PathBuf> = std::fs::read_dir("cuda")
        .expect("kernels/cuda/ holds the .cu sources")
        .map(|e| e.expect("readable kernels/cuda/").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    sources.sort();
    if std::env::var_os("CARGO_FEATURE_CPU_EXEC").is_some() {
        emu_build(&sources, &out);
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let nvcc = nvcc();
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let cap = cap.trim().replace('.', "");
    let mut consts = String::new();
    for src in &sources {
        println!("cargo:rerun-if-changed={}", src.display());
        let stem = src.file_stem().unwrap().to_string_lossy().to_string();
        let ptx = out.join(format!("{stem}.ptx"));
        compile(&nvcc, src, &ptx, &cap);
        consts.push_str(&format!(
            "/// PTX of `cuda/{stem}.cu`.\npub const {}: &str = include_str!({:?});\n",
            stem.to_uppercase(),
            ptx.display().to_string()
        ));
    }
    std::fs::write(out.join("ptx.rs"), consts).expect("write ptx.rs");
}

fn nvcc() -> PathBuf {
    if let Some(p) = std::env::var_os("NVCC") {
        return p.into();
    }
    for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
        if let Some(home) = std::env::var_os(var) {
            let p = Path::new(&home).join("bin").join("nvcc");
            if p.exists() {
                return p;
            }
        }
    }
    "nvcc".into()
}

fn compile(nvcc: &Path, src: &Path, ptx: &Path, cap: &str) {
    let status = Command::new(nvcc)
        .args(["-ptx", "-O3", "-std=c++17", "-lineinfo", "-Icuda"])
        .arg(format!("-arch=compute_{cap}"))
        .arg(src)
        .arg("-o")
        .arg(ptx)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("nvcc failed ({s}) on {}; its messages are above", src.display()),
        Err(e) => panic!(
            "the `cuda` feature needs nvcc ({}: {e}); set NVCC or CUDA_HOME, or see the README's CUDA section",
            nvcc.display()
        ),
    }
}

include!("emu/build.rs");
