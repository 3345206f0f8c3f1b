// How a warp sees its elements and moves them: the global loads and stores every
// kernel goes through, the warp step (32 lanes, each holding slots of U
// consecutive elements), slots of elements as 16-byte vectors, the code words
// and sign bits of a slot, the value a compressor encodes, block-wide
// reductions, and the loop that overlaps one item's loads with the previous
// item's work. Device code for kernels_cuda.cu (see its design notes).
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
// so that the tests' CPU shim logs them all (tests/cuda_shim, the access audit).

template <typename V>
__device__ V load_global(const V* p) {
#if !defined(__CUDACC__)
  cuda_shim::record_access(p, sizeof(V), /*write=*/false);
#endif
  return *p;
}

template <typename V>
__device__ void store_global(V* p, V v) {
#if !defined(__CUDACC__)
  cuda_shim::record_access(p, sizeof(V), /*write=*/true);
#endif
  *p = v;
}

// A 16-byte store in PTX: nvcc splits a C++ one that it merges with the scalar
// stores of a partial slot.
template <>
__device__ void store_global(uint4* p, uint4 v) {
#if defined(__CUDA_ARCH__)
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};"
               :
               : "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
#else
#if !defined(__CUDACC__)
  cuda_shim::record_access(p, sizeof(uint4), /*write=*/true);
#endif
  *p = v;
#endif
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

  // First element of slot j, and how many of its U elements exist.
  __device__ int64_t at(int j) const { return base + U * (32 * j + lane_id()); }
  __device__ int count(int j) const {
    return static_cast<int>(max(int64_t{0}, min(int64_t{U}, length - at(j))));
  }
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
// vector slot is whole 16-byte loads (p is then 16-byte aligned).
template <typename T, int U>
__device__ Slot<T, U> load_slot(const T* p, int count) {
  Slot<T, U> s{};
  if constexpr (U == 1) {
    if (count > 0) s.value = load_global(p);
  } else if (count == U) {
#pragma unroll
    for (int i = 0; i < U * static_cast<int>(sizeof(T)) / 16; ++i)
      s.vectors[i] = load_global(reinterpret_cast<const uint4*>(p) + i);
  } else {
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (u < count) set_element(s, u, load_global(p + u));
  }
  return s;
}

template <typename T, int U>
__device__ void store_slot(T* p, int count, const Slot<T, U>& s) {
  if constexpr (U == 1) {
    if (count > 0) store_global(p, s.value);
  } else if (count == U) {
#pragma unroll
    for (int i = 0; i < U * static_cast<int>(sizeof(T)) / 16; ++i)
      store_global(reinterpret_cast<uint4*>(p) + i, s.vectors[i]);
  } else {
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (u < count) store_global(p + u, element(s, u));
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
template <int kBytes>
__device__ uint64_t load_code_bytes(const uint8_t* p) {
  if constexpr (kBytes == 8) {
    const uint2 w = load_global(reinterpret_cast<const uint2*>(p));
    return uint64_t{w.x} | uint64_t{w.y} << 32;
  } else if constexpr (kBytes == 4) {
    return load_global(reinterpret_cast<const uint32_t*>(p));
  } else if constexpr (kBytes == 2) {
    return load_global(reinterpret_cast<const uint16_t*>(p));
  } else {
    return load_global(p);
  }
}

template <int kBytes>
__device__ void store_code_bytes(uint8_t* p, uint64_t word) {
  if constexpr (kBytes == 8) {
    store_global(reinterpret_cast<uint2*>(p),
                 make_uint2(static_cast<uint32_t>(word), static_cast<uint32_t>(word >> 32)));
  } else if constexpr (kBytes == 4) {
    store_global(reinterpret_cast<uint32_t*>(p), static_cast<uint32_t>(word));
  } else if constexpr (kBytes == 2) {
    store_global(reinterpret_cast<uint16_t*>(p), static_cast<uint16_t>(word));
  } else {
    store_global(p, static_cast<uint8_t>(word));
  }
}

// The codes of the slot whose first element is element `at` of the group
// (codes = the group's payload). With U = 1, 4-bit codes share a byte between
// lanes l and l ^ 1 (elements 2i and 2i + 1).
template <int kBits, int U>
__device__ uint64_t load_codes(const uint8_t* codes, int64_t at, int count) {
  if constexpr (kBits == 4 && U == 1)
    return count > 0 ? load_global(codes + at / 2) >> (4 * (at % 2)) & 0xfu : 0u;
  else
    return count > 0 ? load_code_bytes<kBits * U / 8>(codes + at * kBits / 8) : 0u;
}

// Codes past the group's end (u >= count) must be 0 in `word`. All lanes of
// the warp must call this (U = 1 pairs 4-bit codes by a shuffle).
template <int kBits, int U>
__device__ void store_codes(uint8_t* codes, int64_t at, int count, uint64_t word) {
  if constexpr (kBits == 4 && U == 1) {
    const uint32_t pair =
        static_cast<uint32_t>(word) | __shfl_xor_sync(kFullMask, static_cast<uint32_t>(word), 1)
                                          << 4;
    if (lane_id() % 2 == 0 && count > 0) store_global(codes + at / 2, static_cast<uint8_t>(pair));
  } else if (count > 0) {
    store_code_bytes<kBits * U / 8>(codes + at * kBits / 8, word);
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

// ---- The value a compressor encodes -----------------------------------------

// x, or x + residual with error feedback.
template <typename T, bool kFeedback>
struct Source {
  const T* x;
  const float* residual;

  // A lane's slots of one step as loaded; values() adds them up.
  template <int U>
  struct Loaded {
    Slots<T, U> x;
    Slots<float, U> residual;  // unused without feedback (no registers once unused)
  };

  template <int U>
  __device__ Loaded<U> load(int64_t first, const Step<U>& step) const {
    Loaded<U> r;
    r.x.load(x + first, step);
    if constexpr (kFeedback) r.residual.load(residual + first, step);
    return r;
  }

  template <int U>
  static __device__ void values(const Loaded<U>& r, float (&v)[kPerLane]) {
#pragma unroll
    for (int j = 0; j < kPerLane / U; ++j) {
      unpack(r.x.at[j], v + j * U);
      if constexpr (kFeedback) {
        float e[U];
        unpack(r.residual.at[j], e);
#pragma unroll
        for (int u = 0; u < U; ++u) v[j * U + u] = math::add_rn(v[j * U + u], e[u]);
      }
    }
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

// ---- Overlapping loads with work --------------------------------------------

// For items first, first + stride, ... below end: load(i) returns item i's
// loaded values, work(i, values) uses them. Item i + stride's loads are issued
// before item i's work, so they are in flight while it runs: the compiler cannot
// move loads above stores that may alias them, so this is done by hand (it is
// right in place too: two items touch different elements). `load` must be
// uniform over whatever `work` synchronizes.
template <typename Load, typename Work>
__device__ void pipelined(int64_t first, int64_t end, int64_t stride, Load&& load, Work&& work) {
  if (first >= end) return;
  auto current = load(first);
  for (int64_t i = first; i < end; i += stride) {
    const bool more = i + stride < end;
    decltype(current) next;
    if (more) next = load(i + stride);
    work(i, current);
    if (more) current = next;
  }
}

}  // namespace
}  // namespace bagua::kernels
