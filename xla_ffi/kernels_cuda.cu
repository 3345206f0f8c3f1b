// CUDA implementations of the kernels and their host drivers. They are bound
// by memory bandwidth, so the design is about bytes in flight, with few
// instructions per byte (docs/formats.md has the numbers):
//
// * Every access of a warp is one contiguous run: a lane's elements are slots of
//   U consecutive ones, slot j of lane l at element U * (32 j + l) of the warp's
//   step, and U = 16 / sizeof(T) makes each slot one 16-byte load or store
//   (cuda_lanes.h). Codes and sign bits move in the slot's share of bytes. Where
//   a chunk starts misaligned, U = 1 keeps the accesses coalesced.
// * Loads are issued ahead: each kernel asks the L2 cache for its next item (a
//   tile, a warp step) before it loads and works on the current one, and a lane
//   issues all its loads of an item before it uses any, so that enough bytes are
//   in flight to cover the memory latency (CUB sizes an H200 for 48 KiB per
//   multiprocessor) without holding them in registers.
// * Constants are computed once per tile: a min-max grid once per group (two
//   divisions), in decompress-reduce once per input and segment, into shared
//   memory.
// * Min-max compression is one pass over memory: a block holds a whole group of
//   8192 elements in registers (32 a lane), reduces its bounds, writes its header
//   and encodes it from the registers (the rare wide form of SPEC section 2
//   reads the group again, a slot at a time). Sign compression without error feedback
//   is one pass too (the bits do not depend on the scale): it writes the bits
//   while it sums |x|, and the scale is written at the end.
// * Decompress-reduce issues the loads of many inputs before it adds any, then
//   adds them in the fixed order j = 0..k-1 (the CPU's, so the bits agree).
// * Loops stride over the grid, and grids are sized to the blocks the device
//   holds at once, so one launch covers any tensor.
//
// All arithmetic goes through bagua::math and the dtype conversions, which are
// the same code the CPU kernels run, so the bytes agree with them. Compressed
// buffers must be 16-byte aligned (the layout aligns every group relative to the
// buffer's start); tensors may have any alignment of their element type.
//
// The parts: cuda_launch.h (launches and their status), cuda_lanes.h (what a
// lane holds, loads and stores), cuda_codecs.h (each codec's statistics,
// encoders and decoders), cuda_geometry.h (grid arithmetic).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "cuda_codecs.h"
#include "cuda_lanes.h"
#include "cuda_launch.h"
#include "kernels.h"
#include "layout.h"
#include "numerics.h"

