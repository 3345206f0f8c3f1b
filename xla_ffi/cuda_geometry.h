// The host-side arithmetic of the CUDA kernels' launches: block shape, grid
// size, tiles and compress batches, all in 64-bit sizes. It needs no CUDA
// header, so tests call it alone with sizes far beyond what they could
// allocate.
#pragma once

#include <algorithm>
#include <cstdint>

#include "layout.h"

namespace bagua::cuda_geometry {

inline constexpr int kThreads = 256;  // threads per block; block_reduce relies on it
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kPerLane = 8;           // elements a lane holds per step
inline constexpr int kStep = 32 * kPerLane;  // elements a warp handles per step

// What the launch arithmetic needs to know of the device.
struct DeviceInfo {
  int sms = 0;
  int l2_bytes = 0;
};

// The grid of a launch with `work_blocks` blocks of work: at least one block,
// at most the `resident` ones (the kernels stride over the rest).
inline int grid_size(int64_t work_blocks, int64_t resident) {
  return static_cast<int>(std::clamp<int64_t>(work_blocks, 1, resident));
}

// Chunks [first_chunk, first_chunk + chunks) are each cut into per_chunk tiles
// of tile_steps warp steps; tile t is segment t % per_chunk of chunk
// first_chunk + t / per_chunk. A tile never spans two chunks, so a block
// reduces it and updates one header.
struct Tiles {
  Chunking chunking;
  int64_t first_chunk;
  int64_t chunks;
  int64_t per_chunk;
  int64_t tile_steps;

  BAGUA_HD int64_t count() const { return chunks * per_chunk; }
};

// At most one tile per resident block (tiles are equal, so a second round
// would double the time), and at least one step per warp in a tile.
inline Tiles make_tiles(const Chunking& chunking, int64_t first_chunk, int64_t chunks,
                        int64_t resident) {
  const int64_t steps = ceil_div(chunking.chunk_elements(), kStep);
  const int64_t per_chunk =
      std::max<int64_t>(1, std::min(resident / chunks, ceil_div(steps, kWarps)));
  const int64_t tile_steps = std::max<int64_t>(1, ceil_div(steps, per_chunk));
  return {chunking, first_chunk, chunks, per_chunk, tile_steps};
}

// How many chunks a stats + encode batch covers: as many as fit in half the L2
// cache, so that encode rereads them from it. A chunk that does not fit in the
// cache gains nothing from batching; then one batch takes all chunks.
inline int64_t chunks_per_batch(const DeviceInfo& info, const Chunking& chunking,
                                int64_t element_bytes) {
  const int64_t chunk_bytes = chunking.chunk_elements() * element_bytes;
  if (chunk_bytes == 0 || 4 * chunk_bytes > 3 * int64_t{info.l2_bytes}) return chunking.k;
  return std::clamp<int64_t>(info.l2_bytes / 2 / chunk_bytes, 1, chunking.k);
}

}  // namespace bagua::cuda_geometry
