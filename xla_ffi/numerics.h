// The scalar arithmetic of every kernel, written once for host and device.
//
// Each float32 operation is rounded on its own (no fused multiply-add), so the
// CPU and CUDA kernels give the same bits as the NumPy reference in the tests.
// Host code is compiled with -ffp-contract=off; device code uses the _rn
// intrinsics, which nvcc never contracts.
#pragma once

#include <cmath>
#include <cstdint>

#include "dtypes.h"

namespace bagua::math {

BAGUA_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

BAGUA_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

BAGUA_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

BAGUA_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// NaN-propagating min and max: a chunk holding NaN gets NaN bounds, so it
// decodes to NaN instead of finite garbage.
BAGUA_HD float nan_min(float a, float b) { return (b < a || b != b) ? b : a; }
BAGUA_HD float nan_max(float a, float b) { return (b > a || b != b) ? b : a; }

// ---- MinMaxUInt8 ---------------------------------------------------------
//
// SPEC section 2's zero-anchored grid: anchor z = 0 when lo <= 0 <= hi, else
// z = lo; scale = 254 / (hi - lo); base = rint((lo - z) * scale) in [-254, 0];
// q = clamp(rint((x - z) * scale) - base, 0, 255); decoding is
// z + (q + base) * ((hi - lo) / 254). The grid passes through 0 whenever the
// chunk's range holds 0, so an exact zero decodes to an exact zero.

// Round to nearest, ties to even, for |v| < 2^22: adding and removing 1.5 * 2^23
// leaves no fraction bits. Unlike rintf this vectorizes on every x86-64.
BAGUA_HD float round_half_even(float v) { return sub_rn(add_rn(v, 12582912.0f), 12582912.0f); }

// v clamped to [low, high], with NaN mapped to 0 (0 must lie in [low, high]).
// A NaN arises in a constant chunk: scale = inf and x - z = 0.
BAGUA_HD float clamp_or_zero(float v, float low, float high) {
  v = v == v ? v : 0.0f;
  v = v > low ? v : low;
  return v < high ? v : high;
}

BAGUA_HD float minmax_anchor(float lo, float hi) { return (lo <= 0.0f && 0.0f <= hi) ? 0.0f : lo; }

// The per-chunk constants of the grid, each computed once in float32.
struct MinMaxGrid {
  float z, scale, base, step;
};

BAGUA_HD MinMaxGrid minmax_grid(float lo, float hi) {
  MinMaxGrid g;
  g.z = minmax_anchor(lo, hi);
  const float range = sub_rn(hi, lo);
  g.scale = div_rn(254.0f, range);
  g.base = round_half_even(clamp_or_zero(mul_rn(sub_rn(lo, g.z), g.scale), -254.0f, 0.0f));
  g.step = div_rn(range, 254.0f);
  return g;
}

// Clamping (x - z) * scale to [-255, 255] before rounding gives the same codes
// (|(x - z) * scale| <= 254 up to rounding) and keeps the rounding trick in range.
BAGUA_HD uint8_t minmax_encode(float x, const MinMaxGrid& g) {
  const float t = round_half_even(clamp_or_zero(mul_rn(sub_rn(x, g.z), g.scale), -255.0f, 255.0f));
  return static_cast<uint8_t>(static_cast<int>(clamp_or_zero(sub_rn(t, g.base), 0.0f, 255.0f)));
}

BAGUA_HD float minmax_decode(uint8_t q, const MinMaxGrid& g) {
  return add_rn(g.z, mul_rn(add_rn(static_cast<float>(q), g.base), g.step));
}

// ---- 1-bit sign ----------------------------------------------------------

BAGUA_HD bool sign_bit(float x) { return x >= 0.0f; }

BAGUA_HD float sign_decode(bool bit, float scale) { return bit ? scale : -scale; }

// ---- Elementwise helpers -------------------------------------------------

BAGUA_HD float average2(float a, float b) { return mul_rn(add_rn(a, b), 0.5f); }

BAGUA_HD float axpy(float x, float a, float y) { return add_rn(x, mul_rn(a, y)); }

// x + (reduced / n - snapshot): keeps local progress made during the round.
BAGUA_HD float async_average(float x, float reduced, float n, float snapshot) {
  return add_rn(x, sub_rn(div_rn(reduced, n), snapshot));
}

// z = x + left/3 + right/3 - (5/3) w: the low-precision decentralized
// difference that each rank compresses and sends to both ring neighbours.
BAGUA_HD float lowprec_decentralized_diff(float x, float w, float left, float right) {
  const float five_thirds = 5.0f / 3.0f;
  return sub_rn(add_rn(add_rn(x, div_rn(left, 3.0f)), div_rn(right, 3.0f)),
                mul_rn(five_thirds, w));
}

}  // namespace bagua::math