namespace bagua::kernels {
namespace {

// The warp's step of a tile (one step per warp: tiles are kTileElements).
template <int U>
__device__ Step<U> tile_step(int64_t length) {
  return {int64_t{warp_id()} * kStep, length};
}

// The block stores a group's header (a, b, 0, 0), thread 0, and zeroes the
// bytes from `written` (the end of what its lanes store) to the end of its
// padded payload, fewer than 16, a thread each.
__device__ void store_group_header(uint8_t* header, float a, float b, int64_t written,
                                   int64_t padded) {
  store_global(reinterpret_cast<uint4*>(header), make_uint4(float_bits(a), float_bits(b), 0, 0),
               threadIdx.x == 0);
  store_global(header + kHeaderBytes + written + threadIdx.x, uint8_t{0},
               threadIdx.x < padded - written);
}

// The kernel's chunking with its format as a compile-time constant, so that the
// group arithmetic (sizes, divisions) folds instead of holding registers.
__device__ Chunking with_format(const Chunking& shape, Format format) {
  return {format, shape.n, shape.k};
}

// ---- Min-max compression: one group a block, one pass -----------------------

template <int kBits, int U, typename T, bool kFeedback>
__device__ void compress_group(const Source<T, kFeedback>& src, const Group& group, uint8_t* out,
                               float* residual_out) {
  constexpr Format kFormat = MinMaxCodec<kBits>::kFormat;
  const Step<U> step = tile_step<U>(group.length);
  float v[kPerLane];
  src.load(group.first, step, v);
  MinMaxKeys keys;
#pragma unroll
  for (int j = 0; j < Step<U>::kSlots; ++j) {
    const int count = step.count(j);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (u < count) keys.add(v[j * U + u]);
  }
  const float2 bounds = keys.block_bounds(group.length);
  uint8_t* header = out + group.offset;
  uint8_t* codes = header + kHeaderBytes;
  store_group_header(header, bounds.x, bounds.y, written_code_bytes<kBits, U>(group.length),
                     align_up(payload_bytes(kFormat, group.length)));
  const math::MinMaxGrid grid = math::minmax_grid<kBits>(bounds.x, bounds.y);
  // Encodes slot j's values w (each replaced by its residual) and stores them.
  auto encode_and_store = [&](int j, float* w, auto&& encode_one, auto&& decode_one) {
    const int count = step.count(j);
    const auto word = encode_slot<kBits, U>(w, count, encode_one, decode_one);
    store_codes<kBits, U>(codes, step.at(j), count, word);
    if constexpr (kFeedback)
      store_slot<float, U>(residual_out + group.first + step.at(j), count, pack<float, U>(w));
  };
  if (!grid.wide) {
#pragma unroll
    for (int j = 0; j < Step<U>::kSlots; ++j)
      encode_and_store(
          j, v + j * U, [&](float x) { return math::minmax_encode_f32<kBits>(x, grid); },
          [&](uint8_t q) { return math::minmax_decode_f32(q, grid); });
  } else {
    // The wide form (SPEC section 2), rare, reads the group's values again a
    // slot at a time, so that the double arithmetic of a lane's 32 values never
    // overlaps in registers (ptxas interleaved it, and spilled). Its double
    // scale is computed here, out of the float32 form's registers.
    const double scale = math::minmax_wide_scale<kBits>(grid);
#pragma unroll 1
    for (int j = 0; j < Step<U>::kSlots; ++j) {
      float w[U];
      src.slot_values(group.first, step, j, w);
      encode_and_store(
          j, w, [&](float x) { return math::minmax_encode_wide<kBits>(x, grid, scale); },
          [&](uint8_t q) { return math::minmax_decode_wide(q, grid); });
    }
  }
}

template <int kBits, int U, typename T, bool kFeedback>
__global__ void __launch_bounds__(kThreads, 2)
    minmax_compress_kernel(Source<T, kFeedback> src, Chunking shape, uint8_t* out,
                           float* residual_out) {
  const Chunking chunking = with_format(shape, MinMaxCodec<kBits>::kFormat);
  const int64_t groups = chunking.group_count();
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
    prefetch_ahead<kFeedback ? kItemsAhead : kCompressItemsAhead>(
        g, blockIdx.x, groups, gridDim.x, [&](int64_t next) {
          const Group group = chunking.group(next);
          src.prefetch(group.first, group.length);
        });
    compress_group<kBits, U>(src, chunking.group(g), out, residual_out);
  }
}

// ---- Decoding: one tile a block ---------------------------------------------

// Tile t of a chunked buffer: its elements, its group's header and where the
// tile's codes start in the group's payload.
struct EncodedTile {
  Piece tile;
  const uint8_t* header;
  int64_t offset;  // the tile's first element, counted in its group
};

__device__ EncodedTile encoded_tile(const uint8_t* in, const Chunking& chunking, int64_t t) {
  EncodedTile e;
  e.tile = chunking.piece(t, kTileElements);
  const Group group = chunking.group_holding(e.tile.chunk, e.tile.first);
  e.header = in + group.offset;
  e.offset = e.tile.first - group.first;
  return e;
}

// The block asks the L2 cache for a tile's header and codes.
template <typename Codec>
__device__ void prefetch_tile(const EncodedTile& e) {
  if (threadIdx.x == 0) prefetch_line(e.header);
  prefetch_range(e.header + kHeaderBytes + e.offset * Codec::kCodeBits / 8,
                 e.tile.length * Codec::kCodeBits / 8, threadIdx.x, kThreads);
}

template <typename Codec, int U, typename T>
__global__ void __launch_bounds__(kThreads, 3)
    decompress_kernel(const uint8_t* in, Chunking shape, T* out) {
  const Chunking chunking = with_format(shape, Codec::kFormat);
  const int64_t tiles = chunking.piece_index(chunking.k, kTileElements);
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    prefetch_ahead(t, blockIdx.x, tiles, gridDim.x,
                   [&](int64_t next) { prefetch_tile<Codec>(encoded_tile(in, chunking, next)); });
    const EncodedTile e = encoded_tile(in, chunking, t);
    const Step<U> step = tile_step<U>(e.tile.length);
    const uint4 header = load_global(reinterpret_cast<const uint4*>(e.header));
    const auto codes = Codec::load(e.header + kHeaderBytes, e.offset, step);
    const typename Codec::Params params = Codec::params(header);
#pragma unroll
    for (int j = 0; j < Step<U>::kSlots; ++j) {
      float v[U];
      Codec::decode(params, codes, j, v);
      store_slot<T, U>(out + e.tile.first + step.at(j), step.count(j), pack<T, U>(v));
    }
  }
}

