// CPU implementations of the kernels: OpenMP across blocks of elements, and
// inner loops over fixed-width lanes so the compiler vectorizes them without
// reassociating float arithmetic.
//
// This file is compiled once per instruction set (BAGUA_CPU_ISA names the
// namespace: generic, avx2, avx512; see CMakeLists.txt), and
// kernels_cpu_dispatch.cc picks the best one the processor supports at run time.
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "kernels.h"
#include "layout.h"
#include "numerics.h"

#ifndef BAGUA_CPU_ISA
#error \
    "kernels_cpu.cc is compiled once per instruction set with BAGUA_CPU_ISA set; see CMakeLists.txt"
#endif

namespace bagua::kernels::BAGUA_CPU_ISA {
namespace {

constexpr int64_t kBlock = int64_t{1} << 16;  // elements per parallel task; a multiple of 8
constexpr int64_t kParallelThreshold = int64_t{1} << 15;

// XLA's CPU runtime runs its threads with flush-to-zero and denormals-are-zero
// set, and torch.set_flush_denormal sets them too; the kernels clear both while
// they run, so their bytes (SPEC section 2) never depend on the calling thread.
class IeeeSubnormals {
 public:
  IeeeSubnormals(const IeeeSubnormals&) = delete;
  IeeeSubnormals& operator=(const IeeeSubnormals&) = delete;
#if defined(__x86_64__) || defined(__i386__)
  IeeeSubnormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~kFlushBits); }
  ~IeeeSubnormals() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kFlushBits = 0x8040;  // MXCSR FTZ (bit 15) and DAZ (bit 6)
  unsigned saved_;
#elif defined(__aarch64__)
  IeeeSubnormals() {
    asm volatile("mrs %0, fpcr" : "=r"(saved_));
    asm volatile("msr fpcr, %0" : : "r"(saved_ & ~kFlushBit));
  }
  ~IeeeSubnormals() { asm volatile("msr fpcr, %0" : : "r"(saved_)); }

 private:
  static constexpr uint64_t kFlushBit = uint64_t{1} << 24;  // FPCR.FZ
  uint64_t saved_;
#else
  IeeeSubnormals() = default;
#endif
};

template <typename F>
void parallel_for(int64_t tasks, int64_t work, F&& f) {
#pragma omp parallel for schedule(static) if (work >= kParallelThreshold && tasks > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const IeeeSubnormals ieee;
    f(t);
  }
}

// The tasks of a chunked tensor: each chunk is cut into the same number of
// blocks, so task t is block t % per_chunk of chunk t / per_chunk.
struct ChunkBlocks {
  Chunking chunking;
  int64_t per_chunk;

  explicit ChunkBlocks(Chunking c)
      : chunking(c), per_chunk(std::max<int64_t>(1, ceil_div(c.chunk_elements(), kBlock))) {}

  int64_t tasks() const { return chunking.k * per_chunk; }
  int64_t chunk(int64_t t) const { return t / per_chunk; }
  int64_t begin(int64_t t) const {
    const int64_t c = chunk(t);
    return std::min(chunking.begin(c) + (t % per_chunk) * kBlock, chunking.begin(c + 1));
  }
  int64_t end(int64_t t) const {
    const int64_t c = chunk(t);
    return std::min(begin(t) + kBlock, chunking.begin(c + 1));
  }
};

const float* header(const uint8_t* buffer, const Chunking& chunking, int64_t i) {
  return reinterpret_cast<const float*>(buffer + chunking.slot_offset(i));
}

// Eight float32 lanes as GCC/Clang vectors: the reductions are written lane-wise
// so they vectorize without reassociating float arithmetic, and the loads widen
// eight elements at once (dtypes.h's scalar conversions, vector by vector).
using f32x8 = float __attribute__((vector_size(32)));
using i32x8 = int32_t __attribute__((vector_size(32)));
using u32x8 = uint32_t __attribute__((vector_size(32)));
using u16x8 = uint16_t __attribute__((vector_size(16)));
using f64x4 = double __attribute__((vector_size(32)));
using f64x8 = double __attribute__((vector_size(64)));

f32x8 widen(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

u32x8 widen_bits(const void* p) {
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, u32x8);
}

f32x8 widen(const BFloat16* p) { return reinterpret_cast<f32x8>(widen_bits(p) << 16); }

