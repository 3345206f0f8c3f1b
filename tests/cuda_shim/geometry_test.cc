// The CUDA launch arithmetic (xla_ffi/cuda_geometry.h) and the buffer layout
// (xla_ffi/layout.h) for sizes of 2^31 elements and beyond, checked against
// independent 128-bit arithmetic without allocating anything. Built with UBSan,
// so a signed overflow anywhere in it fails too.
//
// Prints "N passed, M failed"; exits non-zero on any failure.
#include <climits>
#include <string>

#include "cuda_geometry.h"
#include "layout.h"
#include "tally.h"

namespace {

using bagua::Chunking;
using bagua::Format;
using Wide = __int128;
namespace geo = bagua::cuda_geometry;

using tally::expect;

Wide wide_ceil(Wide a, Wide b) { return (a + b - 1) / b; }

Wide wide_slot_bytes(Format format, Wide elements) {
  const Wide payload = format == Format::kMinMaxUInt8 ? elements : wide_ceil(elements, 8);
  return 16 + wide_ceil(payload, 16) * 16;
}

std::string label(Format format, int64_t n, int64_t k) {
  return std::string(format == Format::kSign ? "sign" : "minmax") + " n=" + std::to_string(n) +
         " k=" + std::to_string(k);
}

// Chunk bounds and slot offsets against a running 128-bit sum over all chunks.
void check_layout(Format format, int64_t n, int64_t k) {
  const Chunking chunking{format, n, k};
  const Wide c = wide_ceil(n, k);
  Wide offset = 0;
  bool ok = true;
  for (int64_t i = 0; i < k && ok; ++i) {
    const Wide begin = std::min<Wide>(i * c, n), end = std::min<Wide>((i + 1) * c, n);
    ok = chunking.begin(i) == begin && chunking.length(i) == end - begin &&
         chunking.slot_offset(i) == offset;
    offset += wide_slot_bytes(format, end - begin);
  }
  expect(ok && chunking.total_bytes() == offset && bagua::compressed_bytes(format, n, k) == offset,
         label(format, n, k) + ": chunk bounds and slot offsets");
}

// Every batch's tiles cover each chunk's warp steps (trailing tiles may be
// empty), with one tile per resident block unless there are more chunks than
// blocks, and the grid fits a CUDA launch.
void check_tiles(Format format, int64_t n, int64_t k, int64_t resident, int element_bytes,
                 int l2_bytes) {
  const Chunking chunking{format, n, k};
  const geo::DeviceInfo info{132, l2_bytes};
  const int64_t batch = geo::chunks_per_batch(info, chunking, element_bytes);
  const Wide chunk_bytes = wide_ceil(n, k) * element_bytes;
  const std::string what = label(format, n, k) + " resident=" + std::to_string(resident) +
                           " l2=" + std::to_string(l2_bytes);
  expect(batch >= 1 && batch <= k &&
             (batch == k || chunk_bytes * batch <= Wide{l2_bytes} / 2 || batch == 1),
         what + ": batch " + std::to_string(batch) + " within 1..k and half the L2");
  const Wide steps = wide_ceil(wide_ceil(n, k), geo::kStep);
  int64_t covered = 0;
  bool ok = true;
  for (int64_t first = 0; first < k && ok; first += batch) {
    const int64_t chunks = std::min(batch, k - first);
    const geo::Tiles tiles = geo::make_tiles(chunking, first, chunks, resident);
    const Wide per = tiles.per_chunk, len = tiles.tile_steps;
    const int grid = geo::grid_size(tiles.count(), resident);
    ok = tiles.first_chunk == first && tiles.chunks == chunks && per >= 1 && len >= 1 &&
         per * len >= steps && (steps == 0 || len <= steps) &&
         Wide{tiles.count()} == Wide{chunks} * per && (per == 1 || tiles.count() <= resident) &&
         grid >= 1 && grid <= resident && grid <= INT_MAX;
    covered += chunks;
  }
  expect(ok && covered == k, what + ": tiles cover every step, grid in range");
}

}  // namespace

int main() {
  const int64_t sizes[] = {
      (int64_t{1} << 31) - 1, int64_t{1} << 31,           (int64_t{1} << 31) + 257,
      (int64_t{1} << 32) + 3, (int64_t{1} << 33) + 12345, (int64_t{1} << 40) + 7,
  };
  const int64_t ks[] = {1, 2, 3, 7, 64, 1000, 4096};
  for (const Format format : {Format::kMinMaxUInt8, Format::kSign}) {
    for (const int64_t n : sizes) {
      for (const int64_t k : ks) {
        check_layout(format, n, k);
        for (const int64_t resident : {1, 132 * 8, 132 * 32})
          for (const int element_bytes : {2, 8})
            for (const int l2 : {4096, 50 << 20})
              check_tiles(format, n, k, resident, element_bytes, l2);
      }
    }
  }
  // The launch helpers on their own at their edges.
  expect(geo::grid_size(int64_t{1} << 40, 1056) == 1056, "grid_size clamps to resident");
  expect(geo::grid_size(0, 1056) == 1, "grid_size launches at least one block");
  return tally::summary();
}
