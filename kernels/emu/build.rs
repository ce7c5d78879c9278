// The CPU executor's half of build.rs (feature `cpu-exec`; `include!`d by `kernels/build.rs`): compiles
// every `cuda/*.cu` with the host C++ compiler against `emu/include/cuda_emu.h`, plus the planted-bug
// mutants of the executor's own tests, into one static library with a registry of kernels.
//
// Per `.cu`: a copy in `$OUT_DIR/emu/` where the one construct a host compiler cannot take,
// `extern __shared__ T name[];`, becomes a pointer to the block's dynamic shared memory (`#line` keeps
// the original file name and line numbers in messages); the preprocessor lists its `__global__` kernels;
// a wrapper includes the copy and lists them with their C signatures (`ASKGUI_EMU_KERNEL`).
// `ASKGUI_EMU_SANITIZE=1` builds with AddressSanitizer and UBSan and links the package's tests with them.

use std::fmt::Write as _;

/// Edits of a mutant: `(find, replace)`, each applied once.
type Edits = &'static [(&'static str, &'static str)];

/// A planted bug: module name, the `.cu` it copies, and the exact edits (each must match once, so that a
/// change to the kernels that moves the mutated line fails the build instead of silently testing nothing):
/// the bug itself, then the instantiations the mutant leaves out.
struct Mutant {
    module: &'static str,
    source: &'static str,
    bug: Edits,
    trim: Edits,
}

/// The attention mutants keep only the head-dim-64 instantiations (compile time); `ATTN_F32_64` also drops
/// bf16.
const ATTN_F32_64: Edits = &[
    ("  ASKGUI_ATTENTION(NAME, T, 32)                                                                      \\\n", ""),
    ("  ASKGUI_ATTENTION(NAME, T, 80)                                                                      \\\n", ""),
    ("  ASKGUI_ATTENTION(NAME, T, 96)                                                                      \\\n", ""),
    ("  ASKGUI_ATTENTION(NAME, T, 128)                                                                     \\\n", ""),
    ("ASKGUI_ATTENTION_DTYPE(bf16, __nv_bfloat16)\n", ""),
];

const MUTANTS: &[Mutant] = &[
    // The backward's dV loop reads P^T from shared memory that the next step overwrites with dS^T.
    Mutant {
        module: "attention_missing_barrier",
        source: "attention.cu",
        bug: &[("    __syncthreads();\n\n    // dS = scale * P * (dP - D_i)", "    // mutant: no barrier\n\n    // dS = scale * P * (dP - D_i)")],
        trim: ATTN_F32_64,
    },
    // The forward's row-max shuffle leaves lane 31 out of its own mask.
    Mutant {
        module: "attention_shfl_mask",
        source: "attention.cu",
        bug: &[(
            "      for (int o = 8; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));",
            "      for (int o = 8; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0x7fffffffu, mx, o));",
        )],
        trim: ATTN_F32_64,
    },
    // The tensor-core forward loads its Q fragments one bf16 past a 32-byte boundary.
    Mutant {
        module: "attention_tc_misaligned",
        source: "attention_tc.cu",
        bug: &[(
            "wmma::load_matrix_sync(qa[kk], Qs + warp * 16 * LDH + kk * 16, LDH);",
            "wmma::load_matrix_sync(qa[kk], Qs + warp * 16 * LDH + kk * 16 + 1, LDH);",
        )],
        trim: &[
            ("ASKGUI_ATTENTION_TC(32)\n", ""),
            ("ASKGUI_ATTENTION_TC(80)\n", ""),
            ("ASKGUI_ATTENTION_TC(96)\n", ""),
            ("ASKGUI_ATTENTION_TC(128)\n", ""),
        ],
    },
];

