// The CUDA launch arithmetic (xla_ffi/cuda_geometry.h) and the buffer layout
// (xla_ffi/layout.h: chunks, groups, the kernels' tiles) for sizes of 2^31
// elements and beyond, checked against independent 128-bit arithmetic without
// allocating anything. Built with UBSan, so a signed overflow anywhere in it
// fails too.
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

Wide wide_payload(Format format, Wide elements) {
  if (format == Format::kMinMaxUInt8) return elements;
  return wide_ceil(elements, format == Format::kMinMaxUInt4 ? 2 : 8);
}

// A chunk's slot: its groups of 8192 elements (min-max) or the whole chunk (sign), each
// a 16-byte header and its payload padded to 16 bytes; an empty chunk one header.
Wide wide_group_bytes(Format format, Wide elements) {
  return 16 + wide_ceil(wide_payload(format, elements), 16) * 16;
}

Wide wide_slot_bytes(Format format, Wide elements) {
  if (elements == 0 || format == Format::kSign) return wide_group_bytes(format, elements);
  const Wide size = bagua::kMinMaxGroupElements, full = elements / size, rest = elements % size;
  return full * wide_group_bytes(format, size) + (rest > 0 ? wide_group_bytes(format, rest) : 0);
}

std::string label(Format format, int64_t n, int64_t k) {
  return std::string(bagua::format_name(format)) + " n=" + std::to_string(n) +
         " k=" + std::to_string(k);
}

// Chunk bounds and slot offsets against a running 128-bit sum over all chunks,
// for chunk counts whose slots are few enough to walk.
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

// Pieces of `size` elements (the CUDA kernels' tiles, the groups): the numbers
// of each chunk's first piece, and a sample of pieces (every chunk's first and
// last, the boundaries between the full chunks, the remainder and the empty
// ones), against a 128-bit walk; for groups, their header offsets too.
void check_pieces(Format format, int64_t n, int64_t k, int64_t size) {
  const Chunking chunking{format, n, k};
  const bool groups = size == bagua::group_elements(format);
  const Wide c = wide_ceil(n, k);
  Wide index = 0;
  bool ok = true;
  for (int64_t i = 0; i < k && ok; ++i) {
    const Wide begin = std::min<Wide>(i * c, n), length = std::min<Wide>((i + 1) * c, n) - begin;
    const Wide count = length == 0 ? 1 : wide_ceil(length, size);
    ok = chunking.piece_index(i, size) == index;
    // Only the first chunks, the last ones and those around the remainder: k may be large.
    const Wide from_remainder = c > 0 ? i - n / c : 0;
    if (i < 3 || i + 3 > k || (from_remainder > -3 && from_remainder < 3)) {
      for (const Wide j : {Wide{0}, count - 1}) {
        const bagua::Piece p = chunking.piece(static_cast<int64_t>(index + j), size);
        const Wide first = begin + j * size;
        ok = ok && p.chunk == i && p.first == first &&
             p.length == std::min<Wide>(size, length - j * size);
        if (groups) {
          const Wide header = chunking.slot_offset(i) + j * wide_group_bytes(format, size);
          ok = ok && chunking.group(static_cast<int64_t>(index + j)).offset == header;
        }
      }
    }
    index += count;
  }
  ok = ok && chunking.piece_index(k, size) == index && (!groups || chunking.group_count() == index);
  expect(ok, label(format, n, k) + " size=" + std::to_string(size) + ": pieces");
}

// The sign codec's compress batches: within 1..k, within half the L2 unless one
// chunk is more, and all chunks in one batch when a chunk exceeds 3/4 of the L2.
void check_batches(int64_t n, int64_t k, int element_bytes, int l2_bytes) {
  const Chunking chunking{Format::kSign, n, k};
  const int64_t batch =
      geo::chunks_per_batch(geo::DeviceInfo{132, l2_bytes}, chunking, element_bytes);
  const Wide chunk_bytes = wide_ceil(n, k) * element_bytes;
  const bool ok = batch >= 1 && batch <= k &&
                  (batch == k || chunk_bytes * batch <= Wide{l2_bytes} / 2 || batch == 1) &&
                  (4 * chunk_bytes <= 3 * Wide{l2_bytes} || batch == k);
  expect(ok, label(Format::kSign, n, k) + " l2=" + std::to_string(l2_bytes) + ": batch " +
                 std::to_string(batch));
}

}  // namespace

int main() {
  const int64_t sizes[] = {
      (int64_t{1} << 31) - 1, int64_t{1} << 31,           (int64_t{1} << 31) + 257,
      (int64_t{1} << 32) + 3, (int64_t{1} << 33) + 12345, (int64_t{1} << 40) + 7,
  };
  const int64_t ks[] = {1, 2, 3, 7, 64, 1000, 4096};
  for (const Format format : {Format::kMinMaxUInt8, Format::kMinMaxUInt4, Format::kSign}) {
    for (const int64_t n : sizes) {
      for (const int64_t k : ks) {
        check_layout(format, n, k);
        check_pieces(format, n, k, bagua::group_elements(format));
        check_pieces(format, n, k, geo::kTileElements);
      }
    }
  }
  for (const int64_t n : sizes)
    for (const int64_t k : ks)
      for (const int element_bytes : {2, 8})
        for (const int l2 : {4096, 50 << 20}) check_batches(n, k, element_bytes, l2);
  // The launch helpers on their own at their edges.
  expect(geo::grid_size(int64_t{1} << 40, 1056) == 1056, "grid_size clamps to resident");
  expect(geo::grid_size(0, 1056) == 1, "grid_size launches at least one block");
  return tally::summary();
}