// ---- Decompress-reduce ------------------------------------------------------

// What a reduction's sum becomes: itself, or the average over k inputs, by
// multiplying with the exact 1 / k where k is a power of two (the same bits as
// dividing: both round the same real number), else by dividing.
struct Share {
  bool average;
  float k;
  float inverse;  // 1 / k where k is a power of two, else 0

  __device__ float operator()(float v) const {
    if (!average) return v;
    return inverse != 0.0f ? math::mul_rn(v, inverse) : math::div_rn(v, k);
  }
};

__device__ bool is_infinite(float v) { return v == v && !math::is_finite(v); }

// The k inputs are single-chunk buffers of m elements, `slot` bytes apart; a
// block reduces a segment of kThreads x kReducePerLane elements (the codec's),
// each warp one step. The segment's group is at the same place in every input;
// its parameters (grids or scales) are computed once per input into shared
// memory, kThreads inputs at a time. A lane then loads the codes of
// kReduceInFlight inputs before it decodes and adds any of them, in the order
// j = 0..k-1 of the CPU kernels. Where the output takes no vector slots (U = 1),
// a min-max lane still loads its codes as one word: it holds E consecutive
// elements (a slot of L = E), which it stores one by one.
template <typename Codec, int U, typename T>
__global__ void __launch_bounds__(kThreads, Codec::kReduceBlocks)
    decompress_reduce_kernel(const uint8_t* in, int64_t m, int64_t k, int64_t slot, Share share,
                             T* out) {
  constexpr int E = Codec::kReducePerLane;
  constexpr int L = U == 1 && Codec::kCodeBits > 1 ? E : U;  // the lane's slot width
  constexpr int kInFlight = Codec::template kReduceInFlight<L>;
  constexpr int64_t kSegment = int64_t{kThreads} * E;
  constexpr Format kFormat = Codec::kFormat;
  static_assert(kMinMaxGroupElements % kSegment == 0, "a segment lies in one group");
  using Step = kernels::Step<L, E>;
  using Codes = typename Codec::template Codes<L, E>;
  __shared__ typename Codec::Params params[kThreads];
  for (int64_t s = blockIdx.x; s * kSegment < m; s += gridDim.x) {
    // The segment's group in each input: its header, and its first element.
    const int64_t group = s * kSegment / group_elements(kFormat);
    const int64_t header_at = group > 0 ? group * group_bytes(kFormat, group_elements(kFormat)) : 0;
    const int64_t offset = group > 0 ? -group * group_elements(kFormat) : 0;
    const Step step{s * kSegment + int64_t{warp_id()} * 32 * E, m};
    float acc[E] = {};
    for (int64_t batch = 0; batch < k; batch += kThreads) {
      const bool mine = batch + threadIdx.x < k;
      const uint4 header = load_global(
          reinterpret_cast<const uint4*>(in + (batch + threadIdx.x) * slot + header_at), mine);
      if (mine) params[threadIdx.x] = Codec::params(header);
      __syncthreads();
      const int inputs = static_cast<int>(min(int64_t{kThreads}, k - batch));
      for (int r = 0; r < inputs; r += kInFlight) {
        Codes codes[kInFlight];
        const uint8_t* payload = in + (batch + r) * slot + header_at + kHeaderBytes;
#pragma unroll
        for (int q = 0; q < kInFlight; ++q, payload += slot)
          if (r + q < inputs) codes[q] = Codec::load(payload, offset, step);
#pragma unroll
        for (int q = 0; q < kInFlight; ++q) {
          if (r + q >= inputs) continue;  // the same for the whole block
#pragma unroll
          for (int j = 0; j < Step::kSlots; ++j) {
            float v[L];
            Codec::decode(params[r + q], codes[q], j, v);
#pragma unroll
            for (int u = 0; u < L; ++u) acc[j * L + u] = math::add_rn(acc[j * L + u], v[u]);
          }
        }
      }
      __syncthreads();  // the next batch overwrites `params`
    }
    bool overflow = false;
#pragma unroll
    for (int i = 0; i < E; ++i) {
      acc[i] = share(acc[i]);
      overflow |= is_infinite(acc[i]);
    }
    // The elements whose float32 sum (or average) overflowed are summed again,
    // scaled by 2^-64 (math::resum_add), so that finite inputs give a finite
    // average (SPEC section 2); the others keep their bits. Rare: the parameters
    // are computed again from the headers. Uniform over the warp (sign decoding
    // shuffles).
    if (__any_sync(kFullMask, overflow)) {
      float scaled[E] = {};
      for (int64_t j = 0; j < k; ++j) {
        const uint8_t* header = in + j * slot + header_at;
        const typename Codec::Params p =
            Codec::params(load_global(reinterpret_cast<const uint4*>(header)));
        const Codes codes = Codec::load(header + kHeaderBytes, offset, step);
#pragma unroll
        for (int i = 0; i < Step::kSlots; ++i) {
          float v[L];
          Codec::decode(p, codes, i, v);
#pragma unroll
          for (int u = 0; u < L; ++u) scaled[i * L + u] = math::resum_add(scaled[i * L + u], v[u]);
        }
      }
#pragma unroll
      for (int i = 0; i < E; ++i)
        if (is_infinite(acc[i])) acc[i] = math::resum_result(scaled[i], share.average, share.k);
    }
    if constexpr (L == U) {
      store_step<T, U, E>(out, step, acc);
    } else {
#pragma unroll
      for (int i = 0; i < E; ++i)
        store_global(out + step.first + i, from_float<T>(acc[i]), i < step.left);
    }
  }
}

