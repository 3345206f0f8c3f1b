// How a warp sees its elements and moves them: the global loads and stores every
// kernel goes through, the warp step (32 lanes, each holding slots of U
// consecutive elements), slots of elements as 16-byte vectors, the code words
// and sign bits of a slot, the L2 prefetch of a kernel's next item, the value
// a compressor encodes, and block-wide reductions. Device code for
// kernels_cuda.cu (see its design notes).
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda_launch.h"
#include "dtypes.h"
#include "layout.h"
#include "numerics.h"

namespace bagua::kernels {
namespace {

constexpr uint32_t kFullMask = 0xffffffffu;

__device__ int lane_id() { return threadIdx.x % 32; }
__device__ int warp_id() { return threadIdx.x / 32; }

// ---- Global memory ----------------------------------------------------------
//
// Every global access of the kernels goes through load_global and store_global,
// with the lane's predicate: a lane that takes no part (a slot past a range's
// end) skips the access, as a predicated instruction does. The tests' CPU shim
// logs them all, and counts a skipped access as the lane's share of the warp's
// instruction (tests/cuda_shim, the access audit).

template <typename V>
__device__ V load_global(const V* p, bool active = true) {
#if !defined(__CUDACC__)
  cuda_shim::record_access(p, sizeof(V), /*write=*/false, active);
#endif
  return active ? *p : V{};
}

template <typename V>
__device__ void store_global(V* p, V v, bool active = true) {
#if !defined(__CUDACC__)
  cuda_shim::record_access(p, sizeof(V), /*write=*/true, active);
#endif
  if (active) *p = v;
}

// A 16-byte store in PTX: nvcc splits a C++ one that it merges with the scalar
// stores of a partial slot.
template <>
__device__ void store_global(uint4* p, uint4 v, bool active) {
#if defined(__CUDA_ARCH__)
  if (active)
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};"
                 :
                 : "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
#else
#if !defined(__CUDACC__)
  cuda_shim::record_access(p, sizeof(uint4), /*write=*/true, active);
#endif
  if (active) *p = v;
#endif
}

// Sums of the sign codec's chunks, over blocks: atomically, in any order.
__device__ void atomic_add_global(double* p, double v) {
#if !defined(__CUDACC__)
  cuda_shim::record_access(p, sizeof(double), /*write=*/true, /*active=*/true);
#endif
  atomicAdd(p, v);
}

// ---- Where a lane's elements lie --------------------------------------------

// A lane's part of one warp step of 32 * E elements: E / U slots of U
// consecutive elements, slot j of lane l starting at element U * (32 j + l) of
// the step, so that every slot access of the warp is one contiguous run of
// memory. U = 16 / sizeof(T) moves 16 bytes of T a slot; U = 1 serves ranges
// that start misaligned.
template <int U, int E = kPerLane>
struct Step {
  static_assert(E % U == 0, "a lane holds whole slots");
  static constexpr int kSlots = E / U;
  int64_t base;    // the step's first element, counted from the range's start
  int64_t length;  // the range's elements
  int64_t first;   // the lane's first element (of slot 0)
  int left;        // the range's elements from `first` on, at most the step's (32-bit counts: fewer
                   // registers)

  __device__ Step(int64_t base, int64_t length)
      : base(base),
        length(length),
        first(base + U * lane_id()),
        left(static_cast<int>(max(int64_t{0}, min(int64_t{32} * E, length - first)))) {}

