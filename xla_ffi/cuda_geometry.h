// The host-side arithmetic of the CUDA kernels' launches: block shape, the work
// a block and a lane take, grid sizes and the sign codec's compress batches, all
// in 64-bit sizes. It needs no CUDA header, so tests call it alone with sizes far
// beyond what they could allocate.
#pragma once

#include <algorithm>
#include <cstdint>

#include "layout.h"

namespace bagua::cuda_geometry {

inline constexpr int kThreads = 256;  // threads per block; block_reduce relies on it
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kPerLane = 32;          // elements a lane holds in a warp step
inline constexpr int kStep = 32 * kPerLane;  // elements of a warp step
// A block's tile: one warp step per warp. Tiles cut chunks from their start, so a
// min-max tile is exactly one group, held in the block's registers.
inline constexpr int64_t kTileElements = int64_t{kWarps} * kStep;
static_assert(kTileElements == kMinMaxGroupElements, "a block holds one min-max group");

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

// How many chunks a sign compress batch with error feedback covers (its two
// passes read each chunk twice): as many as fit in half the L2 cache, so that
// the second pass rereads them from it. A chunk that does not fit in the cache
// gains nothing from batching; then one batch takes all chunks.
inline int64_t chunks_per_batch(const DeviceInfo& info, const Chunking& chunking,
                                int64_t element_bytes) {
  const int64_t chunk_bytes = chunking.chunk_elements() * element_bytes;
  if (chunk_bytes == 0 || 4 * chunk_bytes > 3 * int64_t{info.l2_bytes}) return chunking.k;
  return std::clamp<int64_t>(info.l2_bytes / 2 / chunk_bytes, 1, chunking.k);
}

}  // namespace bagua::cuda_geometry
