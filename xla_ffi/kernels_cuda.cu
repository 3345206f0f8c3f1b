// CUDA implementations of the kernels: the compression passes, the decoders'
// kernels, the elementwise helpers and their host drivers. They are
// memory-bound, so the design is about moving bytes with few instructions:
//
// * A warp works on steps of 256 consecutive elements; each lane holds 8 of
//   them as slots of V consecutive elements, and slot j of lane l starts at
//   element V * (32 * j + l) of the step. Every warp-wide access is therefore
//   contiguous: with V = 4 a float4 (or 8 bytes of 16-bit values) and 4 codes
//   per lane, with V = 1 plain coalesced scalars. Chunked kernels use V = 4
//   when every chunk starts 16-byte aligned, else V = 1, which keeps arbitrary
//   chunk starts at full bandwidth.
// * Loops stride over the grid, and grids are sized to the blocks the device
//   holds at once, so one launch covers any tensor.
// * Compression needs no scratch memory: init gives each chunk header the
//   identity of its reduction; stats reduces (chunk, segment) tiles, one per
//   block, and folds each into its chunk header with atomics; encode derives
//   lo/hi or the scale from the header and writes codes or bits and the
//   error-feedback residual; finalize turns the headers into their final bytes.
//   Encode rereads the input, so stats and encode run over batches of chunks
//   that fit in the L2 cache, which serves the second read.
//
// All arithmetic goes through bagua::math and the dtype conversions, which are
// the same code the CPU kernels run, so the bytes agree with them. Compressed
// buffers must be 16-byte aligned (the layout aligns every slot relative to
// the buffer's start); tensors may have any alignment of their element type.
//
// The parts: cuda_launch.h (launches and their status), cuda_lanes.h (what a
// lane holds, loads and stores), cuda_codecs.h (each codec's statistics,
// encoders and decoders), cuda_geometry.h (grid and tile arithmetic).
#include <algorithm>
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

// ---- Compression passes and decoding kernels --------------------------------

template <typename Stats>
__global__ void __launch_bounds__(kThreads) init_kernel(Chunking chunking, uint8_t* out) {
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < chunking.k;
       i += int64_t{gridDim.x} * kThreads)
    Stats::init(out + chunking.slot_offset(i));
}

template <typename Stats, int V, typename T>
__global__ void __launch_bounds__(kThreads) stats_kernel(Source<T> src, Tiles tiles, uint8_t* out) {
  for (int64_t t = blockIdx.x; t < tiles.count(); t += gridDim.x) {
    const Tile tile = tile_at(tiles, t);
    if (tile.empty()) continue;  // the same for the whole block
    const Source<T> chunk = src.offset(tile.first);
    Stats stats;
    for (int64_t s = tile.s_begin + threadIdx.x / 32; s < tile.s_end; s += kWarps) {
      const Step<V> step = tile.step<V>(s);
      float v[kPerLane];
      chunk.load(step, v);
#pragma unroll
      for (int j = 0; j < Step<V>::kSlots; ++j) {
        const int count = step.count(j);
#pragma unroll
        for (int u = 0; u < V; ++u)
          if (u < count) stats.add(v[j * V + u]);
      }
    }
    stats.commit(out + tile.slot);
  }
}

// Also zeroes each slot's padding (at most 15 bytes, never touched by the
// encoders), so equal inputs always give equal bytes, as on the CPU.
template <typename Stats>
__global__ void __launch_bounds__(kThreads) finalize_kernel(Chunking chunking, uint8_t* out) {
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < chunking.k;
       i += int64_t{gridDim.x} * kThreads) {
    uint8_t* slot = out + chunking.slot_offset(i);
    Stats::finalize(slot, chunking.length(i));
    const int64_t used = kHeaderBytes + payload_bytes(chunking.format, chunking.length(i));
    const int64_t slot_end = chunking.slot_offset(i + 1) - chunking.slot_offset(i);
    for (int64_t b = used; b < slot_end; ++b) slot[b] = 0;
  }
}