// ---- Sign compression -------------------------------------------------------

// Gives each chunk's header the identity of its sum (zeros).
__global__ void __launch_bounds__(kThreads) sign_init_kernel(Chunking chunking, uint8_t* out) {
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < chunking.k;
       i += int64_t{gridDim.x} * kThreads)
    store_global(reinterpret_cast<uint4*>(out + chunking.slot_offset(i)), make_uint4(0, 0, 0, 0));
}

// Calls body(tile, step) for each tile of [first, end) of the sign codec's
// chunks that the block strides over, its next tiles requested first.
template <int U, typename T, bool kFeedback, typename Body>
__device__ void for_each_sign_tile(const Source<T, kFeedback>& src, const Chunking& chunking,
                                   int64_t first, int64_t end, Body&& body) {
  for (int64_t t = first + blockIdx.x; t < end; t += gridDim.x) {
    prefetch_ahead(t, first + blockIdx.x, end, gridDim.x, [&](int64_t next) {
      const Piece tile = chunking.piece(next, kTileElements);
      src.prefetch(tile.first, tile.length);
    });
    const Piece tile = chunking.piece(t, kTileElements);
    body(tile, tile_step<U>(tile.length));
  }
}

// Tiles [first, end) of the sign codec's chunks: sums |y| into each chunk's
// header and writes the bits, which do not depend on the scale.
template <int U, typename T, bool kFeedback>
__global__ void __launch_bounds__(kThreads, kFeedback ? 2 : 3)
    sign_stats_kernel(Source<T, kFeedback> src, Chunking shape, int64_t first, int64_t end,
                      uint8_t* out) {
  const Chunking chunking = with_format(shape, Format::kSign);
  for_each_sign_tile<U>(src, chunking, first, end, [&](const Piece& tile, const Step<U>& step) {
    float v[kPerLane];
    src.load(tile.first, step, v);
    SignSum sum;
    uint32_t bits[Step<U>::kSlots];
#pragma unroll
    for (int j = 0; j < Step<U>::kSlots; ++j) {
      const int count = step.count(j);
      bits[j] = 0;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (u >= count) continue;
        sum.add(v[j * U + u]);
        bits[j] |= uint32_t{math::sign_bit(v[j * U + u])} << u;
      }
    }
    uint8_t* header = out + chunking.slot_offset(tile.chunk);
    const int64_t offset = tile.first - chunking.begin(tile.chunk);
    store_sign_word<U>(header + kHeaderBytes, offset + step.base, offset + tile.length,
                       gather_sign_word<U>(bits));
    sum.commit(header);
  });
}