fn emu_build(sources: &[PathBuf], out: &Path) {
    let dir = out.join("emu");
    std::fs::create_dir_all(&dir).expect("create $OUT_DIR/emu");
    for f in ["cuda_emu.h", "cuda_emu_wmma.h", "cuda_emu_registry.h", "cuda_bf16.h", "mma.h"] {
        println!("cargo:rerun-if-changed=emu/include/{f}");
    }
    println!("cargo:rerun-if-changed=emu/runtime.cpp");
    println!("cargo:rerun-if-changed=emu/build.rs");
    println!("cargo:rerun-if-env-changed=ASKGUI_EMU_SANITIZE");
    let sanitize = std::env::var("ASKGUI_EMU_SANITIZE").is_ok_and(|v| v == "1");

    let mut units: Vec<(String, PathBuf, String)> = Vec::new(); // (module, copy, namespace)
    for src in sources {
        let stem = src.file_stem().unwrap().to_string_lossy().to_string();
        let text = std::fs::read_to_string(src).expect("read a .cu source");
        let copy = dir.join(format!("{stem}.cu"));
        std::fs::write(&copy, host_source(&text, &format!("{stem}.cu"))).expect("write the host copy");
        units.push((stem, copy, String::new()));
    }
    // The executor's own tests: kernels that break the execution model on purpose.
    println!("cargo:rerun-if-changed=emu/selftest");
    let selftest = std::fs::read_to_string("emu/selftest/selftest.cu").expect("read emu/selftest/selftest.cu");
    let copy = dir.join("selftest.cu");
    std::fs::write(&copy, host_source(&selftest, "selftest.cu")).expect("write the selftest copy");
    units.push(("selftest".to_string(), copy, String::new()));
    for m in MUTANTS {
        let mdir = dir.join("mutants").join(m.module);
        std::fs::create_dir_all(&mdir).expect("create a mutant dir");
        let mut text = std::fs::read_to_string(Path::new("cuda").join(m.source)).expect("read a mutant's source");
        for (find, replace) in m.bug.iter().chain(m.trim) {
            assert!(
                text.matches(find).count() == 1,
                "mutant {}: the edit target {find:?} is not exactly once in cuda/{}; update kernels/emu/build.rs",
                m.module,
                m.source
            );
            text = text.replacen(find, replace, 1);
        }
        // Internal linkage inside a namespace of its own: the mutant's kernels and templates never collide
        // with the real ones at link time.
        let text = text.replace("extern \"C\" ", "static ");
        let copy = mdir.join(m.source);
        std::fs::write(&copy, host_source(&text, m.source)).expect("write a mutant copy");
        units.push((m.module.to_string(), copy, format!("mutant_{}", m.module)));
    }

    let mut registry = String::from("#include \"cuda_emu.h\"\n");
    let mut modules = String::new();
    let mut wrappers = Vec::new();
    for (module, copy, ns) in &units {
        let kernels = kernel_names(copy, &dir);
        let mut w = String::from("#include \"cuda_emu.h\"\n");
        let (open, close) = if ns.is_empty() { (String::new(), "") } else { (format!("namespace {ns} {{\n"), "}\n") };
        writeln!(w, "{open}#include \"{}\"", copy.display()).unwrap();
        writeln!(w, "static const cuda_emu::KernelEntry entries[] = {{").unwrap();
        for k in &kernels {
            writeln!(w, "  ASKGUI_EMU_KERNEL({k}),").unwrap();
        }
        writeln!(w, "}};\n{close}").unwrap();
        let qual = if ns.is_empty() { String::new() } else { format!("{ns}::") };
        writeln!(
            w,
            "extern \"C\" const cuda_emu::KernelEntry* askgui_emu_module_{module}(size_t* n) {{ *n = {}; return {qual}entries; }}",
            kernels.len()
        )
        .unwrap();
        let path = dir.join(format!("wrap_{module}.cpp"));
        std::fs::write(&path, w).expect("write a wrapper");
        wrappers.push(path);
        writeln!(registry, "extern \"C\" const cuda_emu::KernelEntry* askgui_emu_module_{module}(size_t*);").unwrap();
        writeln!(modules, "    {{\"{module}\", askgui_emu_module_{module}}},").unwrap();
    }
    registry.push_str(&format!(
        r#"struct Module {{ const char* name; const cuda_emu::KernelEntry* (*get)(size_t*); }};
static const Module modules[] = {{
{modules}}};
extern "C" const cuda_emu::KernelEntry* askgui_emu_find(const char* module, const char* kernel) {{
  for (const Module& m : modules) {{
    if (strcmp(m.name, module)) continue;
    size_t n = 0;
    const cuda_emu::KernelEntry* e = m.get(&n);
    for (size_t i = 0; i < n; ++i)
      if (!strcmp(e[i].name, kernel)) return &e[i];
  }}
  return nullptr;
}}
"#
    ));
    let reg = dir.join("registry.cpp");
    std::fs::write(&reg, registry).expect("write the registry");

    let mut b = cc::Build::new();
    b.cpp(true)
        .std("c++20")
        .include("emu/include")
        .include("cuda")
        .flag("-fno-strict-aliasing")
        .flag("-Wno-unused-parameter")
        .flag("-Wno-unused-variable")
        .flag("-Wno-unknown-pragmas")
        .file("emu/runtime.cpp")
        .file(&reg)
        .files(&wrappers);
    if sanitize {
        b.opt_level(1).flag("-fsanitize=address,undefined").flag("-fno-sanitize-recover=undefined");
        b.flag("-fno-omit-frame-pointer");
        // rustc links with -nodefaultlibs, so the runtimes are named; they come after libstdc++ on the
        // link line, so run the tests with ASAN_OPTIONS=verify_asan_link_order=0 (.ci/emu-check does).
        for arg in ["-fsanitize=address,undefined", "-Wl,--no-as-needed", "-lasan", "-lubsan"] {
            println!("cargo:rustc-link-arg-tests={arg}");
        }
    } else {
        b.opt_level(2);
    }
    b.compile("askgui_emu");
}

