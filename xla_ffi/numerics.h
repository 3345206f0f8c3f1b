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

BAGUA_HD float minmax_scale(float lo, float hi) { return div_rn(255.0f, sub_rn(hi, lo)); }

BAGUA_HD float minmax_step(float lo, float hi) { return div_rn(sub_rn(hi, lo), 255.0f); }

// Round to nearest, ties to even, for 0 <= v < 2^23: adding and removing 2^23
// leaves no fraction bits. Unlike rintf this vectorizes on every x86-64.
BAGUA_HD float round_half_even(float v) { return sub_rn(add_rn(v, 8388608.0f), 8388608.0f); }

// q = clamp(rint((x - lo) * scale), 0, 255). A NaN product (a constant chunk
// has scale = inf and x - lo = 0) encodes as 0. Clamping before rounding gives
// the same codes and keeps the rounding trick in range.
BAGUA_HD uint8_t minmax_encode(float x, float lo, float scale) {
  float v = mul_rn(sub_rn(x, lo), scale);
  v = v > 0.0f ? v : 0.0f;
  v = v < 255.0f ? v : 255.0f;
  return static_cast<uint8_t>(static_cast<int>(round_half_even(v)));
}

BAGUA_HD float minmax_decode(uint8_t q, float lo, float step) {
  return add_rn(lo, mul_rn(static_cast<float>(q), step));
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
