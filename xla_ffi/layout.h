// The byte layout of compressed buffers, defined once for every kernel and
// front end.
//
// A flat tensor of n elements is split into k chunks of c = ceil(n / k)
// elements; chunk i covers [min(i*c, n), min((i+1)*c, n)), so trailing chunks
// may be shorter or empty. Each chunk is encoded in groups: the min-max formats
// cut it into groups of kMinMaxGroupElements (8192) elements from its start (the
// last group may be shorter), Sign keeps it whole as one group. The compressed
// buffer is one uint8 array holding, for each chunk in order, its slot: the
// encoded groups of the chunk in order, each
//
//   offset 0   float32 a     MinMaxUInt8/4: lo (group minimum); Sign: scale
//   offset 4   float32 b     MinMaxUInt8/4: hi (group maximum); Sign: unused, 0
//   offset 8   8 zero bytes  so that the payload starts 16-byte aligned
//   offset 16  payload       MinMaxUInt8: one code per element;
//                            MinMaxUInt4: one 4-bit code per element, 2 per
//                            byte, element 2i in the low nibble of byte i;
//                            Sign: one bit per element, 8 per byte, LSB first
//   padding to the next multiple of 16 bytes (and the high nibble of an odd
//   MinMaxUInt4 group's last byte): zeros
//
// An empty chunk is one 16-byte header (all zeros) with no payload. Every slot
// starts 16-byte aligned, so a chunk can be sent or decoded on its own: k
// single-chunk buffers of m elements laid end to end are exactly the buffer of
// m*k elements in k chunks, which is what an all-to-all of chunks delivers.
//
// Why groups: a group's codes need its final lo and hi, so an encoder that
// cannot hold the whole group reads it twice. 8192 elements fit in the registers
// of one CUDA thread block (32 a thread), so every group is encoded in one pass
// over memory, whatever the chunk size (docs/formats.md).
#pragma once

#include <cstdint>

#include "dtypes.h"

namespace bagua {

inline constexpr int64_t kHeaderBytes = 16;
inline constexpr int64_t kSlotAlignment = 16;
inline constexpr int64_t kMinMaxGroupElements =
    8192;  // a multiple of 32: every group's codes end aligned

// Every compression format once: X(enumerator, name, codec). The enum, the
// names the DLPack bindings take, the typed kernels each format runs
// (kernels::<codec>_compress, ...) and its FFI targets (bagua_<codec>_compress,
// ...) are all made from this list.
#define BAGUA_FORMATS(X)                        \
  X(kMinMaxUInt8, "minmax_uint8", minmax)       \
  X(kMinMaxUInt4, "minmax_uint4", minmax_uint4) \
  X(kSign, "sign", sign)

BAGUA_NAMED_ENUM(Format, BAGUA_FORMATS, format_name, "an unknown format")

BAGUA_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

BAGUA_HD int64_t align_up(int64_t bytes) {
  return ceil_div(bytes, kSlotAlignment) * kSlotAlignment;
}

BAGUA_HD int64_t payload_bytes(Format format, int64_t elements) {
  switch (format) {
    case Format::kMinMaxUInt8:
      return elements;
    case Format::kMinMaxUInt4:
      return ceil_div(elements, 2);
    default:
      return ceil_div(elements, 8);
  }
}

// The elements of one group of `format`: Sign chunks are one group however long.
BAGUA_HD int64_t group_elements(Format format) {
  return format == Format::kSign ? INT64_MAX : kMinMaxGroupElements;
}

// One group's header and padded payload.
BAGUA_HD int64_t group_bytes(Format format, int64_t elements) {
  return kHeaderBytes + align_up(payload_bytes(format, elements));
}

// The pieces of `size` elements that cut a range of `elements` elements from its
// start (the last one may be shorter); an empty range is one empty piece.
BAGUA_HD int64_t pieces_of(int64_t elements, int64_t size) {
  return elements == 0 ? 1 : 1 + (elements - 1) / size;
}

BAGUA_HD int64_t groups_of(Format format, int64_t elements) {
  return pieces_of(elements, group_elements(format));
}

BAGUA_HD int64_t slot_bytes(Format format, int64_t elements) {
  const int64_t full = elements / group_elements(format), rest = elements % group_elements(format);
  const int64_t bytes = full > 0 ? full * group_bytes(format, group_elements(format)) : 0;
  return rest > 0 || elements == 0 ? bytes + group_bytes(format, rest) : bytes;
}

// A piece of one chunk of a chunked tensor (a group, or a kernel's tile).
struct Piece {
  int64_t chunk;   // the chunk it belongs to
  int64_t first;   // tensor index of its first element
  int64_t length;  // its elements (0 only for an empty chunk's piece)
};

// A group: a piece, and the byte offset of its header in the compressed buffer.
struct Group : Piece {
  int64_t offset;
};

// How n elements split into k chunks, and where each chunk's slot lies.
struct Chunking {
  Format format;
  int64_t n;
  int64_t k;

