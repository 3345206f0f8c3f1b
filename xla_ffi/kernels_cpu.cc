// CPU implementations of the kernels: OpenMP across blocks of elements, and
// inner loops over fixed-width lanes so the compiler vectorizes them without
// reassociating float arithmetic.
//
// This file is compiled once per instruction set (BAGUA_CPU_ISA names the
// namespace: generic, avx2, avx512; see CMakeLists.txt), and
// kernels_cpu_dispatch.cc picks the best one the processor supports at run time.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "cpu_lanes.h"
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
static_assert(kBlock % kMinMaxGroupElements == 0, "a task starts on a group boundary");
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

  // Calls f(group) for each group holding elements of task t (a task starts on a
  // group boundary: kBlock is a multiple of a group). An empty chunk's one group
  // goes to the chunk's first task.
  template <typename F>
  void for_each_group(int64_t t, F&& f) const {
    const int64_t c = chunk(t);
    const int64_t index =
        chunking.group_index(c) + (begin(t) - chunking.begin(c)) / group_elements(chunking.format);
    if (chunking.length(c) == 0 && t % per_chunk == 0) f(chunking.group(index));
    for (int64_t g = index, i = begin(t); i < end(t); ++g) {
      const Group group = chunking.group(g);
      f(group);
      i = group.first + group.length;
    }
  }
};