template <typename Encoder, int V, typename T>
__global__ void __launch_bounds__(kThreads)
    encode_kernel(Source<T> src, Tiles tiles, uint8_t* out, float* residual_out) {
  for (int64_t t = blockIdx.x; t < tiles.count(); t += gridDim.x) {
    const Tile tile = tile_at(tiles, t);
    if (tile.empty()) continue;
    const Source<T> chunk = src.offset(tile.first);
    const Encoder encode(out + tile.slot, tile.length);
    float* chunk_residual = residual_out ? residual_out + tile.first : nullptr;
    // Backwards: what stats read last is the likeliest to be still cached.
    for (int64_t s = tile.s_end - 1 - threadIdx.x / 32; s >= tile.s_begin; s -= kWarps) {
      const Step<V> step = tile.step<V>(s);
      float v[kPerLane];
      chunk.load(step, v);
      encode(step, v);  // v holds the residuals now
      if (chunk_residual) {
#pragma unroll
        for (int j = 0; j < Step<V>::kSlots; ++j)
          store_slot<V>(chunk_residual + step.at(j), step.count(j), v + j * V);
      }
    }
  }
}

template <typename Decoder, int V, typename T>
__global__ void __launch_bounds__(kThreads) decode_kernel(const uint8_t* in, Tiles tiles, T* out) {
  for (int64_t t = blockIdx.x; t < tiles.count(); t += gridDim.x) {
    const Tile tile = tile_at(tiles, t);
    if (tile.empty()) continue;
    const Decoder decode(in + tile.slot);
    T* chunk_out = out + tile.first;
    for (int64_t s = tile.s_begin + threadIdx.x / 32; s < tile.s_end; s += kWarps) {
      const Step<V> step = tile.step<V>(s);
      float v[kPerLane];
      decode(step, v);
#pragma unroll
      for (int j = 0; j < Step<V>::kSlots; ++j)
        store_slot<V>(chunk_out + step.at(j), step.count(j), v + j * V);
    }
  }
}

// Warp steps over a flat range of n elements, striding over the whole grid.
template <typename F>
__device__ void for_each_step(int64_t n, F&& f) {
  const int64_t warps = int64_t{gridDim.x} * kWarps;
  for (int64_t s = blockIdx.x * int64_t{kWarps} + threadIdx.x / 32; s * kStep < n; s += warps)
    f(Step<4>{s * kStep, n});
}

__device__ bool is_infinite(float v) { return v == v && !math::is_finite(v); }

// The lane's elements whose float32 sum (or average) overflowed are summed
// again, scaled by 2^-64 (math::resum_scale), so that finite inputs give a
// finite average (SPEC section 2); the others keep their bits.
template <typename Decoder>
__device__ void resum_scaled(const uint8_t* in, int64_t k, int64_t slot, bool average,
                             const Step<4>& step, float (&acc)[kPerLane]) {
  float scaled[kPerLane] = {};
  for (int64_t r = 0; r < k; ++r) {
    float v[kPerLane];
    const Decoder decode(in + r * slot);
    decode(step, v);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) scaled[i] = math::resum_add(scaled[i], v[i]);
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i)
    if (is_infinite(acc[i])) acc[i] = math::resum_result(scaled[i], average, static_cast<float>(k));
}

// The k inputs are single-chunk buffers of m elements, `slot` bytes apart. Each
// lane sums its elements of every input in order j = 0..k-1.
template <typename Decoder, typename T>
__global__ void __launch_bounds__(kThreads)
    decode_reduce_kernel(const uint8_t* in, int64_t m, int64_t k, int64_t slot, bool average,
                         T* out) {
  for_each_step(m, [&](const Step<4>& step) {
    float acc[kPerLane] = {};
    for (int64_t j = 0; j < k; ++j) {
      float v[kPerLane];
      const Decoder decode(in + j * slot);
      decode(step, v);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) acc[i] = math::add_rn(acc[i], v[i]);
    }
    bool overflow = false;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (average) acc[i] = math::div_rn(acc[i], static_cast<float>(k));
      overflow |= is_infinite(acc[i]);
    }
    if (overflow) resum_scaled<Decoder>(in, k, slot, average, step, acc);
#pragma unroll
    for (int j = 0; j < Step<4>::kSlots; ++j)
      store_slot<4>(out + step.at(j), step.count(j), acc + j * 4);
  });
}

// ---- Host drivers -----------------------------------------------------------