  BAGUA_HD int64_t chunk_elements() const { return k > 0 ? ceil_div(n, k) : 0; }

  BAGUA_HD int64_t begin(int64_t i) const {
    const int64_t b = i * chunk_elements();
    return b < n ? b : n;
  }

  BAGUA_HD int64_t length(int64_t i) const { return begin(i + 1) - begin(i); }

  // Chunks [0, full) have c elements, chunk `full` (if any) has the rest, the
  // ones after it are empty, so offsets have a closed form.
  BAGUA_HD int64_t slot_offset(int64_t i) const {
    const int64_t c = chunk_elements();
    const int64_t full = c > 0 ? n / c : 0;
    if (i <= full) return i * slot_bytes(format, c);
    return full * slot_bytes(format, c) + slot_bytes(format, n - full * c) +
           (i - full - 1) * kHeaderBytes;
  }

  BAGUA_HD int64_t total_bytes() const { return slot_offset(k); }

  // Every chunk cut into pieces of `size` elements (pieces_of), numbered over
  // the whole tensor chunk by chunk; as for slots, chunks [0, full) have the same
  // count, so a piece's place has a closed form. piece_index(i, size) is the
  // number of chunk i's first piece (the count of all pieces for i == k).
  BAGUA_HD int64_t piece_index(int64_t i, int64_t size) const {
    const int64_t c = chunk_elements();
    const int64_t full = c > 0 ? n / c : 0;
    if (i <= full) return i * pieces_of(c, size);
    return full * pieces_of(c, size) + pieces_of(n - full * c, size) + (i - full - 1);
  }

  BAGUA_HD Piece piece(int64_t p, int64_t size) const {
    const int64_t c = chunk_elements();
    const int64_t full = c > 0 ? n / c : 0;
    const int64_t per_full = pieces_of(c, size);
    Piece piece;
    int64_t j = 0;  // the piece's number in its chunk
    if (p < full * per_full) {
      piece.chunk = p / per_full;
      j = p - piece.chunk * per_full;
    } else if (full < k && p < piece_index(full + 1, size)) {
      piece.chunk = full;
      j = p - full * per_full;
    } else {  // an empty chunk's piece
      piece.chunk = full + 1 + (p - piece_index(full + 1, size));
    }
    const int64_t skipped = j > 0 ? j * size : 0;
    piece.first = begin(piece.chunk) + skipped;
    piece.length = length(piece.chunk) - skipped < size ? length(piece.chunk) - skipped : size;
    return piece;
  }

  // The groups: the pieces of group_elements(format).
  BAGUA_HD int64_t group_index(int64_t i) const { return piece_index(i, group_elements(format)); }
  BAGUA_HD int64_t group_count() const { return group_index(k); }

  BAGUA_HD Group group(int64_t g) const {
    const int64_t size = group_elements(format);
    Group group;
    static_cast<Piece&>(group) = piece(g, size);
    const int64_t j = (group.first - begin(group.chunk)) / size;
    group.offset = slot_offset(group.chunk) + (j > 0 ? j * group_bytes(format, size) : 0);
    return group;
  }

  // The group of `chunk` that holds element i of the tensor.
  BAGUA_HD Group group_holding(int64_t chunk, int64_t i) const {
    return group(group_index(chunk) + (i - begin(chunk)) / group_elements(format));
  }
};

BAGUA_HD int64_t compressed_bytes(Format format, int64_t n, int64_t k) {
  return Chunking{format, n, k}.total_bytes();
}

}  // namespace bagua
