// The scheduler of the CPU executor: runs one kernel launch (grid, block, dynamic shared bytes, arguments)
// with every CUDA thread as a fiber and every block on an OS thread of a small pool.
//
// A fiber runs until it reaches a barrier (__syncthreads, or a warp collective: __syncwarp, a shuffle, a
// wmma mma or store) or returns; it never switches anywhere else. When every fiber of the block is waiting
// or done, the scheduler resolves what can be resolved: a warp collective once every lane of its mask waits
// at it, __syncthreads once every thread of the block does. Nothing resolvable while threads still wait
// is a deadlock. Between barriers the order in which fibers run is forward, reverse or seeded random, so
// that a missing barrier cannot hide behind one fixed order. Dynamic shared memory is a fresh allocation of
// exactly the launch's size per block, filled with 0xff bytes (NaN in f32 and bf16): under AddressSanitizer
// any byte past it is poisoned; without it, a canary after it catches writes past the end.
//
// Errors (a sanitizer finding, a wrong launch) fail the launch with a message naming the block, the thread
// and the source line; the first one is reported and the remaining blocks are skipped.
#include "cuda_emu.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

// The context switch between the scheduler and a fiber. On x86-64 a few instructions that save the
// callee-saved registers and the FP control words on the old stack and swap stack pointers: no system
// call (glibc's swapcontext saves the signal mask with one) and nothing for AddressSanitizer to intercept
// (its swapcontext interceptor clears the whole new stack's shadow at every switch, which made a
// sanitized run 40x slower). Elsewhere, ucontext.
#if defined(__x86_64__)
#define EMU_ASM_SWITCH 1
extern "C" void askgui_emu_switch(void** save_sp, void* new_sp);
asm(R"(
  .text
  .globl askgui_emu_switch
  .type askgui_emu_switch, @function
askgui_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size askgui_emu_switch, .-askgui_emu_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");
#else
#define EMU_ASM_SWITCH 0
#endif

namespace cuda_emu {
namespace {

enum class Wait { Run, Sync, Warp, Exited };

// A saved execution context: a stack pointer (x86-64) or a ucontext.
struct Context {
#if EMU_ASM_SWITCH
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
};

inline void switch_context(Context* from, Context* to) {
#if EMU_ASM_SWITCH
  askgui_emu_switch(&from->sp, to->sp);
#else
  swapcontext(&from->uc, &to->uc);
#endif
}

constexpr size_t STACK_BYTES = 512 * 1024;
constexpr size_t CANARY_BYTES = 256;
constexpr unsigned char CANARY = 0xa5;

struct Fiber {
  Context ctx;
  void* stack = nullptr;
  dim3 tid{0, 0, 0};
  int linear = 0;
  Wait wait = Wait::Exited;
  const char* file = nullptr;
  int line = 0;
  WarpOp* op = nullptr;
  void* fake = nullptr;  // AddressSanitizer's fake stack of this fiber while it is switched out
};

struct Launch {
  const KernelEntry* kernel;
  void* const* args;
  dim3 grid, block;
  size_t shared;
  uint32_t order;  // 0 forward, 1 reverse, 2 seeded random
  uint64_t seed;
  std::atomic<uint64_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::string error;

  void set_error(const std::string& e) {
    std::lock_guard<std::mutex> g(mu);
    if (!failed.exchange(true)) error = e;
  }
};

// One OS thread of the pool: the block it runs and that block's fibers.
struct Worker {
  Launch* launch = nullptr;
  dim3 bidx{0, 0, 0};
  std::vector<Fiber> fibers;
  Fiber* cur = nullptr;
  Context sched;
  unsigned char* smem = nullptr;
  bool block_failed = false;
  const void* sched_bottom = nullptr;
  size_t sched_size = 0;
  bool abandoned = false;  // a fiber was left mid-frame: its stack may still carry ASan poison

  ~Worker() {
    for (Fiber& f : fibers)
      if (f.stack) munmap(f.stack, STACK_BYTES);
  }
};

thread_local Worker* tw = nullptr;

inline void asan_start(void** save, const void* bottom, size_t size) {
#if EMU_ASAN
  __sanitizer_start_switch_fiber(save, bottom, size);
#else
  (void)save, (void)bottom, (void)size;
#endif
}
inline void asan_finish(void* save, const void** bottom, size_t* size) {
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(save, bottom, size);
#else
  (void)save, (void)bottom, (void)size;
#endif
}

std::string where(const Worker* w, const Fiber* f) {
  char buf[160];
  snprintf(buf, sizeof buf, "block (%u,%u,%u) thread (%u,%u,%u) (warp %d lane %d)", w->bidx.x, w->bidx.y, w->bidx.z,
           f->tid.x, f->tid.y, f->tid.z, f->linear / 32, f->linear % 32);
  return buf;
}

std::string describe_wait(const Fiber& f) {
  char buf[200];
  switch (f.wait) {
    case Wait::Sync: snprintf(buf, sizeof buf, "__syncthreads at %s:%d", f.file, f.line); break;
    case Wait::Warp: snprintf(buf, sizeof buf, "%s at %s:%d (mask 0x%08x)", f.op->name, f.op->file, f.op->line, f.op->mask); break;
    case Wait::Exited: snprintf(buf, sizeof buf, "exited"); break;
    case Wait::Run: snprintf(buf, sizeof buf, "running"); break;
  }
  return buf;
}

// Back to the scheduler; returns when the scheduler resumes this fiber.
void yield(Worker* w, Fiber* f) {
  asan_start(&f->fake, w->sched_bottom, w->sched_size);
  switch_context(&f->ctx, &w->sched);
  asan_finish(f->fake, &w->sched_bottom, &w->sched_size);
}

void fiber_entry() {
  Worker* w = tw;
  Fiber* f = w->cur;
  asan_finish(nullptr, &w->sched_bottom, &w->sched_size);
  w->launch->kernel->invoke(w->launch->args);
  f->wait = Wait::Exited;
  asan_start(nullptr, w->sched_bottom, w->sched_size);  // this fiber is done for good
  switch_context(&f->ctx, &w->sched);
  abort();  // unreachable: an exited fiber is never resumed
}

// A fresh context that starts `fiber_entry` on the fiber's own stack.
void init_context(Fiber* f) {
#if EMU_ASM_SWITCH
  // The frame askgui_emu_switch pops: control words, six registers, then the return address. After the
  // `ret` the stack pointer is 8 mod 16, as at any function entry.
  uintptr_t top = (reinterpret_cast<uintptr_t>(f->stack) + STACK_BYTES) & ~uintptr_t(15);
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 72);
  uint32_t csr[2];
  asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(csr[0]), "=m"(csr[1]));
  memcpy(&sp[0], csr, 8);
  for (int i = 1; i <= 6; ++i) sp[i] = 0;
  sp[7] = reinterpret_cast<uint64_t>(&fiber_entry);
  f->ctx.sp = sp;
#else
  getcontext(&f->ctx.uc);
  f->ctx.uc.uc_stack.ss_sp = f->stack;
  f->ctx.uc.uc_stack.ss_size = STACK_BYTES;
  f->ctx.uc.uc_link = nullptr;
  makecontext(&f->ctx.uc, fiber_entry, 0);
#endif
}

void resume(Worker* w, Fiber* f) {
  w->cur = f;
  void* fake = nullptr;
  asan_start(&fake, f->stack, STACK_BYTES);
  switch_context(&w->sched, &f->ctx);
  asan_finish(fake, nullptr, nullptr);
  w->cur = nullptr;
}

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void block_error(Worker* w, const std::string& e) {
  w->block_failed = true;
  w->launch->set_error(e);
}

// Resolves the warp collectives whose lanes have all arrived. Returns whether any was resolved.
bool resolve_warps(Worker* w) {
  const int n = int(w->fibers.size());
  bool progress = false;
  for (int warp = 0; warp * 32 < n && !w->block_failed; ++warp) {
    for (int l = 0; l < 32 && warp * 32 + l < n; ++l) {
      Fiber& lead = w->fibers[warp * 32 + l];
      if (lead.wait != Wait::Warp) continue;
      const WarpOp* op = lead.op;
      WarpOp* lanes[32] = {};
      bool ready = true;
      for (int b = 0; b < 32; ++b) {
        if (!(op->mask >> b & 1u)) continue;
        const int t = warp * 32 + b;
        char buf[400];
        if (t >= n) {
          snprintf(buf, sizeof buf, "%s: %s at %s:%d names lane %d in mask 0x%08x, but the block has %d threads",
                   where(w, &lead).c_str(), op->name, op->file, op->line, b, op->mask, n);
          block_error(w, buf);
          return false;
        }
        Fiber& f = w->fibers[t];
        if (f.wait == Wait::Exited) {
          snprintf(buf, sizeof buf, "%s: %s at %s:%d waits for lane %d (mask 0x%08x), which has exited: deadlock",
                   where(w, &lead).c_str(), op->name, op->file, op->line, b, op->mask);
          block_error(w, buf);
          return false;
        }
        if (f.wait != Wait::Warp) {
          ready = false;
          continue;
        }
        const WarpOp* o = f.op;
        if (o->mask != op->mask || strcmp(o->name, op->name) || o->line != op->line || strcmp(o->file, op->file)) {
          snprintf(buf, sizeof buf, "divergent warp collective: %s waits at %s; %s waits at %s",
                   where(w, &lead).c_str(), describe_wait(lead).c_str(), where(w, &f).c_str(),
                   describe_wait(f).c_str());
          block_error(w, buf);
          return false;
        }
        lanes[b] = f.op;
      }
      if (!ready) continue;
      if (const char* e = op->resolve(lanes)) {
        block_error(w, where(w, &lead) + ": " + e + " (at " + op->file + ":" + std::to_string(op->line) + ")");
        return false;
      }
      for (int b = 0; b < 32; ++b)
        if (lanes[b]) w->fibers[warp * 32 + b].wait = Wait::Run;
      progress = true;
    }
  }
  return progress;
}

// Releases __syncthreads once every thread of the block waits at the same one.
bool resolve_block_barrier(Worker* w) {
  int live = 0, at_sync = 0;
  const Fiber* first = nullptr;
  const Fiber* exited = nullptr;
  for (const Fiber& f : w->fibers) {
    if (f.wait == Wait::Exited) {
      exited = exited ? exited : &f;
      continue;
    }
    ++live;
    if (f.wait == Wait::Sync) {
      ++at_sync;
      first = first ? first : &f;
    }
  }
  if (live == 0 || at_sync != live) return false;
  char buf[400];
  if (exited) {
    snprintf(buf, sizeof buf, "__syncthreads at %s:%d reached by %d threads after %s exited: the barrier would hang",
             first->file, first->line, live, where(w, exited).c_str());
    block_error(w, buf);
    return false;
  }
  for (const Fiber& f : w->fibers)
    if (f.line != first->line || strcmp(f.file, first->file)) {
      snprintf(buf, sizeof buf, "divergent __syncthreads: %s waits at %s:%d, %s at %s:%d", where(w, first).c_str(),
               first->file, first->line, where(w, &f).c_str(), f.file, f.line);
      block_error(w, buf);
      return false;
    }
  for (Fiber& f : w->fibers) f.wait = Wait::Run;
  return true;
}

void deadlock(Worker* w) {
  std::string msg = "deadlock: no barrier can complete;";
  int shown = 0;
  for (const Fiber& f : w->fibers) {
    if (f.wait == Wait::Exited) continue;
    if (shown++ == 4) {
      msg += " ...";
      break;
    }
    msg += " " + where(w, &f) + " waits at " + describe_wait(f) + ";";
  }
  block_error(w, msg);
}

void run_block(Worker* w, uint64_t linear_block) {
  Launch* L = w->launch;
  w->bidx = dim3{unsigned(linear_block % L->grid.x), unsigned(linear_block / L->grid.x % L->grid.y),
                 unsigned(linear_block / L->grid.x / L->grid.y)};
  w->block_failed = false;
  const size_t guard = EMU_ASAN ? 0 : CANARY_BYTES;
  void* mem = nullptr;
  if (posix_memalign(&mem, 128, L->shared + guard) != 0) {
    block_error(w, "cannot allocate " + std::to_string(L->shared) + " bytes of dynamic shared memory");
    return;
  }
  w->smem = static_cast<unsigned char*>(mem);
  memset(w->smem, 0xff, L->shared);
  memset(w->smem + L->shared, CANARY, guard);
  for (Fiber& f : w->fibers) {
#if EMU_ASAN
    if (w->abandoned) ASAN_UNPOISON_MEMORY_REGION(f.stack, STACK_BYTES);
#endif
    init_context(&f);
    f.wait = Wait::Run;
  }
  w->abandoned = false;
  const int n = int(w->fibers.size());
  std::vector<int> order(n);
  uint64_t rng = L->seed ^ (linear_block * 0x9e3779b97f4a7c15ull);
  while (!w->block_failed && !L->failed.load(std::memory_order_relaxed)) {
    for (int i = 0; i < n; ++i) order[i] = L->order == 1 ? n - 1 - i : i;
    if (L->order == 2)
      for (int i = n - 1; i > 0; --i) std::swap(order[i], order[splitmix(rng) % uint64_t(i + 1)]);
    for (int i : order) {
      Fiber& f = w->fibers[i];
      if (f.wait == Wait::Run) resume(w, &f);
      if (w->block_failed) break;
    }
    if (w->block_failed) break;
    const bool warps = resolve_warps(w);
    if (w->block_failed) break;
    const bool block = resolve_block_barrier(w);
    if (w->block_failed || warps || block) continue;
    bool all_done = true;
    for (const Fiber& f : w->fibers) all_done = all_done && f.wait == Wait::Exited;
    if (!all_done) deadlock(w);
    break;
  }
  for (size_t i = 0; i < guard && !w->block_failed; ++i)
    if (w->smem[L->shared + i] != CANARY) {
      char buf[200];
      snprintf(buf, sizeof buf,
               "block (%u,%u,%u) wrote dynamic shared memory past the launch's %zu bytes (byte %zu after its end)",
               w->bidx.x, w->bidx.y, w->bidx.z, L->shared, i);
      block_error(w, buf);
    }
  free(w->smem);
  w->smem = nullptr;
}

void worker_main(Launch* L) {
  Worker w;
  tw = &w;
  w.launch = L;
  const unsigned threads = L->block.x * L->block.y * L->block.z;
  w.fibers.resize(threads);
  for (unsigned t = 0; t < threads; ++t) {
    Fiber& f = w.fibers[t];
    f.linear = int(t);
    f.tid = dim3{t % L->block.x, t / L->block.x % L->block.y, t / L->block.x / L->block.y};
    f.stack = mmap(nullptr, STACK_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (f.stack == MAP_FAILED) {
      f.stack = nullptr;
      L->set_error("cannot map a fiber stack");
      tw = nullptr;
      return;
    }
#if EMU_ASAN
    // Fresh pages may sit where an exited thread's stack was, whose shadow can still hold its poison.
    ASAN_UNPOISON_MEMORY_REGION(f.stack, STACK_BYTES);
#endif
  }
  const uint64_t blocks = uint64_t(L->grid.x) * L->grid.y * L->grid.z;
  for (uint64_t b; !L->failed.load() && (b = L->next.fetch_add(1)) < blocks;) run_block(&w, b);
  tw = nullptr;
}

}  // namespace

const dim3& thread_idx() { return tw->cur->tid; }
const dim3& block_idx() { return tw->bidx; }
const dim3& block_dim() { return tw->launch->block; }
const dim3& grid_dim() { return tw->launch->grid; }
int lane_id() { return tw->cur->linear % 32; }
void* dynamic_shared() { return tw->smem; }

void syncthreads(const char* file, int line) {
  Fiber* f = tw->cur;
  f->wait = Wait::Sync;
  f->file = file;
  f->line = line;
  yield(tw, f);
}

void warp_op(WarpOp* op) {
  Worker* w = tw;
  Fiber* f = w->cur;
  if (!(op->mask >> (f->linear % 32) & 1u))
    fail("%s at %s:%d: mask 0x%08x excludes the calling lane %d", op->name, op->file, op->line, op->mask,
         f->linear % 32);
  f->wait = Wait::Warp;
  f->op = op;
  yield(w, f);
}

void fail(const char* fmt, ...) {
  Worker* w = tw;
  Fiber* f = w->cur;
  char buf[600];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  block_error(w, where(w, f) + ": " + buf);
  f->wait = Wait::Exited;
  asan_start(nullptr, w->sched_bottom, w->sched_size);  // abandoned: never resumed
  w->abandoned = true;
  switch_context(&f->ctx, &w->sched);
  abort();  // unreachable: the scheduler never resumes a failed fiber
}

const char* resolve_shfl_xor(WarpOp* const* lanes) {
  for (int l = 0; l < 32; ++l) {
    if (!lanes[l]) continue;
    ShflOp* op = static_cast<ShflOp*>(lanes[l]);
    if (op->width <= 0 || op->width > 32 || (op->width & (op->width - 1)))
      return "__shfl_xor_sync: width must be a power of two between 1 and 32";
    const int src = l ^ op->lane_mask;
    // As CUDA: a source outside the caller's width segment returns the caller's own value.
    if (src / op->width != l / op->width || src >= 32) {
      op->result = op->bits;
      continue;
    }
    if (!lanes[src]) return "__shfl_xor_sync reads a lane outside the mask (undefined on a GPU)";
    op->result = static_cast<ShflOp*>(lanes[src])->bits;
  }
  return nullptr;
}

}  // namespace cuda_emu