// The vector form of to_float(Half) in dtypes.h.
f32x8 widen(const Half* p) {
  const u32x8 h = widen_bits(p);
  const u32x8 exponent = h & 0x7c00u, mantissa = h & 0x3ffu;
  const u32x8 normal = ((h & 0x7fffu) << 13) + (112u << 23);
  const u32x8 special = (mantissa << 13) | 0x7f800000u;
  const f32x8 scaled =
      __builtin_convertvector(reinterpret_cast<i32x8>(mantissa), f32x8) * 5.9604644775390625e-08f;
  const u32x8 subnormal = reinterpret_cast<u32x8>(scaled);
  const u32x8 magnitude = exponent == 0x7c00u ? special : (exponent == 0u ? subnormal : normal);
  return reinterpret_cast<f32x8>(magnitude | ((h & 0x8000u) << 16));
}

f32x8 splat(float x) { return f32x8{x, x, x, x, x, x, x, x}; }

// math::clamp, clamp_or_zero and round_half_even, lane by lane.
constexpr float kRoundingMagic = 12582912.0f;  // 1.5 * 2^23, as in math::round_half_even

f32x8 clamp(f32x8 v, float low, float high) {
  v = v > low ? v : splat(low);
  return v < high ? v : splat(high);
}

f32x8 clamp_or_zero(f32x8 v, float low, float high) {
  return clamp(v == v ? v : splat(0.0f), low, high);
}

f32x8 round_half_even(f32x8 v) {
  const f32x8 magic = splat(kRoundingMagic);
  return (v + magic) - magic;
}

// Bit j of a sign byte is lane j (least significant bit first, SPEC section 2).
constexpr i32x8 kLaneBits = {1, 2, 4, 8, 16, 32, 64, 128};

uint8_t pack_bits(i32x8 set) {
  const i32x8 b = set & kLaneBits;
  return static_cast<uint8_t>(b[0] | b[1] | b[2] | b[3] | b[4] | b[5] | b[6] | b[7]);
}

i32x8 unpack_bits(uint8_t byte) {
  const int32_t v = byte;
  return (i32x8{v, v, v, v, v, v, v, v} & kLaneBits) != 0;
}

// Where decoders put their values: one element, or eight at once (whole bytes
// of sign bits). Eight float32 lanes go out as one vector store; stored lane by
// lane, GCC did not merge them.
template <typename T>
void store(T* p, float v) {
  *p = from_float<T>(v);
}

template <typename T>
void store(T* p, f32x8 v) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &v, sizeof v);
  } else {
    for (int j = 0; j < 8; ++j) p[j] = from_float<T>(v[j]);
  }
}

void accumulate(float* p, float v) { *p = math::add_rn(*p, v); }

void accumulate(float* p, f32x8 v) { store(p, widen(p) + v); }  // add_rn lane by lane

// The value a compressor encodes: x, or x + residual with error feedback. The
// choice is a template parameter so the hot loops carry no branch.
template <typename T, bool kFeedback>
struct Source {
  const T* x;
  const float* residual;
  float operator()(int64_t i) const {
    const float v = to_float(x[i]);
    if constexpr (kFeedback) return math::add_rn(v, residual[i]);
    return v;
  }
  f32x8 load8(int64_t i) const {
    if constexpr (kFeedback) return widen(x + i) + widen(residual + i);
    return widen(x + i);
  }
};

struct Range {
  float lo, hi;
};

template <typename Src>
Range min_max(const Src& src, int64_t begin, int64_t end) {
  const float inf = std::numeric_limits<float>::infinity();
  f32x8 lo = {inf, inf, inf, inf, inf, inf, inf, inf}, hi = -lo;
  i32x8 nan = {};
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const f32x8 v = src.load8(i);
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
    nan |= v != v;
  }
  Range r{inf, -inf};
  bool any_nan = false;
  for (int l = 0; l < 8; ++l) {
    r.lo = std::min(r.lo, lo[l]);
    r.hi = std::max(r.hi, hi[l]);
    any_nan |= nan[l] != 0;
  }
  for (; i < end; ++i) {
    const float v = src(i);
    r.lo = std::min(r.lo, v);
    r.hi = std::max(r.hi, v);
    any_nan |= v != v;
  }
  if (any_nan) r.lo = r.hi = std::numeric_limits<float>::quiet_NaN();
  return r;
}