// With error feedback, a second pass over tiles [first, end): residual_out =
// y - decode(bit), with the scale of the chunk's complete sum.
template <int U, typename T>
__global__ void __launch_bounds__(kThreads, 2)
    sign_feedback_kernel(Source<T, true> src, Chunking shape, int64_t first, int64_t end,
                         const uint8_t* out, float* residual_out) {
  const Chunking chunking = with_format(shape, Format::kSign);
  for_each_sign_tile<U>(src, chunking, first, end, [&](const Piece& tile, const Step<U>& step) {
    const float scale =
        sign_scale(out + chunking.slot_offset(tile.chunk), chunking.length(tile.chunk));
    float v[kPerLane];
    src.load(tile.first, step, v);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      v[i] = math::sub_rn(v[i], math::sign_decode(math::sign_bit(v[i]), scale));
#pragma unroll
    for (int j = 0; j < Step<U>::kSlots; ++j)
      store_slot<float, U>(residual_out + tile.first + step.at(j), step.count(j),
                           pack<float, U>(v + j * U));
  });
}

// Turns each header's sum into the scale, and zeroes the payload's padding
// beyond the words of bits the stats pass wrote.
__global__ void __launch_bounds__(kThreads) sign_finalize_kernel(Chunking chunking, uint8_t* out) {
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < chunking.k;
       i += int64_t{gridDim.x} * kThreads) {
    const int64_t length = chunking.length(i);
    uint8_t* header = out + chunking.slot_offset(i);
    store_global(reinterpret_cast<uint4*>(header),
                 make_uint4(float_bits(sign_scale(header, length)), 0, 0, 0));
    for (int64_t b = 4 * ceil_div(length, 32); b < align_up(payload_bytes(Format::kSign, length));
         ++b)
      store_global(header + kHeaderBytes + b, uint8_t{0});
  }
}

// ---- Elementwise helpers ----------------------------------------------------

template <typename T, int N>
struct Inputs {
  const T* at[N];
};

// A lane's elements per warp step: two 16-byte slots of each input.
template <typename T>
constexpr int kElementwisePerLane = 32 / sizeof(T);

template <typename F, int E, size_t... A>
__device__ float apply(const F& f, const float (&v)[sizeof...(A)][E], int i,
                       std::index_sequence<A...>) {
  return f(v[A][i]...);
}
template <typename F, int E, size_t... A>
__device__ float apply_rescaled(const F& f, const float (&v)[sizeof...(A)][E], int i,
                                std::index_sequence<A...>) {
  return math::rescaled(f, v[A][i]...);
}

