// The shim's scheduler: a pool of OS threads takes blocks in turn, and each
// runs its block's threads as fibers from one synchronization point to the
// next, checking that every barrier and shuffle is reached by the threads that
// must reach it.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "cuda_runtime.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#if defined(__x86_64__)
// Saves the callee-saved registers, the floating-point control words and the
// stack pointer on the current stack and in *save, then loads them from `load`:
// the System V ABI's whole state across a call. glibc's swapcontext also saves
// and restores the signal mask, a system call per switch that took most of the
// shim's time.
extern "C" void cuda_shim_switch(void** save, void* load);
asm(R"(
  .text
  .globl cuda_shim_switch
  .type cuda_shim_switch, @function
cuda_shim_switch:
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
  .size cuda_shim_switch, .-cuda_shim_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");
#endif

namespace cuda_shim {
namespace {

#if defined(__SANITIZE_ADDRESS__)
// Room for ASan's redzones, and no more: ASan clears a fiber's whole stack
// shadow at each switch (256 KiB took twice the CPU time of the quick run).
constexpr std::size_t kStackBytes = 96 << 10;
#else
constexpr std::size_t kStackBytes = 64 << 10;
#endif
constexpr unsigned kMaxBlockThreads = 1024;
constexpr unsigned kMaxGrid = 0x7fffffffu;

enum class State { kReady, kBarrier, kShuffle, kExited };
constexpr int kBallot = -1;  // a warp operation that ORs each lane's predicate into bit `lane`

// Where a suspended fiber (or the scheduler) resumes.
struct Context {
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t context;
#endif
};

struct Fiber {
  Context context;
  Coordinates coordinates;
  State state = State::kReady;
  unsigned mask = 0;
  int source = 0;         // the lane a shuffle reads; kBallot for a ballot
  uint32_t accesses = 0;  // global accesses so far (the access log's sequence)
  uint64_t value = 0;
};

// One OS thread's block in flight.
struct Block {
  std::vector<Fiber> fibers;
  std::unique_ptr<char[]> stacks;
  Context scheduler;
  const void* thread_stack = nullptr;  // the OS thread's stack, for ASan's switch notes
  std::size_t thread_stack_bytes = 0;
  Fiber* current = nullptr;
  Body body = nullptr;
  void* context = nullptr;
};

thread_local Block* t_block = nullptr;
thread_local cudaError_t t_error = cudaSuccess;
std::atomic<std::vector<Access>*> g_log{nullptr};
std::mutex g_log_mutex;
std::atomic<uint32_t> g_launches{0};

Block& block_of_caller(const char* what) {
  if (t_block == nullptr || t_block->current == nullptr) {
    std::fprintf(stderr, "cuda_shim: %s called outside a kernel\n", what);
    fail("device code on the host");
  }
  return *t_block;
}

char* stack_of(Block& block, const Fiber& f) {
  return block.stacks.get() + (&f - block.fibers.data()) * kStackBytes;
}

// Switches from `from` to `to`, whose stack is [stack, stack + bytes); tells
// AddressSanitizer, which must know which stack runs.
void switch_context(Context& from, Context& to, const void* stack, std::size_t bytes) {
#if defined(__SANITIZE_ADDRESS__)
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(&fake_stack, stack, bytes);
#else
  (void)stack, (void)bytes;
#endif
#if defined(__x86_64__)
  cuda_shim_switch(&from.sp, to.sp);
#else
  swapcontext(&from.context, &to.context);
#endif
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
}

void to_scheduler(Block& block, Fiber& self) {
  switch_context(self.context, block.scheduler, block.thread_stack, block.thread_stack_bytes);
}

void fiber_main() {
  Block& block = *t_block;
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(nullptr, &block.thread_stack, &block.thread_stack_bytes);
#endif
  block.body(block.context);
  block.current->state = State::kExited;
  to_scheduler(block, *block.current);
  fail("an exited fiber ran again");
}

// A fiber that starts in fiber_main on its own stack.
void start_fiber(Block& block, Fiber& f) {
  char* stack = stack_of(block, f);
#if defined(__x86_64__)
  // What cuda_shim_switch pops, from the stack's top down: a zero return address
  // for fiber_main (entered as if called, the stack 16-byte aligned minus 8),
  // fiber_main as the address `ret` goes to, six zero registers, and the
  // caller's floating-point control words.
  auto* sp = reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(stack) + kStackBytes) &
                                         ~uintptr_t{15});
  *--sp = 0;
  *--sp = reinterpret_cast<uint64_t>(&fiber_main);
  for (int r = 0; r < 6; ++r) *--sp = 0;
  uint32_t control[2] = {};
  asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(control[0]), "=m"(control[1]));
  std::memcpy(--sp, control, sizeof control);
  f.context.sp = sp;
#else
  getcontext(&f.context.context);
  f.context.context.uc_stack.ss_sp = stack;
  f.context.context.uc_stack.ss_size = kStackBytes;
  f.context.context.uc_link = nullptr;
  makecontext(&f.context.context, fiber_main, 0);
#endif
}

