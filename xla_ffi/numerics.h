// The scalar arithmetic of every kernel, written once for host and device.
//
// Each float32 operation is rounded on its own (no fused multiply-add), so the
// CPU and CUDA kernels give the same bits as the NumPy reference in the tests.
// Host code is compiled with -ffp-contract=off; device code uses the _rn
// intrinsics, which nvcc never contracts.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "dtypes.h"

namespace bagua::math {

// The four operations, F float or double, each rounded once: on the device by
// the _rn intrinsics, on the host by the operator (-ffp-contract=off).
#if defined(__CUDA_ARCH__)
#define BAGUA_ROUNDED(op, float_rn, double_rn) \
  if constexpr (std::is_same_v<F, double>)     \
    return double_rn(a, b);                    \
  else                                         \
    return float_rn(a, b)
#else
#define BAGUA_ROUNDED(op, float_rn, double_rn) return a op b
#endif
template <typename F>
BAGUA_HD F add_rn(F a, F b) {
  BAGUA_ROUNDED(+, __fadd_rn, __dadd_rn);
}
template <typename F>
BAGUA_HD F sub_rn(F a, F b) {
  BAGUA_ROUNDED(-, __fsub_rn, __dsub_rn);
}
template <typename F>
BAGUA_HD F mul_rn(F a, F b) {
  BAGUA_ROUNDED(*, __fmul_rn, __dmul_rn);
}
template <typename F>
BAGUA_HD F div_rn(F a, F b) {
  BAGUA_ROUNDED(/, __fdiv_rn, __ddiv_rn);
}
#undef BAGUA_ROUNDED

BAGUA_HD float narrow_rn(double v) {
#if defined(__CUDA_ARCH__)
  return __double2float_rn(v);
#else
  return static_cast<float>(v);
#endif
}

BAGUA_HD bool is_finite(float v) { return sub_rn(v, v) == 0.0f; }

// A signed integer with the order of the floats and -0 < +0; the map is its own
// inverse. A min-max group's lo and hi are its values of the least and the
// greatest key (SPEC section 2), which every device finds exactly, in any order.
BAGUA_HD int32_t order_key(int32_t bits) { return bits ^ ((bits >> 31) & 0x7fffffff); }
BAGUA_HD int32_t float_key(float f) { return order_key(static_cast<int32_t>(float_bits(f))); }
BAGUA_HD float key_float(int32_t key) { return bits_float(static_cast<uint32_t>(order_key(key))); }

// ---- Min-max codes (MinMaxUInt8, MinMaxUInt4) ----------------------------
//
// SPEC section 2's zero-anchored grid, for codes of kBits bits (8 or 4) with
// S = 2^kBits - 2 steps (254 or 14) between a chunk's lo and hi: anchor z = 0
// when lo <= 0 <= hi, else z = lo; scale = S / (hi - lo); base = rint((lo - z)
// * scale) in [-S, 0]; q = clamp(rint((x - z) * scale) - base, 0, S + 1);
// decoding is z + (q + base) * ((hi - lo) / S). The grid passes through 0
// whenever the chunk's range holds 0, so an exact zero decodes to an exact
// zero. The extra code S + 1 absorbs the rounding of lo and hi onto the grid.

template <int kBits>
struct MinMaxCodes {
  static_assert(kBits == 8 || kBits == 4, "min-max codes are 8 or 4 bits wide");
  static constexpr float kSteps = static_cast<float>((1 << kBits) - 2);  // 254 or 14
  static constexpr float kTop = static_cast<float>((1 << kBits) - 1);    // the largest code
};

// Round to nearest, ties to even, for |v| < 2^22 (2^51 for double): adding and
// removing 1.5 * 2^23 (2^52) leaves no fraction bits. Unlike rint this vectorizes.
BAGUA_HD float round_half_even(float v) { return sub_rn(add_rn(v, 12582912.0f), 12582912.0f); }
BAGUA_HD double round_half_even(double v) {
  return sub_rn(add_rn(v, 6755399441055744.0), 6755399441055744.0);
}

template <typename F>
BAGUA_HD F clamp(F v, F low, F high) {
  v = v > low ? v : low;
  return v < high ? v : high;
}

// v clamped to [low, high], with NaN mapped to 0 (0 must lie in [low, high]).
// A NaN arises in a constant chunk: scale = inf and x - z = 0.
template <typename F>
BAGUA_HD F clamp_or_zero(F v, F low, F high) {
  return clamp(v == v ? v : F(0), low, high);
}

BAGUA_HD float minmax_anchor(float lo, float hi) { return (lo <= 0.0f && 0.0f <= hi) ? 0.0f : lo; }

// Finite chunks that float32 cannot grid (SPEC section 2): a range below 2^-118
// (254 / range overflows near 7.5e-37, and (hi - lo) / 254 is subnormal below
// 3e-36; 14 steps are further from both edges, so one test serves both), or values of magnitude
// 2^126 or more (hi - lo, or a decoded value, may overflow). They encode in double and decode on
// power-of-two-scaled values (MinMaxGrid); every other chunk has the float32 definition's bits.
constexpr float kWideMagnitude = 0x1p126f;
constexpr float kNarrowRange = 0x1p-118f;

BAGUA_HD bool minmax_wide(float lo, float hi) {
  const float a = lo < 0.0f ? -lo : lo, b = hi < 0.0f ? -hi : hi;
  const float magnitude = a > b ? a : b, range = sub_rn(hi, lo);
  return is_finite(magnitude) &&
         (magnitude >= kWideMagnitude || (range > 0.0f && range < kNarrowRange));
}

// The per-chunk constants of the grid, each computed once in float32. A wide
// chunk encodes with its double scale (minmax_wide_scale, computed where it is
// used so that the float32 path's registers never hold it), and decodes in
// float32 on values scaled by a power of two into float32's normal range:
// step and z_scaled are its step and anchor times 1 / unit (unit = 2^-64 for a
// tiny range, 2^64 for huge values), and the result is clamped to [lo, hi].
struct MinMaxGrid {
  float z, scale, base, step;
  bool wide;
  float lo, hi, unit, z_scaled;
};

BAGUA_HD double minmax_wide_range(const MinMaxGrid& g) {
  return sub_rn(static_cast<double>(g.hi), static_cast<double>(g.lo));
}
template <int kBits>
BAGUA_HD double minmax_wide_scale(const MinMaxGrid& g) {
  return div_rn(static_cast<double>(MinMaxCodes<kBits>::kSteps), minmax_wide_range(g));
}
template <int kBits>
BAGUA_HD double minmax_wide_step(const MinMaxGrid& g) {
  return div_rn(minmax_wide_range(g), static_cast<double>(MinMaxCodes<kBits>::kSteps));
}

template <int kBits>
BAGUA_HD MinMaxGrid minmax_grid(float lo, float hi) {
  constexpr float kSteps = MinMaxCodes<kBits>::kSteps;
  MinMaxGrid g;
  g.z = minmax_anchor(lo, hi);
  g.wide = minmax_wide(lo, hi);
  g.lo = lo;
  g.hi = hi;
  const float range = sub_rn(hi, lo);
  g.scale = div_rn(kSteps, range);
  g.step = div_rn(range, kSteps);
  g.unit = 1.0f;
  g.z_scaled = g.z;
  if (g.wide) {
    const double offset = mul_rn(sub_rn(static_cast<double>(lo), static_cast<double>(g.z)),
                                 minmax_wide_scale<kBits>(g));
    g.base = static_cast<float>(round_half_even(clamp_or_zero(offset, -double{kSteps}, 0.0)));
    const bool tiny = lo > -kWideMagnitude && hi < kWideMagnitude;
    g.unit = tiny ? 0x1p-64f : 0x1p64f;
    g.z_scaled = mul_rn(g.z, tiny ? 0x1p64f : 0x1p-64f);
    g.step = narrow_rn(mul_rn(minmax_wide_step<kBits>(g), tiny ? 0x1p64 : 0x1p-64));
  } else {
    g.base = round_half_even(clamp_or_zero(mul_rn(sub_rn(lo, g.z), g.scale), -kSteps, 0.0f));
  }
  return g;
}

// Clamping (x - z) * scale to [-S - 1, S + 1] before rounding gives the same
// codes (|(x - z) * scale| <= S up to rounding) and keeps the rounding trick in
// range.
template <int kBits>
BAGUA_HD uint8_t minmax_code(float t, float base) {
  constexpr float kTop = MinMaxCodes<kBits>::kTop;
  return static_cast<uint8_t>(static_cast<int>(clamp_or_zero(sub_rn(t, base), 0.0f, kTop)));
}

// Encoding and decoding come in a float32 and a wide form; kernels choose one
// per chunk (the choice is uniform over a chunk), minmax_encode and
// minmax_decode per element. Decoding is the same for every code width.
template <int kBits>
BAGUA_HD uint8_t minmax_encode_f32(float x, const MinMaxGrid& g) {
  constexpr float kTop = MinMaxCodes<kBits>::kTop;
  return minmax_code<kBits>(
      round_half_even(clamp_or_zero(mul_rn(sub_rn(x, g.z), g.scale), -kTop, kTop)), g.base);
}

template <int kBits>
BAGUA_HD uint8_t minmax_encode_wide(float x, const MinMaxGrid& g, double wide_scale) {
  constexpr double kTop = MinMaxCodes<kBits>::kTop;
  const double t = mul_rn(sub_rn(static_cast<double>(x), static_cast<double>(g.z)), wide_scale);
  return minmax_code<kBits>(static_cast<float>(round_half_even(clamp_or_zero(t, -kTop, kTop))),
                            g.base);
}

template <int kBits>
BAGUA_HD uint8_t minmax_encode(float x, const MinMaxGrid& g) {
  return g.wide ? minmax_encode_wide<kBits>(x, g, minmax_wide_scale<kBits>(g))
                : minmax_encode_f32<kBits>(x, g);
}

BAGUA_HD float minmax_decode_f32(uint8_t q, const MinMaxGrid& g) {
  return add_rn(g.z, mul_rn(add_rn(static_cast<float>(q), g.base), g.step));
}

// minmax_decode_f32 with one step fewer, for the two cases of a float32 grid and
// with the same bits: anchored at 0, z + v is v (v is never -0: q + base is
// never -0, and a nonzero one times step, a normal float, never underflows);
// anchored at lo, base is 0 and q + base is q. The CPU kernels pick one per
// chunk; on the GPU, where decoding is bound by memory, the choice would cost
// registers instead.
BAGUA_HD float minmax_decode_at_zero(uint8_t q, const MinMaxGrid& g) {
  return mul_rn(add_rn(static_cast<float>(q), g.base), g.step);
}
BAGUA_HD float minmax_decode_at_lo(uint8_t q, const MinMaxGrid& g) {
  return add_rn(g.z, mul_rn(static_cast<float>(q), g.step));
}

// Clamped before scaling back to +-FLT_MAX / 2^64 (a rounding up of a value
// near the float32 limit would overflow), so a finite chunk never decodes to
// infinity. Constants, not lo and hi: the clamp costs no registers.
BAGUA_HD float minmax_decode_wide(uint8_t q, const MinMaxGrid& g) {
  const float v = add_rn(g.z_scaled, mul_rn(add_rn(static_cast<float>(q), g.base), g.step));
  return mul_rn(clamp(v, -0x1.fffffep63f, 0x1.fffffep63f), g.unit);
}

BAGUA_HD float minmax_decode(uint8_t q, const MinMaxGrid& g) {
  return g.wide ? minmax_decode_wide(q, g) : minmax_decode_f32(q, g);
}

// ---- Decompress-and-reduce ----------------------------------------------
//
// An element whose float32 sum of k decoded values overflows is summed again
// with every value scaled by 2^-64 (exact for the huge values that overflow;
// small ones are far below the sum's last bit), then scaled back: an average of
// finite values stays finite, a sum overflows only if it really does.

BAGUA_HD float resum_add(float acc, float v) { return add_rn(acc, mul_rn(v, 0x1p-64f)); }

BAGUA_HD float resum_result(float scaled_sum, bool average, float k) {
  return mul_rn(average ? div_rn(scaled_sum, k) : scaled_sum, 0x1p64f);
}

// ---- 1-bit sign ----------------------------------------------------------

BAGUA_HD bool sign_bit(float x) { return x >= 0.0f; }

BAGUA_HD float sign_decode(bool bit, float scale) { return bit ? scale : -scale; }

// ---- Elementwise helpers -------------------------------------------------

BAGUA_HD float average2(float a, float b) { return mul_rn(add_rn(a, b), 0.5f); }

BAGUA_HD float axpy(float x, float a, float y) { return add_rn(x, mul_rn(a, y)); }

// x + (reduced / n - snapshot): keeps local progress made during the round.
// The share reduced / n comes in computed, so that a kernel may compute it as
// reduced * (1 / n) where that has the same bits (n a power of two).
BAGUA_HD float async_average_of_share(float x, float share, float snapshot) {
  return add_rn(x, sub_rn(share, snapshot));
}
BAGUA_HD float async_average(float x, float reduced, float n, float snapshot) {
  return async_average_of_share(x, div_rn(reduced, n), snapshot);
}

// z = x + left/3 + right/3 - (5/3) w: the low-precision decentralized
// difference that each rank compresses and sends to both ring neighbours. Summed
// as differences from w so that it is exactly 0 where all four agree (a frozen
// coordinate): x + x/3 + x/3 - (5/3) x rounds to a few ulps, and a chunk of such
// ulps alone encodes them, moving weights that must not move.
BAGUA_HD float lowprec_decentralized_diff(float x, float w, float left, float right) {
  return add_rn(add_rn(sub_rn(x, w), div_rn(sub_rn(left, w), 3.0f)),
                div_rn(sub_rn(right, w), 3.0f));
}

// The helpers are linear in their tensor arguments: where an intermediate
// overflows while the result is finite (a + b of two values near the float32
// limit), the helper run on arguments scaled by 2^-64, scaled back, gives it.
// Every finite float32 result keeps its bits.
template <typename F, typename... X>
BAGUA_HD float rescaled(const F& f, X... x) {
  return mul_rn(f(mul_rn(x, 0x1p-64f)...), 0x1p64f);
}

template <typename F, typename... X>
BAGUA_HD float overflow_safe(const F& f, X... x) {
  const float r = f(x...);
  return is_finite(r) ? r : rescaled(f, x...);
}

}  // namespace bagua::math