// out = f(in...) elementwise over n elements, warp steps striding over the
// grid; every input of a step is read before its output is written (out may
// alias an input). Where a result is not finite, f runs again on the inputs
// scaled by 2^-64 (math::overflow_safe: the same bits), off the common path.
// One element a load (U = 1) of a 16-bit type holds a register per element:
// four inputs take the 128 registers of two blocks an SM.
template <typename T, int U, int N, typename F>
__global__ void __launch_bounds__(kThreads, U == 1 && sizeof(T) == 2 && N >= 4 ? 2 : 3)
    elementwise_kernel(Inputs<T, N> in, int64_t n, T* out, F f) {
  constexpr int E = kElementwisePerLane<T>;
  constexpr int64_t kStepBytes = 32 * E * int64_t{sizeof(T)};
  using Step = kernels::Step<U, E>;
  const int64_t steps = ceil_div(n, int64_t{32} * E), warps = int64_t{gridDim.x} * kWarps;
  for (int64_t s = blockIdx.x * int64_t{kWarps} + warp_id(); s < steps; s += warps) {
    if (s + warps < steps) {
      const int64_t next = (s + warps) * 32 * E;
#pragma unroll
      for (int a = 0; a < N; ++a)
        prefetch_range(in.at[a] + next, min(kStepBytes, (n - next) * int64_t{sizeof(T)}), lane_id(),
                       32);
    }
    const Step step{s * 32 * E, n};
    Slots<T, U, E> loaded[N];
#pragma unroll
    for (int a = 0; a < N; ++a) loaded[a].load(in.at[a], step);
#pragma unroll
    for (int j = 0; j < Step::kSlots; ++j) {
      float v[N][U], r[U];
      bool overflow = false;
#pragma unroll
      for (int a = 0; a < N; ++a) unpack(loaded[a].at[j], v[a]);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        r[u] = apply(f, v, u, std::make_index_sequence<N>{});
        overflow |= !math::is_finite(r[u]);
      }
      if (overflow) {
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (!math::is_finite(r[u])) r[u] = apply_rescaled(f, v, u, std::make_index_sequence<N>{});
      }
      store_slot<T, U>(out + step.at(j), step.count(j), pack<T, U>(r));
    }
  }
}

struct Average2 {
  __device__ float operator()(float a, float b) const { return math::average2(a, b); }
};

struct Axpy {
  float a;
  __device__ float operator()(float x, float y) const { return math::axpy(x, a, y); }
};

struct AsyncAverage {
  Share share;
  __device__ float operator()(float x, float reduced, float snapshot) const {
    return math::async_average_of_share(x, share(reduced), snapshot);
  }
};

struct LowprecDecentralizedDiff {
  __device__ float operator()(float x, float w, float left, float right) const {
    return math::lowprec_decentralized_diff(x, w, left, right);
  }
};

// ---- Host drivers -----------------------------------------------------------

// Calls f(std::integral_constant<int, U>) with U = slot_width<T>(vector).
template <typename T, typename F>
Status with_slot_width(bool vector, F&& f) {
  if (vector) return f(std::integral_constant<int, slot_width<T>(true)>{});
  return f(std::integral_constant<int, 1>{});
}

// Whether 16-byte slots serve every chunk: each chunk starts at a multiple of
// the slot width in every buffer, and the buffers are 16-byte aligned (null
// pointers count as aligned).
template <typename T>
bool vector_slots(const Chunking& chunking, const void* a, const void* b = nullptr,
                  const void* c = nullptr) {
  return chunking.chunk_elements() % slot_width<T>(true) == 0 && is_aligned16(a) &&
         is_aligned16(b) && is_aligned16(c);
}

// Launches `kernel` over `work` blocks of work, at most the device's resident
// blocks of it.
template <typename... Params, typename... Args>
void launch_over(void (*kernel)(Params...), int64_t work, cudaStream_t stream, Args&&... args) {
  launch(kernel, grid_size(work, resident_blocks(device_info(), kernel)), stream,
         std::forward<Args>(args)...);
}