// Suspends the calling fiber at a synchronization point.
void wait_at(Block& block, State state) {
  Fiber& self = *block.current;
  self.state = state;
  to_scheduler(block, self);
}

const char* describe(State state) {
  switch (state) {
    case State::kReady:
      return "ready";
    case State::kBarrier:
      return "at __syncthreads";
    case State::kShuffle:
      return "at a shuffle";
    case State::kExited:
      return "exited";
  }
  return "?";
}

[[noreturn]] void fail_in_block(const Block& block, const char* what) {
  const Fiber& f = block.fibers.front();
  std::fprintf(stderr, "cuda_shim: block %u: %s\n", f.coordinates.block_idx.x, what);
  for (std::size_t t = 0; t < block.fibers.size(); t += 32) {
    std::fprintf(stderr, "  warp %zu:", t / 32);
    for (std::size_t l = t; l < std::min(t + 32, block.fibers.size()); ++l)
      std::fprintf(stderr, " %c", describe(block.fibers[l].state)[0]);
    std::fprintf(stderr, "\n");
  }
  fail(what);
}

// Completes the shuffle of every warp whose participating lanes have all
// arrived. Returns whether any fiber can run again.
bool resolve_shuffles(Block& block) {
  bool progress = false;
  const std::size_t threads = block.fibers.size();
  for (std::size_t warp = 0; warp < threads; warp += 32) {
    Fiber* lanes = &block.fibers[warp];
    const std::size_t width = std::min<std::size_t>(32, threads - warp);
    unsigned mask = 0;
    bool any = false;
    for (std::size_t l = 0; l < width; ++l) {
      if (lanes[l].state != State::kShuffle) continue;
      if (any && lanes[l].mask != mask) fail_in_block(block, "lanes shuffle with different masks");
      if ((lanes[l].mask >> l & 1u) == 0)
        fail_in_block(block, "a lane shuffles with a mask that leaves it out");
      mask = lanes[l].mask;
      any = true;
    }
    if (!any) continue;
    bool complete = true;
    for (std::size_t l = 0; l < 32; ++l) {
      if ((mask >> l & 1u) == 0) continue;
      if (l >= width) fail_in_block(block, "a shuffle mask names lanes the block does not have");
      if (lanes[l].state == State::kExited)
        fail_in_block(block, "a shuffle waits for lanes of its mask that have exited");
      complete &= lanes[l].state == State::kShuffle;
    }
    if (!complete) continue;
    uint64_t result[32], ballot = 0;
    int kind = 0;  // 1 for shuffles, 2 for ballots
    for (std::size_t l = 0; l < width; ++l) {
      if (lanes[l].state != State::kShuffle) continue;
      if ((kind |= lanes[l].source == kBallot ? 2 : 1) == 3)
        fail_in_block(block, "lanes of a warp meet at a shuffle and a ballot");
      if (lanes[l].value != 0) ballot |= uint64_t{1} << l;
    }
    for (std::size_t l = 0; l < width; ++l) {
      if (lanes[l].state != State::kShuffle) continue;
      if (lanes[l].source == kBallot) {
        result[l] = ballot;
        continue;
      }
      const std::size_t source = static_cast<unsigned>(lanes[l].source);
      if (source >= 32 || (mask >> source & 1u) == 0)
        fail_in_block(block, "a shuffle reads a lane outside its mask");
      result[l] = lanes[source].value;
    }
    for (std::size_t l = 0; l < width; ++l) {
      if (lanes[l].state != State::kShuffle) continue;
      lanes[l].value = result[l];
      lanes[l].state = State::kReady;
    }
    progress = true;
  }
  return progress;
}