// In double, so that no finite chunk's sum overflows (SPEC section 2). Lane l
// sums elements l, l + 8, ... in order; one 8-lane double vector (one widening
// and one add a step where the processor has 512-bit vectors) holds the lanes.
template <typename Src>
double abs_sum(const Src& src, int64_t begin, int64_t end) {
  f64x8 lanes = {};
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    f32x8 v = src.load8(i);
    v = v < 0 ? -v : v;
    lanes += __builtin_convertvector(v, f64x8);
  }
  const f64x4 low = __builtin_shufflevector(lanes, lanes, 0, 1, 2, 3);
  const f64x4 acc = low + __builtin_shufflevector(lanes, lanes, 4, 5, 6, 7);
  double total = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  for (; i < end; ++i) total += std::fabs(src(i));
  return total;
}

// Writes a chunk's 16-byte header and zeroes the slot's padding, so equal inputs
// always give equal bytes on the wire.
void write_header(uint8_t* out, const Chunking& chunking, int64_t c, float a, float b) {
  uint8_t* slot = out + chunking.slot_offset(c);
  const float header[4] = {a, b, 0.0f, 0.0f};
  std::memcpy(slot, header, sizeof header);
  const int64_t used = kHeaderBytes + payload_bytes(chunking.format, chunking.length(c));
  std::memset(slot + used, 0, chunking.slot_offset(c + 1) - chunking.slot_offset(c) - used);
}

// Element i of a chunk's codes (SPEC section 2, layout.h): byte i for 8-bit
// codes; for 4-bit ones the low (even i) or high (odd i) nibble of byte i / 2.
template <int kBits>
uint8_t code_at(const uint8_t* codes, int64_t i) {
  if constexpr (kBits == 8) return codes[i];
  return (codes[i >> 1] >> ((i & 1) * 4)) & 0xf;
}

// Stores code q of element i; 4-bit codes go in increasing i from an even one,
// so an even element's store clears the nibble its odd neighbour fills.
template <int kBits>
void put_code(uint8_t* codes, int64_t i, uint8_t q) {
  if constexpr (kBits == 8) {
    codes[i] = q;
  } else if (i & 1) {
    codes[i >> 1] |= static_cast<uint8_t>(q << 4);
  } else {
    codes[i >> 1] = q;
  }
}

// The codes of elements i..i+7 (i even), as one 8- or 4-byte store.
template <int kBits>
void put_codes8(uint8_t* codes, int64_t i, i32x8 q) {
  uint8_t bytes[kBits];
  for (int j = 0; j < kBits; ++j)
    bytes[j] = kBits == 8 ? static_cast<uint8_t>(q[j])
                          : static_cast<uint8_t>(q[2 * j] | (q[2 * j + 1] << 4));
  std::memcpy(codes + i * kBits / 8, bytes, sizeof bytes);
}

