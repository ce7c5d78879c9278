// How the CPU executor finds a kernel and checks a launch's arguments (included by cuda_emu.h).
//
// build.rs generates, per kernels/cuda/*.cu, a wrapper that includes the .cu and lists its kernels with
// ASKGUI_EMU_KERNEL(name). Each entry carries a type-erased invoker and the kernel's C signature read from
// its parameter types at compile time (pointer to which element type, integer or float scalar of which
// size, struct of which size), so the Rust side can refuse an argument of the wrong kind or size: on a
// GPU such a mismatch is silent memory corruption.
#pragma once

namespace cuda_emu {

enum ArgKind : uint32_t { ARG_POINTER = 0, ARG_INT = 1, ARG_FLOAT = 2, ARG_STRUCT = 3 };

// One kernel parameter: its kind, its size in bytes (of the pointee for pointers), and a type name.
struct ArgSig {
  uint32_t kind;
  uint32_t size;
  const char* type;
};

template <class T>
constexpr const char* type_name() {
  if constexpr (std::is_same_v<T, float>) return "f32";
  else if constexpr (std::is_same_v<T, double>) return "f64";
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return "bf16";
  else if constexpr (std::is_same_v<T, uint8_t>) return "u8";
  else if constexpr (std::is_same_v<T, int>) return "i32";
  else if constexpr (std::is_same_v<T, unsigned>) return "u32";
  else if constexpr (std::is_same_v<T, long long>) return "i64";
  else if constexpr (std::is_same_v<T, unsigned long long>) return "u64";
  else return "struct";
}

template <class A>
constexpr ArgSig sig_of() {
  using T = std::remove_cv_t<A>;
  if constexpr (std::is_pointer_v<T>) {
    using E = std::remove_cv_t<std::remove_pointer_t<T>>;
    return ArgSig{ARG_POINTER, uint32_t(sizeof(E)), type_name<E>()};
  } else if constexpr (std::is_integral_v<T>) {
    return ArgSig{ARG_INT, uint32_t(sizeof(T)), type_name<T>()};
  } else if constexpr (std::is_floating_point_v<T>) {
    return ArgSig{ARG_FLOAT, uint32_t(sizeof(T)), type_name<T>()};
  } else {
    static_assert(std::is_trivially_copyable_v<T>, "kernel parameters are trivially copyable");
    return ArgSig{ARG_STRUCT, uint32_t(sizeof(T)), "struct"};
  }
}

struct KernelEntry {
  const char* name;
  uint32_t nargs;
  const ArgSig* args;
  void (*invoke)(void* const* args);
};

template <auto F>
struct Kernel;

template <class... A, void (*F)(A...)>
struct Kernel<F> {
  static constexpr ArgSig sig[sizeof...(A) > 0 ? sizeof...(A) : 1] = {sig_of<A>()...};
  template <size_t... I>
  static void call(void* const* args, std::index_sequence<I...>) {
    F(*static_cast<std::remove_cv_t<A>*>(args[I])...);
  }
  static void invoke(void* const* args) { call(args, std::index_sequence_for<A...>{}); }
  static constexpr KernelEntry entry(const char* name) { return KernelEntry{name, sizeof...(A), sig, invoke}; }
};

}  // namespace cuda_emu

#define ASKGUI_EMU_KERNEL(name) ::cuda_emu::Kernel<&name>::entry(#name)