namespace nvcuda {
namespace wmma {
namespace detail {

const char* resolve_store(cuda_emu::WarpOp* const* lanes) {
  if (lanes[0] == nullptr || lanes[0]->mask != 0xffffffffu) return "wmma::store_matrix_sync needs all 32 lanes";
  const StoreOp* o = static_cast<const StoreOp*>(lanes[0]);
  for (int l = 1; l < 32; ++l) {
    const StoreOp* p = static_cast<const StoreOp*>(lanes[l]);
    if (p->p != o->p || p->ldm != o->ldm || p->col != o->col)
      return "wmma::store_matrix_sync: lanes store to different tiles";
    if (memcmp(p->f->x, o->f->x, sizeof(o->f->x)))
      return "wmma::store_matrix_sync: lanes hold different accumulator fragments";
  }
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) at(o->p, o->ldm, r, c, o->col) = NAN;
  return nullptr;
}

}  // namespace detail
}  // namespace wmma
}  // namespace nvcuda

// One launch, as the Rust executor describes it.
struct EmuLaunch {
  const char* module;
  const char* kernel;
  uint32_t grid[3];
  uint32_t block[3];
  uint64_t shared_bytes;
  void* const* args;
  uint32_t nargs;
  uint32_t order;
  uint64_t seed;
  uint32_t host_threads;
};