// The value a compressor encodes: x, or x + residual with error feedback.
template <typename T, bool kWithFeedback>
struct Source {
  using Element = T;
  static constexpr bool kFeedback = kWithFeedback;
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

// The least and the greatest value of [begin, end) by math::float_key (so -0 <
// +0, as on the GPU), NaN for both if one is NaN.
template <typename Src>
Range min_max(const Src& src, int64_t begin, int64_t end) {
  constexpr int32_t kMax = std::numeric_limits<int32_t>::max(), kMin = -kMax - 1;
  i32x8 lo = {kMax, kMax, kMax, kMax, kMax, kMax, kMax, kMax}, hi = ~lo, nan = {};
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const f32x8 v = src.load8(i);
    const i32x8 key = float_keys(v);
    lo = key < lo ? key : lo;
    hi = key > hi ? key : hi;
    nan |= v != v;
  }
  int32_t l = kMax, h = kMin;
  bool any_nan = false;
  for (int j = 0; j < 8; ++j) {
    l = std::min(l, lo[j]);
    h = std::max(h, hi[j]);
    any_nan |= nan[j] != 0;
  }
  for (; i < end; ++i) {
    const float v = src(i);
    l = std::min(l, math::float_key(v));
    h = std::max(h, math::float_key(v));
    any_nan |= v != v;
  }
  if (any_nan)
    return {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::quiet_NaN()};
  return {math::key_float(l), math::key_float(h)};
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

// Writes a group's 16-byte header and zeroes its padding, so equal inputs always
// give equal bytes on the wire.
void write_header(uint8_t* out, Format format, const Group& group, float a, float b) {
  uint8_t* at = out + group.offset;
  const float header[4] = {a, b, 0.0f, 0.0f};
  std::memcpy(at, header, sizeof header);
  const int64_t used = kHeaderBytes + payload_bytes(format, group.length);
  std::memset(at + used, 0, group_bytes(format, group.length) - used);
}

// The sign compressor reads each chunk twice: for its header (mean |x|), then to
// encode it. All threads measure a batch of chunks and then encode it while the
// batch is still in the last-level cache; measuring the whole tensor first would
// read it all from memory again. A batch is kBatchBytes of input, or one chunk if
// larger. `measure(t)` gives task t's partial statistic; `encode(t, partials)`
// gets its chunk's partials (one per block), and the chunk's first task writes
// the header. One barrier per batch.
constexpr int64_t kBatchBytes = int64_t{8} << 20;

template <typename T, typename Measure, typename Encode>
void measure_then_encode(const ChunkBlocks& blocks, Measure&& measure, Encode&& encode) {
  const Chunking& chunking = blocks.chunking;
  const int64_t chunk_bytes = std::max<int64_t>(1, chunking.chunk_elements() * sizeof(T));
  const int64_t batch = std::max<int64_t>(1, kBatchBytes / chunk_bytes);
  std::vector<decltype(measure(int64_t{}))> partial(blocks.tasks());
#pragma omp parallel if (chunking.n >= kParallelThreshold && blocks.tasks() > 1)
  {
    const IeeeSubnormals ieee;
    for (int64_t first = 0; first < chunking.k; first += batch) {
      const int64_t begin = first * blocks.per_chunk;
      const int64_t end = std::min(first + batch, chunking.k) * blocks.per_chunk;
#pragma omp for schedule(static)
      for (int64_t t = begin; t < end; ++t) partial[t] = measure(t);
#pragma omp for schedule(static) nowait
      for (int64_t t = begin; t < end; ++t)
        encode(t, partial.data() + blocks.chunk(t) * blocks.per_chunk);
    }
  }
}

// Each group is measured and then encoded while it is still in the cache: one
// pass over memory.
template <int kBits, typename Src>
void minmax_compress_group(const Src& src, const Group& group, uint8_t* out, float* residual_out) {
  constexpr float kTop = math::MinMaxCodes<kBits>::kTop;
  constexpr bool kFeedback = Src::kFeedback;
  constexpr Format format = kBits == 8 ? Format::kMinMaxUInt8 : Format::kMinMaxUInt4;
  // Local copies: the code stores could alias the captured ones, which the loops
  // would then reload at every step.
  const Src values = src;
  float* const residuals = residual_out;
  const int64_t first = group.first, end = group.first + group.length;
  Range r = min_max(values, first, end);
  if (group.length == 0) r.lo = r.hi = 0.0f;
  write_header(out, format, group, r.lo, r.hi);
  const math::MinMaxGrid grid = math::minmax_grid<kBits>(r.lo, r.hi);
  uint8_t* codes = out + group.offset + kHeaderBytes;
  // math::minmax_encode and minmax_decode, eight lanes at a time (the byte stores
  // could alias the input, so the compiler would not vectorize the scalar loop).
  const f32x8 z8 = splat(grid.z), scale8 = splat(grid.scale), base8 = splat(grid.base),
              step8 = splat(grid.step);
  int64_t i = first;
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
    // A finite, non-constant float32 group: |(x - z) * scale| <= S (1 + 2^-24)^2 < S + 1,
    // so neither a NaN nor the first clamp can occur, and subtracting the integer base
    // from the rounding constant first is exact: the same codes in fewer steps.
    const f32x8 magic8 = splat(kRoundingMagic), offset8 = splat(kRoundingMagic + grid.base);
    encode8([&](f32x8 v) { return clamp(((v - z8) * scale8 + magic8) - offset8, 0.0f, kTop); });
  } else if (!grid.wide) {  // constant groups, NaN and infinities
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
}

template <int kBits, typename Src>
void minmax_compress_impl(const Src& src, int64_t n, int64_t k, uint8_t* out, float* residual_out) {
  const Chunking chunking{kBits == 8 ? Format::kMinMaxUInt8 : Format::kMinMaxUInt4, n, k};
  const ChunkBlocks blocks(chunking);
  parallel_for(blocks.tasks(), n, [&](int64_t t) {
    blocks.for_each_group(t, [&](const Group& group) {
      minmax_compress_group<kBits>(src, group, out, residual_out);
    });
  });
}

// Bits are packed a byte (8 elements) at a time; every block but a chunk's last
// starts and ends on a byte boundary of its chunk.
template <typename Src>
void sign_compress_impl(const Src& src, int64_t n, int64_t k, uint8_t* out, float* residual_out) {
  constexpr bool kFeedback = Src::kFeedback;
  const Chunking chunking{Format::kSign, n, k};
  const ChunkBlocks blocks(chunking);
  const auto measure = [&](int64_t t) { return abs_sum(src, blocks.begin(t), blocks.end(t)); };
  measure_then_encode<typename Src::Element>(
      blocks, measure, [&](int64_t t, const double* partials) {
        const Src values = src;  // a local copy, as in minmax_compress_impl
        float* const residuals = residual_out;
        const int64_t c = blocks.chunk(t);
        double sum = 0;
        for (int64_t b = 0; b < blocks.per_chunk; ++b) sum += partials[b];
        const int64_t len = chunking.length(c);
        const float scale = len > 0 ? static_cast<float>(sum / static_cast<double>(len)) : 0.0f;
        if (t % blocks.per_chunk == 0)
          write_header(out, chunking.format, chunking.group(c), scale, 0.0f);
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

// Runs compress(src) on the Source of x, with or without a residual: the choice
// becomes a type, so that the hot loops carry no branch.
template <typename T, typename Compress>
Status with_source(const T* x, const float* residual_in, Compress&& compress) {
  if (residual_in)
    compress(Source<T, true>{x, residual_in});
  else
    compress(Source<T, false>{x, nullptr});
  return {};
}

}  // namespace

template <typename T>
Status minmax_compress(Cpu, const T* x, const float* residual_in, int64_t n, int64_t k,
                       uint8_t* out, float* residual_out) {
  return with_source(x, residual_in, [&](const auto& src) {
    minmax_compress_impl<8>(src, n, k, out, residual_out);
  });
}

template <typename T>
Status minmax_uint4_compress(Cpu, const T* x, const float* residual_in, int64_t n, int64_t k,
                             uint8_t* out, float* residual_out) {
  return with_source(x, residual_in, [&](const auto& src) {
    minmax_compress_impl<4>(src, n, k, out, residual_out);
  });
}

template <typename T>
Status sign_compress(Cpu, const T* x, const float* residual_in, int64_t n, int64_t k, uint8_t* out,
                     float* residual_out) {
  return with_source(x, residual_in,
                     [&](const auto& src) { sign_compress_impl(src, n, k, out, residual_out); });
}

namespace {

// One group of a compressed buffer, ready to decode: its header is read and its
// constants computed once, however many ranges of it are decoded (a reduction
// decodes each group a tile at a time). decode(begin, end, emit) decodes elements
// [begin, end) of the tensor, which the group holds; `emit` receives (element
// index, decoded float).
template <int kBits>
struct MinMaxGroup {
  math::MinMaxGrid grid;
  const uint8_t* codes;
  int64_t first;

  MinMaxGroup(const uint8_t* in, const Group& group)
      : grid(math::minmax_grid<kBits>(bounds(in, group)[0], bounds(in, group)[1])),
        codes(in + group.offset + kHeaderBytes),
        first(group.first) {}

  static const float* bounds(const uint8_t* in, const Group& group) {
    return reinterpret_cast<const float*>(in + group.offset);
  }

  template <typename Emit>
  void decode(int64_t begin, int64_t end, Emit&& emit) const {
    // Local copies: stores through `emit` could alias the members.
    const math::MinMaxGrid g = grid;
    const uint8_t* const q = codes;
    const int64_t f = first;
    // One loop per form, so that the float32 one carries no per-element choice.
    // 4-bit codes go a byte (two elements) at a time: a nibble picked by the
    // element's parity kept GCC from vectorizing the loop. Decoding starts at a
    // group's first element or at a tile of one, so at a byte of codes.
    const auto each = [&](auto&& decode_one) {
      int64_t i = begin;
      if constexpr (kBits == 4) {
        const uint8_t* const bytes = q + (i - f) / 2;
        const int64_t pairs = (end - i) / 2;
        for (int64_t p = 0; p < pairs; ++p) {
          emit(i + 2 * p, decode_one(bytes[p] & 0xf));
          emit(i + 2 * p + 1, decode_one(bytes[p] >> 4));
        }
        i += 2 * pairs;
      }
      for (; i < end; ++i) emit(i, decode_one(code_at<kBits>(q, i - f)));
    };
    if (g.wide)
      each([g](uint8_t v) { return math::minmax_decode_wide(v, g); });
    else if (g.z == 0.0f)
      each([g](uint8_t v) { return math::minmax_decode_at_zero(v, g); });
    else
      each([g](uint8_t v) { return math::minmax_decode_at_lo(v, g); });
  }
};

// The same for a Sign group (a whole chunk), except that each whole byte of bits
// reaches `emit` as (index of its first element, f32x8 of its eight decoded values).
struct SignGroup {
  float scale;
  const uint8_t* bits;
  int64_t first;

  SignGroup(const uint8_t* in, const Group& group)
      : scale(reinterpret_cast<const float*>(in + group.offset)[0]),
        bits(in + group.offset + kHeaderBytes),
        first(group.first) {}

  template <typename Emit>
  void decode(int64_t begin, int64_t end, Emit&& emit) const {
    const float s = scale;
    const uint8_t* const b = bits;
    const int64_t f = first;
    const auto one = [&](int64_t i) {
      return math::sign_decode((b[(i - f) >> 3] >> ((i - f) & 7)) & 1, s);
    };
    int64_t i = begin;
    for (; i < end && (i - f) % 8; ++i) emit(i, one(i));
    const f32x8 up = splat(s), down = splat(-s);
    for (; i + 8 <= end; i += 8) {
      const f32x8 values = unpack_bits(b[(i - f) >> 3]) ? up : down;
      emit(i, values);
    }
    for (; i < end; ++i) emit(i, one(i));
  }
};

template <typename Decoder, typename T>
Status decompress(const uint8_t* in, const Chunking& chunking, T* out) {
  const ChunkBlocks blocks(chunking);
  parallel_for(blocks.tasks(), chunking.n, [&](int64_t t) {
    blocks.for_each_group(t, [&](const Group& group) {
      Decoder(in, group).decode(std::max(blocks.begin(t), group.first),
                                std::min(blocks.end(t), group.first + group.length),
                                [&](int64_t i, auto v) { store(out + i, v); });
    });
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
// `peer(j)` is the decoder of input j's group that holds the range.
template <typename Peer>
void resum_scaled(const Peer& peer, int64_t k, int64_t m, int64_t begin, int64_t end, bool average,
                  float* acc) {
  std::vector<float> scaled(end - begin);
  for (int64_t j = 0; j < k; ++j) {
    peer(j).decode(j * m + begin, j * m + end,
                   [&](int64_t i, auto v) { resum_add(scaled.data() + (i - j * m - begin), v); });
  }
  const float ranks = static_cast<float>(k);
  for (int64_t i = 0; i < end - begin; ++i)
    if (is_infinite(acc[i])) acc[i] = math::resum_result(scaled[i], average, ranks);
}

// Dividing by a power of two d is multiplying by the exact 1 / d: both round the
// same real number, so the bits are the same, and a vector division costs
// several times a multiplication.
bool is_power_of_two(float d) {
  int exponent;
  return d > 0.0f && math::is_finite(d) && std::frexp(d, &exponent) == 0.5f;
}

// Calls f(share), share(v) being a sum v over ranks divided by ranks if
// average, else v itself: one function per case, so loops carry no choice.
template <typename F>
void with_share(bool average, float ranks, F&& f) {
  if (!average) {
    f([](float v) { return v; });
  } else if (is_power_of_two(ranks)) {
    const float inverse = math::div_rn(1.0f, ranks);
    f([inverse](float v) { return math::mul_rn(v, inverse); });
  } else {
    f([ranks](float v) { return math::div_rn(v, ranks); });
  }
}

// The k inputs are single-chunk buffers of m elements each, laid end to end:
// exactly the layout of m*k elements in k chunks, so chunk j's element i is
// element j*m + i of that tensor.
template <typename Decoder, typename T>
Status decompress_reduce(const uint8_t* in, Format format, int64_t m, int64_t k, bool average,
                         T* out) {
  const Chunking chunking{format, m * k, k};
  constexpr int64_t kTile = 4096;
  static_assert(kMinMaxGroupElements % kTile == 0, "a tile lies in one group of each input");
  // A task is a segment of the output that lies in one group of each input
  // (a min-max group, or a tile of a sign chunk): it computes its k decoders
  // (their grids) itself, so that they are computed once and in parallel.
  const int64_t segment = format == Format::kSign ? kTile : kMinMaxGroupElements;
  const int64_t per_input = groups_of(format, m);
  parallel_for(ceil_div(m, segment), m * k, [&](int64_t s) {
    const int64_t group = s * segment / group_elements(format);
    std::vector<Decoder> peers;
    peers.reserve(k);
    for (int64_t j = 0; j < k; ++j) peers.emplace_back(in, chunking.group(j * per_input + group));
    const auto peer = [&](int64_t j) -> const Decoder& { return peers[j]; };
    for (int64_t begin = s * segment; begin < std::min((s + 1) * segment, m); begin += kTile) {
      const int64_t end = std::min(begin + kTile, m);
      float acc[kTile] = {};
      for (int64_t j = 0; j < k; ++j) {
        peer(j).decode(j * m + begin, j * m + end,
                       [&](int64_t i, auto v) { accumulate(acc + (i - j * m - begin), v); });
      }
      // The average rides along with the stores; a tile that overflowed (rarely)
      // is averaged in place, summed again where needed and stored again.
      const auto store_tile = [&](const auto& share) {
        uint32_t largest = 0;
        for (int64_t i = begin; i < end; ++i) {
          const float v = share(acc[i - begin]);
          out[i] = from_float<T>(v);
          largest = std::max(largest, exponent_field(v));
        }
        return largest;
      };
      with_share(average, static_cast<float>(k), [&](const auto& share) {
        if (store_tile(share) != kExponentBits) return;
        for (int64_t i = 0; i < end - begin; ++i) acc[i] = share(acc[i]);
        resum_scaled(peer, k, m, begin, end, average, acc);
        store_tile([](float v) { return v; });
      });
    }
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
  return decompress<MinMaxGroup<8>>(in, Chunking{Format::kMinMaxUInt8, n, k}, out);
}

template <typename T>
Status minmax_uint4_decompress(Cpu, const uint8_t* in, int64_t n, int64_t k, T* out) {
  return decompress<MinMaxGroup<4>>(in, Chunking{Format::kMinMaxUInt4, n, k}, out);
}

template <typename T>
Status sign_decompress(Cpu, const uint8_t* in, int64_t n, int64_t k, T* out) {
  return decompress<SignGroup>(in, Chunking{Format::kSign, n, k}, out);
}

template <typename T>
Status minmax_decompress_reduce(Cpu, const uint8_t* in, int64_t m, int64_t k, bool average,
                                T* out) {
  return decompress_reduce<MinMaxGroup<8>>(in, Format::kMinMaxUInt8, m, k, average, out);
}

template <typename T>
Status minmax_uint4_decompress_reduce(Cpu, const uint8_t* in, int64_t m, int64_t k, bool average,
                                      T* out) {
  return decompress_reduce<MinMaxGroup<4>>(in, Format::kMinMaxUInt4, m, k, average, out);
}

template <typename T>
Status sign_decompress_reduce(Cpu, const uint8_t* in, int64_t m, int64_t k, bool average, T* out) {
  return decompress_reduce<SignGroup>(in, Format::kSign, m, k, average, out);
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
  Status status;
  with_share(true, ranks, [&](const auto& share) {
    status = elementwise(
        n, out,
        [share](float xi, float r, float s) {
          return math::async_average_of_share(xi, share(r), s);
        },
        x, reduced, snapshot);
  });
  return status;
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