template <int kBits, typename T, bool kFeedback>
void minmax_compress_impl(const T* x, const float* residual_in, int64_t n, int64_t k, uint8_t* out,
                          float* residual_out) {
  constexpr float kTop = math::MinMaxCodes<kBits>::kTop;
  const IeeeSubnormals ieee;
  const Chunking chunking{kBits == 8 ? Format::kMinMaxUInt8 : Format::kMinMaxUInt4, n, k};
  const ChunkBlocks blocks(chunking);
  const Source<T, kFeedback> src{x, residual_in};
  std::vector<Range> partial(blocks.tasks());
  parallel_for(blocks.tasks(), n,
               [&](int64_t t) { partial[t] = min_max(src, blocks.begin(t), blocks.end(t)); });
  for (int64_t c = 0; c < k; ++c) {
    float lo = std::numeric_limits<float>::infinity(), hi = -lo;
    for (int64_t b = 0; b < blocks.per_chunk; ++b) {
      lo = math::nan_min(lo, partial[c * blocks.per_chunk + b].lo);
      hi = math::nan_max(hi, partial[c * blocks.per_chunk + b].hi);
    }
    if (chunking.length(c) == 0) lo = hi = 0.0f;
    write_header(out, chunking, c, lo, hi);
  }
  parallel_for(blocks.tasks(), n, [&](int64_t t) {
    // Local copies: the code stores could alias the captured ones, which the loops
    // would then reload at every step.
    const Source<T, kFeedback> values = src;
    float* const residuals = residual_out;
    const int64_t c = blocks.chunk(t);
    const float* h = header(out, chunking, c);
    const math::MinMaxGrid grid = math::minmax_grid<kBits>(h[0], h[1]);
    const int64_t first = chunking.begin(c), begin = blocks.begin(t), end = blocks.end(t);
    uint8_t* codes = out + chunking.slot_offset(c) + kHeaderBytes;
    // math::minmax_encode and minmax_decode, eight lanes at a time (the byte stores
    // could alias the input, so the compiler would not vectorize the scalar loop).
    const f32x8 z8 = splat(grid.z), scale8 = splat(grid.scale), base8 = splat(grid.base),
                step8 = splat(grid.step);
    int64_t i = begin;
    const auto encode8 = [&](auto&& quantize) {
      for (; i + 8 <= end; i += 8) {
        const f32x8 v = values.load8(i);
        const f32x8 q = quantize(v);
        put_codes8<kBits>(codes, i - first, __builtin_convertvector(q, i32x8));
        if constexpr (kFeedback) {
          const f32x8 residual = v - (z8 + (q + base8) * step8);
          std::memcpy(residuals + i, &residual, sizeof residual);
        }
      }
    };
    const float range = math::sub_rn(grid.hi, grid.lo);
    if (!grid.wide && math::is_finite(range) && range > 0.0f) {
      // A finite, non-constant float32 chunk: |(x - z) * scale| <= S (1 + 2^-24)^2 < S + 1,
      // so neither a NaN nor the first clamp can occur, and subtracting the integer base
      // from the rounding constant first is exact: the same codes in fewer steps.
      const f32x8 magic8 = splat(kRoundingMagic), offset8 = splat(kRoundingMagic + grid.base);
      encode8([&](f32x8 v) { return clamp(((v - z8) * scale8 + magic8) - offset8, 0.0f, kTop); });
    } else if (!grid.wide) {  // constant chunks, NaN and infinities
      encode8([&](f32x8 v) {
        return clamp_or_zero(round_half_even(clamp_or_zero((v - z8) * scale8, -kTop, kTop)) - base8,
                             0.0f, kTop);
      });
    }
    for (; i < end; ++i) {
      const float v = values(i);
      const uint8_t q = math::minmax_encode<kBits>(v, grid);
      put_code<kBits>(codes, i - first, q);
      if constexpr (kFeedback) residuals[i] = math::sub_rn(v, math::minmax_decode(q, grid));
    }
  });
}

// Bits are packed a byte (8 elements) at a time; every block but a chunk's last
// starts and ends on a byte boundary of its chunk.
template <typename T, bool kFeedback>
void sign_compress_impl(const T* x, const float* residual_in, int64_t n, int64_t k, uint8_t* out,
                        float* residual_out) {
  const IeeeSubnormals ieee;
  const Chunking chunking{Format::kSign, n, k};
  const ChunkBlocks blocks(chunking);
  const Source<T, kFeedback> src{x, residual_in};
  std::vector<double> partial(blocks.tasks());
  parallel_for(blocks.tasks(), n,
               [&](int64_t t) { partial[t] = abs_sum(src, blocks.begin(t), blocks.end(t)); });
  for (int64_t c = 0; c < k; ++c) {
    double sum = 0;
    for (int64_t b = 0; b < blocks.per_chunk; ++b) sum += partial[c * blocks.per_chunk + b];
    const int64_t len = chunking.length(c);
    write_header(out, chunking, c,
                 len > 0 ? static_cast<float>(sum / static_cast<double>(len)) : 0.0f, 0.0f);
  }
  parallel_for(blocks.tasks(), n, [&](int64_t t) {
    const Source<T, kFeedback> values = src;  // a local copy, as in minmax_compress_impl
    float* const residuals = residual_out;
    const int64_t c = blocks.chunk(t);
    const float scale = header(out, chunking, c)[0];
    uint8_t* bits = out + chunking.slot_offset(c) + kHeaderBytes;
    const int64_t first = chunking.begin(c), begin = blocks.begin(t), end = blocks.end(t);
    auto encode = [&](int64_t i) {
      const float v = values(i);
      const bool bit = math::sign_bit(v);
      if constexpr (kFeedback) residuals[i] = math::sub_rn(v, math::sign_decode(bit, scale));
      return static_cast<uint8_t>(bit);
    };
    int64_t i = begin;
    const f32x8 up = splat(scale), down = splat(-scale);
    for (; i + 8 <= end; i += 8) {
      const f32x8 v = values.load8(i);
      const i32x8 positive = v >= 0.0f;  // all ones where the bit is set
      bits[(i - first) / 8] = pack_bits(positive);
      if constexpr (kFeedback) {
        const f32x8 residual = v - (positive ? up : down);
        std::memcpy(residuals + i, &residual, sizeof residual);
      }
    }
    if (i < end) {
      uint8_t byte = 0;
      for (int j = 0; i + j < end; ++j) byte |= encode(i + j) << j;
      bits[(i - first) / 8] = byte;
    }
  });
}