template <int kBits, typename T>
Status compress_minmax(Cuda device, const T* x, const float* residual_in, int64_t n, int64_t k,
                       uint8_t* out, float* residual_out) {
  if (Status s = check_compressed(out); !s.ok()) return s;
  const Chunking chunking{MinMaxCodec<kBits>::kFormat, n, k};
  const bool vector = vector_slots<T>(chunking, x, residual_in, residual_out);
  return with_slot_width<T>(vector, [&](auto width) {
    constexpr int U = decltype(width)::value;
    const cudaStream_t stream = stream_of(device);
    if (residual_in)
      launch_over(minmax_compress_kernel<kBits, U, T, true>, chunking.group_count(), stream,
                  Source<T, true>{x, residual_in}, chunking, out, residual_out);
    else
      launch_over(minmax_compress_kernel<kBits, U, T, false>, chunking.group_count(), stream,
                  Source<T, false>{x, nullptr}, chunking, out, residual_out);
    return launch_status();
  });
}

template <int U, typename T, bool kFeedback>
void compress_sign(const Chunking& chunking, Source<T, kFeedback> src, uint8_t* out,
                   float* residual_out, cudaStream_t stream) {
  const int64_t header_blocks = ceil_div(chunking.k, kThreads);
  launch_over(sign_init_kernel, header_blocks, stream, chunking, out);
  // Without feedback one pass does it all; with it, batches of chunks that the
  // L2 cache holds between the two passes.
  const int64_t batch =
      kFeedback ? chunks_per_batch(device_info(), chunking, sizeof(T) + 4) : chunking.k;
  for (int64_t c = 0; c < chunking.k; c += batch) {
    const int64_t first = chunking.piece_index(c, kTileElements);
    const int64_t end = chunking.piece_index(std::min(c + batch, chunking.k), kTileElements);
    launch_over(sign_stats_kernel<U, T, kFeedback>, end - first, stream, src, chunking, first, end,
                out);
    if constexpr (kFeedback)
      launch_over(sign_feedback_kernel<U, T>, end - first, stream, src, chunking, first, end, out,
                  residual_out);
  }
  launch_over(sign_finalize_kernel, header_blocks, stream, chunking, out);
}

template <typename Codec, typename T>
Status decompress(Cuda device, const uint8_t* in, int64_t n, int64_t k, T* out) {
  if (n == 0) return {};
  if (Status s = check_compressed(in); !s.ok()) return s;
  const Chunking chunking{Codec::kFormat, n, k};
  return with_slot_width<T>(vector_slots<T>(chunking, out), [&](auto width) {
    constexpr int U = decltype(width)::value;
    launch_over(decompress_kernel<Codec, U, T>, chunking.piece_index(k, kTileElements),
                stream_of(device), in, chunking, out);
    return launch_status();
  });
}

bool is_power_of_two(float d) {
  int exponent;
  return d > 0.0f && std::isfinite(d) && std::frexp(d, &exponent) == 0.5f;
}

Share share_of(bool average, float k) { return {average, k, is_power_of_two(k) ? 1.0f / k : 0.0f}; }

template <typename Codec, typename T>
Status decompress_reduce(Cuda device, const uint8_t* in, int64_t m, int64_t k, bool average,
                         T* out) {
  if (m == 0) return {};
  if (Status s = check_compressed(in); !s.ok()) return s;
  const Chunking single{Codec::kFormat, m, 1};  // one input: m elements in one chunk
  return with_slot_width<T>(vector_slots<T>(single, out), [&](auto width) {
    constexpr int U = decltype(width)::value;
    launch_over(decompress_reduce_kernel<Codec, U, T>,
                ceil_div(m, int64_t{kThreads} * Codec::kReducePerLane), stream_of(device), in, m, k,
                slot_bytes(Codec::kFormat, m), share_of(average, static_cast<float>(k)), out);
    return launch_status();
  });
}

