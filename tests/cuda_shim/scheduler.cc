// The shim's scheduler: a pool of OS threads takes blocks in turn, and each
// runs its block's threads as fibers from one synchronization point to the
// next, checking that every barrier and shuffle is reached by the threads that
// must reach it.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <thread>
#include <vector>

#include "cuda_runtime.h"

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

struct Fiber {
  ucontext_t context;
  Coordinates coordinates;
  State state = State::kReady;
  unsigned mask = 0;
  int offset = 0;
  uint64_t value = 0;
};

// One OS thread's block in flight.
struct Block {
  std::vector<Fiber> fibers;
  std::unique_ptr<char[]> stacks;
  ucontext_t scheduler;
  Fiber* current = nullptr;
  Body body = nullptr;
  void* context = nullptr;
};

thread_local Block* t_block = nullptr;
thread_local cudaError_t t_error = cudaSuccess;

Block& block_of_caller(const char* what) {
  if (t_block == nullptr || t_block->current == nullptr) {
    std::fprintf(stderr, "cuda_shim: %s called outside a kernel\n", what);
    fail("device code on the host");
  }
  return *t_block;
}

void fiber_main() {
  t_block->body(t_block->context);
  t_block->current->state = State::kExited;
}

// Suspends the calling fiber at a synchronization point.
void wait_at(Block& block, State state) {
  Fiber& self = *block.current;
  self.state = state;
  swapcontext(&self.context, &block.scheduler);
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
    uint64_t result[32];
    for (std::size_t l = 0; l < width; ++l) {
      if (lanes[l].state != State::kShuffle) continue;
      const std::size_t source = l ^ static_cast<unsigned>(lanes[l].offset);
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
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = block.stacks.get() + t * kStackBytes;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &block.scheduler;
    makecontext(&f.context, fiber_main, 0);
  }
  const bool reverse = device().reverse;
  for (;;) {
    bool live = false;
    for (unsigned i = 0; i < threads; ++i) {
      Fiber& f = block.fibers[reverse ? threads - 1 - i : i];
      if (f.state != State::kReady) continue;
      block.current = &f;
      swapcontext(&block.scheduler, &f.context);
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

uint64_t shuffle_xor(unsigned mask, uint64_t value, int offset) {
  Block& block = block_of_caller("__shfl_xor_sync");
  Fiber& self = *block.current;
  self.mask = mask;
  self.offset = offset;
  self.value = value;
  wait_at(block, State::kShuffle);
  return self.value;
}

void run_grid(dim3 grid, dim3 shape, Body body, void* context) {
  if (grid.x == 0 || grid.x > kMaxGrid || shape.x == 0 || shape.x > kMaxBlockThreads) {
    set_error(cudaErrorInvalidConfiguration);
    return;
  }
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