template <int kBits, typename T>
Status minmax_compress_bits(const T* x, const float* residual_in, int64_t n, int64_t k,
                            uint8_t* out, float* residual_out) {
  if (residual_in)
    minmax_compress_impl<kBits, T, true>(x, residual_in, n, k, out, residual_out);
  else
    minmax_compress_impl<kBits, T, false>(x, nullptr, n, k, out, nullptr);
  return {};
}

}  // namespace

template <typename T>
Status minmax_compress(Cpu, const T* x, const float* residual_in, int64_t n, int64_t k,
                       uint8_t* out, float* residual_out) {
  return minmax_compress_bits<8>(x, residual_in, n, k, out, residual_out);
}

template <typename T>
Status minmax_uint4_compress(Cpu, const T* x, const float* residual_in, int64_t n, int64_t k,
                             uint8_t* out, float* residual_out) {
  return minmax_compress_bits<4>(x, residual_in, n, k, out, residual_out);
}

template <typename T>
Status sign_compress(Cpu, const T* x, const float* residual_in, int64_t n, int64_t k, uint8_t* out,
                     float* residual_out) {
  if (residual_in)
    sign_compress_impl<T, true>(x, residual_in, n, k, out, residual_out);
  else
    sign_compress_impl<T, false>(x, nullptr, n, k, out, nullptr);
  return {};
}