  // First element of slot j, and how many of its U elements exist.
  __device__ int64_t at(int j) const { return first + 32 * U * j; }
  __device__ int count(int j) const { return max(0, min(U, left - 32 * U * j)); }
};

// The slot width for elements of T: 16 bytes when `vector`, else one element.
template <typename T>
constexpr int slot_width(bool vector) {
  return vector ? 16 / static_cast<int>(sizeof(T)) : 1;
}

// ---- Slots of elements ------------------------------------------------------

// U elements of T as they lie in memory: whole 16-byte vectors, or one element.
template <typename T, int U>
struct Slot {
  static_assert(U * sizeof(T) % 16 == 0, "a vector slot is whole 16-byte vectors");
  uint4 vectors[U * sizeof(T) / 16];
};
template <typename T>
struct Slot<T, 1> {
  T value;
};

__device__ uint32_t& word_of(uint4& r, int i) {
  return i == 0 ? r.x : i == 1 ? r.y : i == 2 ? r.z : r.w;
}
__device__ uint32_t word_of(const uint4& r, int i) {
  return i == 0 ? r.x : i == 1 ? r.y : i == 2 ? r.z : r.w;
}

template <typename T>
__device__ T from_bits(uint32_t bits) {
  if constexpr (sizeof(T) == 4)
    return bits_float(bits);
  else
    return T{static_cast<uint16_t>(bits)};
}
template <typename T>
__device__ uint32_t to_bits(T v) {
  if constexpr (sizeof(T) == 4)
    return float_bits(v);
  else
    return v.bits;
}

// Element u of a slot (u a constant once loops unroll, so this is a register).
template <typename T, int U>
__device__ T element(const Slot<T, U>& s, int u) {
  if constexpr (U == 1) {
    return s.value;
  } else {
    constexpr int kPerWord = 4 / sizeof(T);
    const uint32_t word = word_of(s.vectors[u / (4 * kPerWord)], u / kPerWord % 4);
    return from_bits<T>(word >> (32 / kPerWord * (u % kPerWord)));
  }
}

template <typename T, int U>
__device__ void set_element(Slot<T, U>& s, int u, T v) {
  if constexpr (U == 1) {
    s.value = v;
  } else {
    constexpr int kPerWord = 4 / sizeof(T);
    constexpr uint32_t kMask = sizeof(T) == 4 ? 0xffffffffu : 0xffffu;
    uint32_t& word = word_of(s.vectors[u / (4 * kPerWord)], u / kPerWord % 4);
    const int shift = 32 / kPerWord * (u % kPerWord);
    word = (word & ~(kMask << shift)) | (to_bits(v) << shift);
  }
}

// Reads `count` <= U elements at p; missing ones read as zero bits. A full
// vector slot is whole 16-byte loads (p is then 16-byte aligned); an empty one
// the same loads, skipped.
template <typename T, int U>
__device__ Slot<T, U> load_slot(const T* p, int count) {
  Slot<T, U> s{};
  if constexpr (U == 1) {
    s.value = load_global(p, count > 0);
  } else if (count == U || count <= 0) {
#pragma unroll
    for (int i = 0; i < U * static_cast<int>(sizeof(T)) / 16; ++i)
      s.vectors[i] = load_global(reinterpret_cast<const uint4*>(p) + i, count > 0);
  } else {
#pragma unroll
    for (int u = 0; u < U; ++u) set_element(s, u, load_global(p + u, u < count));
  }
  return s;
}

template <typename T, int U>
__device__ void store_slot(T* p, int count, const Slot<T, U>& s) {
  if constexpr (U == 1) {
    store_global(p, s.value, count > 0);
  } else if (count == U || count <= 0) {
#pragma unroll
    for (int i = 0; i < U * static_cast<int>(sizeof(T)) / 16; ++i)
      store_global(reinterpret_cast<uint4*>(p) + i, s.vectors[i], count > 0);
  } else {
#pragma unroll
    for (int u = 0; u < U; ++u) store_global(p + u, element(s, u), u < count);
  }
}

template <typename T, int U>
__device__ void unpack(const Slot<T, U>& s, float* v) {
#pragma unroll
  for (int u = 0; u < U; ++u) v[u] = to_float(element(s, u));
}

template <typename T, int U>
__device__ Slot<T, U> pack(const float* v) {
  Slot<T, U> s{};
#pragma unroll
  for (int u = 0; u < U; ++u) set_element(s, u, from_float<T>(v[u]));
  return s;
}

// A lane's slots of one step of a range of T, as loaded.
template <typename T, int U, int E = kPerLane>
struct Slots {
  Slot<T, U> at[E / U];