// Releases __syncthreads once every thread of the block waits at it.
bool resolve_barrier(Block& block) {
  std::size_t waiting = 0, exited = 0;
  for (const Fiber& f : block.fibers) {
    if (f.state == State::kBarrier) ++waiting;
    if (f.state == State::kExited) ++exited;
  }
  if (waiting == 0 || waiting + exited < block.fibers.size()) return false;
  if (exited > 0) fail_in_block(block, "divergent __syncthreads: some threads exited, others wait");
  for (Fiber& f : block.fibers) f.state = State::kReady;
  return true;
}

void run_block(Block& block, dim3 grid, dim3 shape, unsigned block_index) {
  const unsigned threads = shape.x;
  for (unsigned t = 0; t < threads; ++t) {
    Fiber& f = block.fibers[t];
    f = Fiber{};
    f.coordinates = {{t, 0, 0}, {block_index, 0, 0}, {shape.x, 1, 1}, {grid.x, 1, 1}};
    start_fiber(block, f);
  }
  const bool reverse = device().reverse;
  for (;;) {
    bool live = false;
    for (unsigned i = 0; i < threads; ++i) {
      Fiber& f = block.fibers[reverse ? threads - 1 - i : i];
      if (f.state != State::kReady) continue;
      block.current = &f;
      switch_context(block.scheduler, f.context, stack_of(block, f), kStackBytes);
      block.current = nullptr;
    }
    for (const Fiber& f : block.fibers) live |= f.state != State::kExited;
    if (!live) return;
    if (resolve_shuffles(block) || resolve_barrier(block)) continue;
    fail_in_block(block, "deadlock: no thread can reach its next synchronization point");
  }
}

}  // namespace

void fail(const char* what) {
  std::fprintf(stderr, "cuda_shim: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

Device& device() {
  static Device d;
  return d;
}

void set_error(cudaError_t error) { t_error = error; }

cudaError_t take_error() { return std::exchange(t_error, cudaSuccess); }

const Coordinates& coordinates() { return block_of_caller("threadIdx").current->coordinates; }

void sync_block() { wait_at(block_of_caller("__syncthreads"), State::kBarrier); }

uint64_t shuffle(unsigned mask, uint64_t value, int source) {
  Block& block = block_of_caller("__shfl_*_sync");
  Fiber& self = *block.current;
  self.mask = mask;
  self.source = source;
  self.value = value;
  wait_at(block, State::kShuffle);
  return self.value;
}

uint32_t ballot(unsigned mask, bool predicate) {
  return static_cast<uint32_t>(shuffle(mask, predicate ? 1 : 0, kBallot));
}

void record_access(const void* p, std::size_t bytes, bool write, bool active) {
  if (active && reinterpret_cast<uintptr_t>(p) % bytes != 0) {
    std::fprintf(stderr, "cuda_shim: misaligned %zu-byte access at %p\n", bytes, p);
    fail("misaligned access");
  }
  std::vector<Access>* log = g_log.load();
  if (log == nullptr) return;
  Fiber& self = *block_of_caller("a global access").current;
  const uint32_t sequence = self.accesses++;
  if (!active) return;
  const Access access{g_launches.load(),
                      self.coordinates.block_idx.x,
                      self.coordinates.thread_idx.x,
                      sequence,
                      reinterpret_cast<uintptr_t>(p),
                      static_cast<uint32_t>(bytes),
                      write};
  std::lock_guard<std::mutex> lock(g_log_mutex);
  log->push_back(access);
}

void set_access_log(std::vector<Access>* log) { g_log.store(log); }

void run_grid(dim3 grid, dim3 shape, Body body, void* context) {
  if (grid.x == 0 || grid.x > kMaxGrid || shape.x == 0 || shape.x > kMaxBlockThreads) {
    set_error(cudaErrorInvalidConfiguration);
    return;
  }
  ++g_launches;
  std::atomic<unsigned> next{0};
  const auto work = [&] {
    Block block;
    block.fibers.resize(shape.x);
    block.stacks.reset(new char[shape.x * kStackBytes]);
    block.body = body;
    block.context = context;
    t_block = &block;
    for (unsigned b; (b = next.fetch_add(1)) < grid.x;) run_block(block, grid, shape, b);
    t_block = nullptr;
  };
  std::vector<std::thread> pool;
  for (int w = 1; w < device().workers; ++w) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
}

}  // namespace cuda_shim