namespace {

// Decodes elements [begin, end) of chunk c of a MinMaxUInt8 or MinMaxUInt4
// buffer; `emit` receives (element index, decoded float).
template <int kBits, typename Emit>
void minmax_decode_range(const uint8_t* in, const Chunking& chunking, int64_t c, int64_t begin,
                         int64_t end, Emit&& emit) {
  const float* h = header(in, chunking, c);
  const math::MinMaxGrid grid = math::minmax_grid<kBits>(h[0], h[1]);
  const uint8_t* codes = in + chunking.slot_offset(c) + kHeaderBytes;
  const int64_t first = chunking.begin(c);
  // One loop per form, so that the float32 one carries no per-element choice.
  const auto decode = [&](auto&& decode_one) {
    for (int64_t i = begin; i < end; ++i) emit(i, decode_one(code_at<kBits>(codes, i - first)));
  };
  // The grid by value: stores through `emit` could alias a captured reference.
  if (grid.wide)
    decode([grid](uint8_t q) { return math::minmax_decode_wide(q, grid); });
  else if (grid.z == 0.0f)
    decode([grid](uint8_t q) { return math::minmax_decode_at_zero(q, grid); });
  else
    decode([grid](uint8_t q) { return math::minmax_decode_at_lo(q, grid); });
}

// The same for a Sign buffer, except that each whole byte of bits reaches
// `emit` as (index of its first element, f32x8 of its eight decoded values).
template <typename Emit>
void sign_decode_range(const uint8_t* in, const Chunking& chunking, int64_t c, int64_t begin,
                       int64_t end, Emit&& emit) {
  const float scale = header(in, chunking, c)[0];
  const uint8_t* bits = in + chunking.slot_offset(c) + kHeaderBytes;
  const int64_t first = chunking.begin(c);
  int64_t i = begin;
  for (; i < end && (i - first) % 8; ++i)
    emit(i, math::sign_decode((bits[(i - first) >> 3] >> ((i - first) & 7)) & 1, scale));
  const f32x8 up = splat(scale), down = splat(-scale);
  for (; i + 8 <= end; i += 8) {
    const f32x8 values = unpack_bits(bits[(i - first) >> 3]) ? up : down;
    emit(i, values);
  }
  for (; i < end; ++i)
    emit(i, math::sign_decode((bits[(i - first) >> 3] >> ((i - first) & 7)) & 1, scale));
}

template <typename T, typename Decode>
Status decompress(const uint8_t* in, const Chunking& chunking, T* out, Decode&& decode) {
  const ChunkBlocks blocks(chunking);
  parallel_for(blocks.tasks(), chunking.n, [&](int64_t t) {
    decode(in, chunking, blocks.chunk(t), blocks.begin(t), blocks.end(t),
           [&](int64_t i, auto v) { store(out + i, v); });
  });
  return {};
}

bool is_infinite(float v) { return v == v && !math::is_finite(v); }

// The exponent field of v, kExponentBits for infinities and NaN. Loops keep the
// largest one to find overflows: an unsigned max vectorizes, a bool reduction did
// not and cost the common (finite) case a scalar pass.
constexpr uint32_t kExponentBits = 0x7f800000u;

uint32_t exponent_field(float v) { return float_bits(v) & kExponentBits; }

void resum_add(float* p, float v) { *p = math::resum_add(*p, v); }

void resum_add(float* p, f32x8 v) {
  for (int l = 0; l < 8; ++l) resum_add(p + l, v[l]);
}

// Elements [begin, end) whose float32 sum (or average) overflowed are summed
// again, scaled (math::resum_add), so that finite inputs give a finite average
// (SPEC section 2); the others keep their bits.
template <typename Decode>
void resum_scaled(const uint8_t* in, const Chunking& chunking, int64_t m, int64_t begin,
                  int64_t end, bool average, float* acc, Decode&& decode) {
  std::vector<float> scaled(end - begin);
  for (int64_t j = 0; j < chunking.k; ++j) {
    decode(in, chunking, j, j * m + begin, j * m + end,
           [&](int64_t i, auto v) { resum_add(scaled.data() + (i - j * m - begin), v); });
  }
  const float ranks = static_cast<float>(chunking.k);
  for (int64_t i = 0; i < end - begin; ++i)
    if (is_infinite(acc[i])) acc[i] = math::resum_result(scaled[i], average, ranks);
}

// The k inputs are single-chunk buffers of m elements each, laid end to end:
// exactly the layout of m*k elements in k chunks, so chunk j's element i is
// element j*m + i of that tensor.
template <typename T, typename Decode>
Status decompress_reduce(const uint8_t* in, Format format, int64_t m, int64_t k, bool average,
                         T* out, Decode&& decode) {
  const Chunking chunking{format, m * k, k};
  constexpr int64_t kTile = 4096;
  const int64_t tiles = ceil_div(m, kTile);
  parallel_for(tiles, m * k, [&](int64_t t) {
    const int64_t begin = t * kTile, end = std::min(begin + kTile, m);
    float acc[kTile] = {};
    for (int64_t j = 0; j < k; ++j) {
      decode(in, chunking, j, j * m + begin, j * m + end,
             [&](int64_t i, auto v) { accumulate(acc + (i - j * m - begin), v); });
    }
    const float ranks = static_cast<float>(k);
    uint32_t largest = 0;
    for (int64_t i = 0; i < end - begin; ++i) {
      if (average) acc[i] = math::div_rn(acc[i], ranks);
      largest = std::max(largest, exponent_field(acc[i]));
    }
    if (largest == kExponentBits) resum_scaled(in, chunking, m, begin, end, average, acc, decode);
    for (int64_t i = begin; i < end; ++i) out[i] = from_float<T>(acc[i - begin]);
  });
  return {};
}

// r[i] = f(in[begin + i]...) for i < m in float32, then math::rescaled where
// that overflowed. The check for non-finite results rides along, so the common
// case is one vectorized pass.
template <typename F, typename... In>
void apply(float* r, int64_t m, int64_t begin, const F& f, const In*... in) {
  uint32_t largest = 0;
  for (int64_t i = 0; i < m; ++i) {
    const float v = f(to_float(in[begin + i])...);
    r[i] = v;
    largest = std::max(largest, exponent_field(v));
  }
  if (largest == kExponentBits)
    for (int64_t i = 0; i < m; ++i)
      if (!math::is_finite(r[i])) r[i] = math::rescaled(f, to_float(in[begin + i])...);
}

// out[i] = f(in[i]...) block by block (see apply). float32 results go straight to
// out unless out is one of the inputs, whose values a rescaled element needs:
// then, and for 16-bit outputs, a tile buffer holds them until the tile is done.
template <typename T, typename F, typename... In>
Status elementwise(int64_t n, T* out, F&& f, const In*... in) {
  constexpr int64_t kTile = 1024;
  const bool in_place = ((static_cast<const void*>(in) == out) || ...);
  parallel_for(ceil_div(n, kBlock), n, [&](int64_t t) {
    const int64_t first = t * kBlock, end = std::min(first + kBlock, n);
    if constexpr (std::is_same_v<T, float>) {
      if (!in_place) return apply(out + first, end - first, first, f, in...);
    }
    for (int64_t begin = first; begin < end; begin += kTile) {
      const int64_t m = std::min(kTile, end - begin);
      float tile[kTile];
      apply(tile, m, begin, f, in...);
      for (int64_t i = 0; i < m; ++i) out[begin + i] = from_float<T>(tile[i]);
    }
  });
  return {};
}

}  // namespace