  __device__ void load(const T* range, const Step<U, E>& step) {
#pragma unroll
    for (int j = 0; j < Step<U, E>::kSlots; ++j)
      at[j] = load_slot<T, U>(range + step.at(j), step.count(j));
  }
};

// Stores v (E floats, slot by slot) as T.
template <typename T, int U, int E>
__device__ void store_step(T* range, const Step<U, E>& step, const float* v) {
#pragma unroll
  for (int j = 0; j < Step<U, E>::kSlots; ++j)
    store_slot<T, U>(range + step.at(j), step.count(j), pack<T, U>(v + j * U));
}

// ---- Codes of a slot --------------------------------------------------------

// The kBits-bit codes of a slot's U elements (code u at bit kBits * u) lie in
// kBits * U / 8 bytes: 4 for 8-bit codes of float32 slots, 8 for 16-bit ones,
// half that for 4-bit codes. A slot's codes are accessed whole even where the
// group ends inside it: they lie inside the group's padded payload, whose
// padding is zero (layout.h), and a vector slot never starts a partial byte.
template <int kBits, int U>
using CodeWord = std::conditional_t<(kBits * U > 32), uint64_t, uint32_t>;

template <int kBytes, typename W>
__device__ W load_code_bytes(const uint8_t* p, bool active) {
  if constexpr (kBytes == 8) {
    const uint2 w = load_global(reinterpret_cast<const uint2*>(p), active);
    return uint64_t{w.x} | uint64_t{w.y} << 32;
  } else if constexpr (kBytes == 4) {
    return load_global(reinterpret_cast<const uint32_t*>(p), active);
  } else if constexpr (kBytes == 2) {
    return load_global(reinterpret_cast<const uint16_t*>(p), active);
  } else {
    return load_global(p, active);
  }
}

template <int kBytes, typename W>
__device__ void store_code_bytes(uint8_t* p, W word, bool active) {
  if constexpr (kBytes == 8) {
    store_global(reinterpret_cast<uint2*>(p),
                 make_uint2(static_cast<uint32_t>(word), static_cast<uint32_t>(word >> 32)),
                 active);
  } else if constexpr (kBytes == 4) {
    store_global(reinterpret_cast<uint32_t*>(p), static_cast<uint32_t>(word), active);
  } else if constexpr (kBytes == 2) {
    store_global(reinterpret_cast<uint16_t*>(p), static_cast<uint16_t>(word), active);
  } else {
    store_global(p, static_cast<uint8_t>(word), active);
  }
}

// The codes of the slot whose first element is element `at` of the group
// (codes = the group's payload). With U = 1, 4-bit codes share a byte between
// lanes l and l ^ 1 (elements 2i and 2i + 1).
template <int kBits, int U>
__device__ CodeWord<kBits, U> load_codes(const uint8_t* codes, int64_t at, int count) {
  using W = CodeWord<kBits, U>;
  if constexpr (kBits == 4 && U == 1)
    return load_global(codes + at / 2, count > 0) >> (4 * (at % 2)) & 0xfu;
  else
    return load_code_bytes<kBits * U / 8, W>(codes + at * kBits / 8, count > 0);
}

// Codes past the group's end (u >= count) must be 0 in `word`. All lanes of
// the warp must call this (U = 1 pairs 4-bit codes by a shuffle).
template <int kBits, int U>
__device__ void store_codes(uint8_t* codes, int64_t at, int count, CodeWord<kBits, U> word) {
  if constexpr (kBits == 4 && U == 1) {
    const uint32_t pair = word | __shfl_xor_sync(kFullMask, word, 1) << 4;
    store_global(codes + at / 2, static_cast<uint8_t>(pair), lane_id() % 2 == 0 && count > 0);
  } else {
    store_code_bytes<kBits * U / 8>(codes + at * kBits / 8, word, count > 0);
  }
}

// The code bytes the slots of a group of `length` elements write: whole slots
// of U codes (layout.h's padding is zero beyond them).
template <int kBits, int U>
__device__ int64_t written_code_bytes(int64_t length) {
  return ceil_div(ceil_div(length, U) * U * kBits, 8);
}

// ---- Sign bits of a step ----------------------------------------------------
//
// A step of 32 lanes x 32 elements has 1024 bits: 32 words of 32 bits, word w
// holding elements 32w..32w+31 of the step. Lane l stores (or loads) one word,
// so the warp moves 128 contiguous bytes. With slots of U elements the word of
// elements 32w.. is gathered from 32 / U lanes, and lane l keeps word
// U * (l % (32 / U)) + l / (32 / U): a permutation of the 32 words.

template <int U>
__device__ int64_t sign_word_of_lane() {
  constexpr int kLanesPerWord = 32 / U;
  return U * (lane_id() % kLanesPerWord) + lane_id() / kLanesPerWord;
}

// Gathers the U-bit groups of the lane's slots (slot j's in bits[j]) into the
// lane's word. All lanes of the warp must call this.
template <int U>
__device__ uint32_t gather_sign_word(const uint32_t (&bits)[kPerLane / U]) {
  constexpr int kLanesPerWord = 32 / U;
  uint32_t mine = 0;
#pragma unroll
  for (int j = 0; j < kPerLane / U; ++j) {
    uint32_t word;
    if constexpr (U == 1) {
      word = __ballot_sync(kFullMask, bits[j] != 0);
    } else {
      word = bits[j] << (U * (lane_id() % kLanesPerWord));
#pragma unroll
      for (int offset = 1; offset < kLanesPerWord; offset *= 2)
        word |= __shfl_xor_sync(kFullMask, word, offset);
    }
    if (j == lane_id() % kLanesPerWord) mine = word;
  }
  return mine;
}

// The lane's word of a step of a range's bits (`bits` the payload, `base` the
// step's first element in it, `length` the end of the range in it), 0 if it
// holds none of the range; and its store. A word partly past the end lies in
// the padded payload.
template <int U>
__device__ uint32_t load_sign_word(const uint8_t* bits, int64_t base, int64_t length) {
  const int64_t first = base + 32 * sign_word_of_lane<U>();
  return load_global(reinterpret_cast<const uint32_t*>(bits + first / 8), first < length);
}

template <int U>
__device__ void store_sign_word(uint8_t* bits, int64_t base, int64_t length, uint32_t word) {
  const int64_t first = base + 32 * sign_word_of_lane<U>();
  store_global(reinterpret_cast<uint32_t*>(bits + first / 8), word, first < length);
}

// The inverse: slot j's U bits from the words the lanes loaded (`word`, the
// lane's, as sign_word_of_lane places it). All lanes must call this.
template <int U>
__device__ uint32_t scatter_sign_bits(uint32_t word, int j) {
  constexpr int kLanesPerWord = 32 / U;
  // Slot j of lane l starts at element U * (32 j + l): word U j + l / kLanesPerWord,
  // kept by lane kLanesPerWord * (l / kLanesPerWord) + j.
  const int source = kLanesPerWord * (lane_id() / kLanesPerWord) + j;
  const uint32_t w = __shfl_sync(kFullMask, word, source);
  return w >> (U * (lane_id() % kLanesPerWord)) & ((1u << U) - 1);
}

// ---- Loads issued ahead -----------------------------------------------------
//
// Each kernel asks the L2 cache for its next item (a block's next tile, a warp's
// next step) before it loads and works on the current one, so that item's bytes
// are on their way from memory meanwhile, in no register. The current item's
// loads are all issued before any of its values is used, and then mostly hit
// the L2 cache. (Holding the next item in registers instead took half of them
// and so half the resident warps.)

constexpr int64_t kLineBytes = 128;

__device__ void prefetch_line(const void* p) {
#if defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L2 [%0];" : : "l"(p));
#else
  (void)p;  // the shim has no cache
#endif
}

// The lines of [p, p + bytes), `threads` lanes from `thread` each taking every
// threads-th line.
__device__ void prefetch_range(const void* p, int64_t bytes, int thread, int threads) {
  const char* first = static_cast<const char*>(p);
  for (int64_t at = int64_t{thread} * kLineBytes; at < bytes; at += int64_t{threads} * kLineBytes)
    prefetch_line(first + at);
}

// A block striding over items [first, end) by `stride` keeps kAhead of its items
// requested: at `item` it asks for item + kAhead * stride (and, at its first
// item, for those before it). Min-max compression without feedback holds a
// group in 128 registers a thread, two blocks an SM, and asks for one more.
constexpr int kItemsAhead = 2, kCompressItemsAhead = 3;

template <int kAhead = kItemsAhead, typename Prefetch>
__device__ void prefetch_ahead(int64_t item, int64_t first, int64_t end, int64_t stride,
                               Prefetch&& prefetch) {
  for (int d = item == first ? 1 : kAhead; d <= kAhead; ++d)
    if (item + d * stride < end) prefetch(item + d * stride);
}

// ---- The value a compressor encodes -----------------------------------------

// x, or x + residual with error feedback.
template <typename T, bool kFeedback>
struct Source {
  const T* x;
  const float* residual;