extern "C" const cuda_emu::KernelEntry* askgui_emu_find(const char* module, const char* kernel);

// Runs a launch to completion; returns 0, or 1 with the first error in `err`.
extern "C" int askgui_emu_launch(const EmuLaunch* l, char* err, size_t err_len) {
  auto error = [&](const std::string& e) {
    snprintf(err, err_len, "%s", e.c_str());
    return 1;
  };
  const cuda_emu::KernelEntry* k = askgui_emu_find(l->module, l->kernel);
  if (!k) return error(std::string("no kernel ") + l->kernel + " in module " + l->module);
  if (l->nargs != k->nargs)
    return error(std::string(l->kernel) + " takes " + std::to_string(k->nargs) + " arguments, the launch passes " +
                 std::to_string(l->nargs));
  const uint64_t threads = uint64_t(l->block[0]) * l->block[1] * l->block[2];
  const uint64_t blocks = uint64_t(l->grid[0]) * l->grid[1] * l->grid[2];
  if (threads == 0 || blocks == 0) return error(std::string(l->kernel) + ": an empty grid or block");
  cuda_emu::Launch L;
  L.kernel = k;
  L.args = l->args;
  L.grid = dim3{l->grid[0], l->grid[1], l->grid[2]};
  L.block = dim3{l->block[0], l->block[1], l->block[2]};
  L.shared = l->shared_bytes;
  L.order = l->order;
  L.seed = l->seed;
  const uint64_t pool = std::min<uint64_t>(std::max<uint32_t>(l->host_threads, 1), blocks);
  std::vector<std::thread> workers;
  for (uint64_t i = 1; i < pool; ++i) workers.emplace_back(cuda_emu::worker_main, &L);
  cuda_emu::worker_main(&L);
  for (auto& t : workers) t.join();
  if (L.failed) return error(std::string(l->kernel) + ": " + L.error);
  return 0;
}

// Whether this build runs under AddressSanitizer (then an overrun aborts the process with its report).
extern "C" int askgui_emu_sanitized() { return EMU_ASAN; }
