// The byte layout of compressed buffers, defined once for every kernel and
// front end.
//
// A flat tensor of n elements is split into k chunks of c = ceil(n / k)
// elements; chunk i covers [min(i*c, n), min((i+1)*c, n)), so trailing chunks
// may be shorter or empty. The compressed buffer is one uint8 array holding, for
// each chunk in order, a slot:
//
//   offset 0   float32 a     MinMaxUInt8/4: lo (chunk minimum); Sign: scale
//   offset 4   float32 b     MinMaxUInt8/4: hi (chunk maximum); Sign: unused, 0
//   offset 8   8 zero bytes  so that the payload starts 16-byte aligned
//   offset 16  payload       MinMaxUInt8: one code per element;
//                            MinMaxUInt4: one 4-bit code per element, 2 per
//                            byte, element 2i in the low nibble of byte i;
//                            Sign: one bit per element, 8 per byte, LSB first
//   padding to the next multiple of 16 bytes (and the high nibble of an odd
//   MinMaxUInt4 chunk's last byte): zeros
//
// An empty chunk is a 16-byte header with no payload. Every slot starts 16-byte
// aligned, so a chunk can be sent or decoded on its own: k single-chunk buffers
// of m elements laid end to end are exactly the buffer of m*k elements in k
// chunks, which is what an all-to-all of chunks delivers.
#pragma once

#include <cstdint>

#include "dtypes.h"

namespace bagua {

inline constexpr int64_t kHeaderBytes = 16;
inline constexpr int64_t kSlotAlignment = 16;

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

BAGUA_HD int64_t slot_bytes(Format format, int64_t elements) {
  return kHeaderBytes + align_up(payload_bytes(format, elements));
}

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
};

BAGUA_HD int64_t compressed_bytes(Format format, int64_t n, int64_t k) {
  return Chunking{format, n, k}.total_bytes();
}

}  // namespace bagua