  // The values of a lane's slots of one step of the range at `first`; all
  // loads are issued before the first value is computed.
  template <int U>
  __device__ void load(int64_t first, const Step<U>& step, float (&v)[kPerLane]) const {
    Slots<T, U> xs;
    xs.load(x + first, step);
    Slots<float, U> rs;
    if constexpr (kFeedback) rs.load(residual + first, step);
#pragma unroll
    for (int j = 0; j < kPerLane / U; ++j) {
      unpack(xs.at[j], v + j * U);
      if constexpr (kFeedback) {
        float e[U];
        unpack(rs.at[j], e);
#pragma unroll
        for (int u = 0; u < U; ++u) v[j * U + u] = math::add_rn(v[j * U + u], e[u]);
      }
    }
  }

  // The values of slot j alone.
  template <int U>
  __device__ void slot_values(int64_t first, const Step<U>& step, int j, float (&v)[U]) const {
    unpack(load_slot<T, U>(x + first + step.at(j), step.count(j)), v);
    if constexpr (kFeedback) {
      float e[U];
      unpack(load_slot<float, U>(residual + first + step.at(j), step.count(j)), e);
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = math::add_rn(v[u], e[u]);
    }
  }

  // The block asks the L2 cache for `length` elements at `first`.
  __device__ void prefetch(int64_t first, int64_t length) const {
    prefetch_range(x + first, length * int64_t{sizeof(T)}, threadIdx.x, kThreads);
    if constexpr (kFeedback) prefetch_range(residual + first, length * 4, threadIdx.x, kThreads);
  }
};

// ---- Block-wide reductions --------------------------------------------------

// Reduces one value per thread over the block; every thread gets the result.
template <typename V, typename Op>
__device__ V block_reduce(V v, Op op) {
  __shared__ V partial[kWarps];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(kFullMask, v, offset));
  if (lane_id() == 0) partial[warp_id()] = v;
  __syncthreads();
  v = partial[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) v = op(v, partial[w]);
  __syncthreads();  // the next call reuses `partial`
  return v;
}

// The block's minimum of `lo` and maximum of `hi` at once (one pair of barriers).
__device__ void block_min_max(int32_t& lo, int32_t& hi) {
  __shared__ int32_t partial[2][kWarps];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    lo = min(lo, __shfl_xor_sync(kFullMask, lo, offset));
    hi = max(hi, __shfl_xor_sync(kFullMask, hi, offset));
  }
  if (lane_id() == 0) {
    partial[0][warp_id()] = lo;
    partial[1][warp_id()] = hi;
  }
  __syncthreads();
  lo = partial[0][0];
  hi = partial[1][0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) {
    lo = min(lo, partial[0][w]);
    hi = max(hi, partial[1][w]);
  }
  __syncthreads();
}

}  // namespace
}  // namespace bagua::kernels