template <typename T>
Status minmax_decompress(Cpu, const uint8_t* in, int64_t n, int64_t k, T* out) {
  return decompress(in, Chunking{Format::kMinMaxUInt8, n, k}, out,
                    [](auto&&... a) { minmax_decode_range<8>(a...); });
}

template <typename T>
Status minmax_uint4_decompress(Cpu, const uint8_t* in, int64_t n, int64_t k, T* out) {
  return decompress(in, Chunking{Format::kMinMaxUInt4, n, k}, out,
                    [](auto&&... a) { minmax_decode_range<4>(a...); });
}

template <typename T>
Status sign_decompress(Cpu, const uint8_t* in, int64_t n, int64_t k, T* out) {
  return decompress(in, Chunking{Format::kSign, n, k}, out,
                    [](auto&&... a) { sign_decode_range(a...); });
}

template <typename T>
Status minmax_decompress_reduce(Cpu, const uint8_t* in, int64_t m, int64_t k, bool average,
                                T* out) {
  return decompress_reduce(in, Format::kMinMaxUInt8, m, k, average, out,
                           [](auto&&... a) { minmax_decode_range<8>(a...); });
}

template <typename T>
Status minmax_uint4_decompress_reduce(Cpu, const uint8_t* in, int64_t m, int64_t k, bool average,
                                      T* out) {
  return decompress_reduce(in, Format::kMinMaxUInt4, m, k, average, out,
                           [](auto&&... a) { minmax_decode_range<4>(a...); });
}

template <typename T>
Status sign_decompress_reduce(Cpu, const uint8_t* in, int64_t m, int64_t k, bool average, T* out) {
  return decompress_reduce(in, Format::kSign, m, k, average, out,
                           [](auto&&... a) { sign_decode_range(a...); });
}

template <typename T>
Status average2(Cpu, const T* a, const T* b, int64_t n, T* out) {
  return elementwise(
      n, out, [](float x, float y) { return math::average2(x, y); }, a, b);
}

template <typename T>
Status axpy(Cpu, const T* x, float a, const T* y, int64_t n, T* out) {
  return elementwise(
      n, out, [a](float xi, float yi) { return math::axpy(xi, a, yi); }, x, y);
}

template <typename T>
Status async_average(Cpu, const T* x, const T* reduced, const T* snapshot, float ranks, int64_t n,
                     T* out) {
  return elementwise(
      n, out, [ranks](float xi, float r, float s) { return math::async_average(xi, r, ranks, s); },
      x, reduced, snapshot);
}

template <typename T>
Status lowprec_decentralized_diff(Cpu, const T* x, const T* w, const T* left, const T* right,
                                  int64_t n, T* out) {
  return elementwise(
      n, out,
      [](float xi, float wi, float l, float r) {
        return math::lowprec_decentralized_diff(xi, wi, l, r);
      },
      x, w, left, right);
}

BAGUA_INSTANTIATE_KERNELS(Cpu)

}  // namespace bagua::kernels::BAGUA_CPU_ISA