/// The `.cu` text for the host compiler: `extern __shared__ [__align__(n)] T name[];` becomes
/// `T* const name = (T*)::cuda_emu::dynamic_shared();` on the same line.
fn host_source(text: &str, name: &str) -> String {
    let mut out = format!("#line 1 \"{name}\"\n");
    let mut rest = text;
    while let Some(i) = rest.find("extern __shared__") {
        out.push_str(&rest[..i]);
        let end = rest[i..].find(';').expect("an extern __shared__ declaration ends with ';'") + i;
        let decl = rest[i + "extern __shared__".len()..end].trim();
        let decl = match decl.strip_prefix("__align__(") {
            Some(d) => d[d.find(')').expect("__align__(n)") + 1..].trim(),
            None => decl,
        };
        let decl = decl.strip_suffix("[]").expect("extern __shared__ T name[];").trim();
        let split = decl.rfind(|c: char| c.is_whitespace()).expect("a type and a name");
        let (ty, var) = (decl[..split].trim(), decl[split..].trim());
        write!(out, "{ty}* const {var} = static_cast<{ty}*>(::cuda_emu::dynamic_shared());").unwrap();
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

/// The `__global__` kernels a source defines (most come from macros), read from its preprocessed text.
fn kernel_names(copy: &Path, dir: &Path) -> Vec<String> {
    let expanded = cc::Build::new()
        .cpp(true)
        .std("c++20")
        .include("emu/include")
        .include("cuda")
        .include(dir)
        .define("__global__", "__askgui_kernel__")
        .flag("-x")
        .flag("c++")
        .file(copy)
        .cargo_metadata(false)
        .expand();
    let text = String::from_utf8_lossy(&expanded);
    let mut names = Vec::new();
    let mut rest: &str = &text;
    while let Some(i) = rest.find("__askgui_kernel__") {
        rest = &rest[i + "__askgui_kernel__".len()..];
        let after = rest.trim_start().strip_prefix("void").expect("a __global__ function returns void").trim_start();
        let end = after.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(after.len());
        names.push(after[..end].to_string());
    }
    assert!(!names.is_empty(), "no __global__ kernel found in {}", copy.display());
    names
}