template <typename Encoder, int V, typename T>
Status compress(Cuda device, const Chunking& chunking, const Source<T>& src, uint8_t* out,
                float* residual_out) {
  using Stats = typename Encoder::Stats;
  const auto stats = stats_kernel<Stats, V, T>;
  const auto encode = encode_kernel<Encoder, V, T>;
  const cudaStream_t stream = stream_of(device);
  const DeviceInfo info = device_info();
  // One tiling serves both passes, so it must fit the one with fewer blocks.
  const int64_t resident = std::min(resident_blocks(info, stats), resident_blocks(info, encode));
  const int64_t batch = chunks_per_batch(info, chunking, sizeof(T) + (src.residual ? 4 : 0));
  const int header_grid = grid_size(ceil_div(chunking.k, kThreads), resident);
  launch(init_kernel<Stats>, header_grid, stream, chunking, out);
  for (int64_t first = 0; first < chunking.k; first += batch) {
    const Tiles tiles = make_tiles(chunking, first, std::min(batch, chunking.k - first), resident);
    const int tile_grid = grid_size(tiles.count(), resident);
    launch(stats, tile_grid, stream, src, tiles, out);
    launch(encode, tile_grid, stream, src, tiles, out, residual_out);
  }
  launch(finalize_kernel<Stats>, header_grid, stream, chunking, out);
  return launch_status();
}

template <typename Encoder, typename T>
Status compress(Cuda device, Format format, const T* x, const float* residual_in, int64_t n,
                int64_t k, uint8_t* out, float* residual_out) {
  if (Status s = check_compressed(out); !s.ok()) return s;
  const Chunking chunking{format, n, k};
  const Source<T> src{x, residual_in};
  return chunks_aligned(chunking, x, residual_in, residual_out)
             ? compress<Encoder, 4>(device, chunking, src, out, residual_out)
             : compress<Encoder, 1>(device, chunking, src, out, residual_out);
}

template <typename Decoder, int V, typename T>
Status decompress(Cuda device, const Chunking& chunking, const uint8_t* in, T* out) {
  const auto decode = decode_kernel<Decoder, V, T>;
  const int64_t resident = resident_blocks(device_info(), decode);
  const Tiles tiles = make_tiles(chunking, 0, chunking.k, resident);
  launch(decode, grid_size(tiles.count(), resident), stream_of(device), in, tiles, out);
  return launch_status();
}

template <typename Decoder, typename T>
Status decompress(Cuda device, Format format, const uint8_t* in, int64_t n, int64_t k, T* out) {
  if (n == 0) return {};
  if (Status s = check_compressed(in); !s.ok()) return s;
  const Chunking chunking{format, n, k};
  return chunks_aligned(chunking, out) ? decompress<Decoder, 4>(device, chunking, in, out)
                                       : decompress<Decoder, 1>(device, chunking, in, out);
}

template <typename Decoder, typename T>
Status decompress_reduce(Cuda device, Format format, const uint8_t* in, int64_t m, int64_t k,
                         bool average, T* out) {
  if (m == 0) return {};
  if (Status s = check_compressed(in); !s.ok()) return s;
  const auto reduce = decode_reduce_kernel<Decoder, T>;
  const int grid =
      grid_size(ceil_div(m, int64_t{kStep} * kWarps), resident_blocks(device_info(), reduce));
  launch(reduce, grid, stream_of(device), in, m, k, slot_bytes(format, m), average, out);
  return launch_status();
}

// ---- Elementwise helpers ----------------------------------------------------

template <typename T, int N>
struct Inputs {
  const T* at[N];
};

template <typename F, int N, size_t... A>
__device__ float apply(const F& f, const float (&v)[N][kPerLane], int i,
                       std::index_sequence<A...>) {
  return math::overflow_safe(f, v[A][i]...);
}

template <typename T, int N, typename F>
__global__ void __launch_bounds__(kThreads)
    elementwise_kernel(Inputs<T, N> in, int64_t n, T* out, F f) {
  for_each_step(n, [&](const Step<4>& step) {
    // All inputs are read before out is written: out may alias one of them.
    float v[N][kPerLane], r[kPerLane];
#pragma unroll
    for (int a = 0; a < N; ++a)
#pragma unroll
      for (int j = 0; j < Step<4>::kSlots; ++j)
        load_slot<4>(in.at[a] + step.at(j), step.count(j), v[a] + j * 4);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) r[i] = apply(f, v, i, std::make_index_sequence<N>{});
#pragma unroll
    for (int j = 0; j < Step<4>::kSlots; ++j)
      store_slot<4>(out + step.at(j), step.count(j), r + j * 4);
  });
}