template <typename T, typename F, typename... In>
Status elementwise(Cuda device, int64_t n, T* out, F f, const In*... in) {
  if (n == 0) return {};
  constexpr int N = sizeof...(In);
  const bool vector = is_aligned16(out) && (is_aligned16(in) && ...);
  return with_slot_width<T>(vector, [&](auto width) {
    constexpr int U = decltype(width)::value;
    const int64_t steps = ceil_div(n, int64_t{32} * kElementwisePerLane<T>);
    launch_over(elementwise_kernel<T, U, N, F>, ceil_div(steps, kWarps), stream_of(device),
                Inputs<T, N>{{in...}}, n, out, f);
    return launch_status();
  });
}

}  // namespace

template <typename T>
Status minmax_compress(Cuda device, const T* x, const float* residual_in, int64_t n, int64_t k,
                       uint8_t* out, float* residual_out) {
  return compress_minmax<8>(device, x, residual_in, n, k, out, residual_out);
}

template <typename T>
Status minmax_uint4_compress(Cuda device, const T* x, const float* residual_in, int64_t n,
                             int64_t k, uint8_t* out, float* residual_out) {
  return compress_minmax<4>(device, x, residual_in, n, k, out, residual_out);
}

template <typename T>
Status sign_compress(Cuda device, const T* x, const float* residual_in, int64_t n, int64_t k,
                     uint8_t* out, float* residual_out) {
  if (Status s = check_compressed(out); !s.ok()) return s;
  const Chunking chunking{Format::kSign, n, k};
  const bool vector = vector_slots<T>(chunking, x, residual_in, residual_out);
  return with_slot_width<T>(vector, [&](auto width) {
    constexpr int U = decltype(width)::value;
    if (residual_in)
      compress_sign<U>(chunking, Source<T, true>{x, residual_in}, out, residual_out,
                       stream_of(device));
    else
      compress_sign<U>(chunking, Source<T, false>{x, nullptr}, out, residual_out,
                       stream_of(device));
    return launch_status();
  });
}

template <typename T>
Status minmax_decompress(Cuda device, const uint8_t* in, int64_t n, int64_t k, T* out) {
  return decompress<MinMaxCodec<8>>(device, in, n, k, out);
}

template <typename T>
Status minmax_uint4_decompress(Cuda device, const uint8_t* in, int64_t n, int64_t k, T* out) {
  return decompress<MinMaxCodec<4>>(device, in, n, k, out);
}

template <typename T>
Status sign_decompress(Cuda device, const uint8_t* in, int64_t n, int64_t k, T* out) {
  return decompress<SignCodec>(device, in, n, k, out);
}

template <typename T>
Status minmax_decompress_reduce(Cuda device, const uint8_t* in, int64_t m, int64_t k, bool average,
                                T* out) {
  return decompress_reduce<MinMaxCodec<8>>(device, in, m, k, average, out);
}

template <typename T>
Status minmax_uint4_decompress_reduce(Cuda device, const uint8_t* in, int64_t m, int64_t k,
                                      bool average, T* out) {
  return decompress_reduce<MinMaxCodec<4>>(device, in, m, k, average, out);
}

template <typename T>
Status sign_decompress_reduce(Cuda device, const uint8_t* in, int64_t m, int64_t k, bool average,
                              T* out) {
  return decompress_reduce<SignCodec>(device, in, m, k, average, out);
}

template <typename T>
Status average2(Cuda device, const T* a, const T* b, int64_t n, T* out) {
  return elementwise(device, n, out, Average2{}, a, b);
}

template <typename T>
Status axpy(Cuda device, const T* x, float a, const T* y, int64_t n, T* out) {
  return elementwise(device, n, out, Axpy{a}, x, y);
}

template <typename T>
Status async_average(Cuda device, const T* x, const T* reduced, const T* snapshot, float ranks,
                     int64_t n, T* out) {
  return elementwise(device, n, out, AsyncAverage{share_of(true, ranks)}, x, reduced, snapshot);
}

template <typename T>
Status lowprec_decentralized_diff(Cuda device, const T* x, const T* w, const T* left,
                                  const T* right, int64_t n, T* out) {
  return elementwise(device, n, out, LowprecDecentralizedDiff{}, x, w, left, right);
}

BAGUA_INSTANTIATE_KERNELS(Cuda)

}  // namespace bagua::kernels