template <typename T, typename F, typename... In>
Status elementwise(Cuda device, int64_t n, T* out, F f, const In*... in) {
  if (n == 0) return {};
  constexpr int N = sizeof...(In);
  const auto kernel = elementwise_kernel<T, N, F>;
  const int grid =
      grid_size(ceil_div(n, int64_t{kStep} * kWarps), resident_blocks(device_info(), kernel));
  launch(kernel, grid, stream_of(device), Inputs<T, N>{{in...}}, n, out, f);
  return launch_status();
}

struct Average2 {
  __device__ float operator()(float a, float b) const { return math::average2(a, b); }
};

struct Axpy {
  float a;
  __device__ float operator()(float x, float y) const { return math::axpy(x, a, y); }
};

struct AsyncAverage {
  float ranks;
  __device__ float operator()(float x, float reduced, float snapshot) const {
    return math::async_average(x, reduced, ranks, snapshot);
  }
};

struct LowprecDecentralizedDiff {
  __device__ float operator()(float x, float w, float left, float right) const {
    return math::lowprec_decentralized_diff(x, w, left, right);
  }
};

}  // namespace

template <typename T>
Status minmax_compress(Cuda device, const T* x, const float* residual_in, int64_t n, int64_t k,
                       uint8_t* out, float* residual_out) {
  return compress<MinMaxEncoder<8>>(device, Format::kMinMaxUInt8, x, residual_in, n, k, out,
                                    residual_out);
}

template <typename T>
Status minmax_uint4_compress(Cuda device, const T* x, const float* residual_in, int64_t n,
                             int64_t k, uint8_t* out, float* residual_out) {
  return compress<MinMaxEncoder<4>>(device, Format::kMinMaxUInt4, x, residual_in, n, k, out,
                                    residual_out);
}

template <typename T>
Status sign_compress(Cuda device, const T* x, const float* residual_in, int64_t n, int64_t k,
                     uint8_t* out, float* residual_out) {
  return compress<SignEncoder>(device, Format::kSign, x, residual_in, n, k, out, residual_out);
}

template <typename T>
Status minmax_decompress(Cuda device, const uint8_t* in, int64_t n, int64_t k, T* out) {
  return decompress<MinMaxDecoder<8>>(device, Format::kMinMaxUInt8, in, n, k, out);
}

template <typename T>
Status minmax_uint4_decompress(Cuda device, const uint8_t* in, int64_t n, int64_t k, T* out) {
  return decompress<MinMaxDecoder<4>>(device, Format::kMinMaxUInt4, in, n, k, out);
}

template <typename T>
Status sign_decompress(Cuda device, const uint8_t* in, int64_t n, int64_t k, T* out) {
  return decompress<SignDecoder>(device, Format::kSign, in, n, k, out);
}

template <typename T>
Status minmax_decompress_reduce(Cuda device, const uint8_t* in, int64_t m, int64_t k, bool average,
                                T* out) {
  return decompress_reduce<MinMaxDecoder<8>>(device, Format::kMinMaxUInt8, in, m, k, average, out);
}

template <typename T>
Status minmax_uint4_decompress_reduce(Cuda device, const uint8_t* in, int64_t m, int64_t k,
                                      bool average, T* out) {
  return decompress_reduce<MinMaxDecoder<4>>(device, Format::kMinMaxUInt4, in, m, k, average, out);
}

template <typename T>
Status sign_decompress_reduce(Cuda device, const uint8_t* in, int64_t m, int64_t k, bool average,
                              T* out) {
  return decompress_reduce<SignDecoder>(device, Format::kSign, in, m, k, average, out);
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
  return elementwise(device, n, out, AsyncAverage{ranks}, x, reduced, snapshot);
}

template <typename T>
Status lowprec_decentralized_diff(Cuda device, const T* x, const T* w, const T* left,
                                  const T* right, int64_t n, T* out) {
  return elementwise(device, n, out, LowprecDecentralizedDiff{}, x, w, left, right);
}

BAGUA_INSTANTIATE_KERNELS(Cuda)

}  // namespace bagua::kernels
