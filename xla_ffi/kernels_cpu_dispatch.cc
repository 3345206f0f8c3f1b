// Picks, once per process, the build of kernels_cpu.cc for the widest
// instruction set this processor supports, and forwards every CPU kernel to it.
#include "kernels.h"

namespace bagua::kernels {

namespace generic {
BAGUA_DECLARE_KERNELS(Cpu)
}
#if defined(BAGUA_CPU_X86_ISAS)
namespace avx2 {
BAGUA_DECLARE_KERNELS(Cpu)
}
namespace avx512 {
BAGUA_DECLARE_KERNELS(Cpu)
}
#endif

namespace {

enum class Isa { kGeneric, kAvx2, kAvx512 };

Isa best_isa() {
#if defined(BAGUA_CPU_X86_ISAS)
  static const Isa isa = [] {
    __builtin_cpu_init();
    const bool v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("bmi2");
    const bool v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    return v4 ? Isa::kAvx512 : v3 ? Isa::kAvx2 : Isa::kGeneric;
  }();
  return isa;
#else
  return Isa::kGeneric;
#endif
}

}  // namespace

#if defined(BAGUA_CPU_X86_ISAS)
#define BAGUA_FORWARD(fn, ...)                                     \
  switch (best_isa()) {                                            \
    case Isa::kAvx512:                                             \
      return avx512::fn(__VA_ARGS__);                              \
    case Isa::kAvx2:                                               \
      return avx2::fn(__VA_ARGS__);                                \
    default:                                                       \
      return generic::fn(__VA_ARGS__);                             \
  }
#else
#define BAGUA_FORWARD(fn, ...) return generic::fn(__VA_ARGS__);
#endif

template <typename T>
Status minmax_compress(Cpu d, const T* x, const float* r, int64_t n, int64_t k, uint8_t* out, float* r_out) {
  BAGUA_FORWARD(minmax_compress, d, x, r, n, k, out, r_out)
}
template <typename T>
Status sign_compress(Cpu d, const T* x, const float* r, int64_t n, int64_t k, uint8_t* out, float* r_out) {
  BAGUA_FORWARD(sign_compress, d, x, r, n, k, out, r_out)
}
template <typename T>
Status minmax_decompress(Cpu d, const uint8_t* in, int64_t n, int64_t k, T* out) {
  BAGUA_FORWARD(minmax_decompress, d, in, n, k, out)
}
template <typename T>
Status sign_decompress(Cpu d, const uint8_t* in, int64_t n, int64_t k, T* out) {
  BAGUA_FORWARD(sign_decompress, d, in, n, k, out)
}
template <typename T>
Status minmax_decompress_reduce(Cpu d, const uint8_t* in, int64_t m, int64_t k, bool average, T* out) {
  BAGUA_FORWARD(minmax_decompress_reduce, d, in, m, k, average, out)
}
template <typename T>
Status sign_decompress_reduce(Cpu d, const uint8_t* in, int64_t m, int64_t k, bool average, T* out) {
  BAGUA_FORWARD(sign_decompress_reduce, d, in, m, k, average, out)
}
template <typename T>
Status average2(Cpu d, const T* a, const T* b, int64_t n, T* out) {
  BAGUA_FORWARD(average2, d, a, b, n, out)
}
template <typename T>
Status axpy(Cpu d, const T* x, float a, const T* y, int64_t n, T* out) {
  BAGUA_FORWARD(axpy, d, x, a, y, n, out)
}
template <typename T>
Status async_average(Cpu d, const T* x, const T* reduced, const T* snapshot, float ranks, int64_t n, T* out) {
  BAGUA_FORWARD(async_average, d, x, reduced, snapshot, ranks, n, out)
}
template <typename T>
Status lowprec_decentralized_diff(Cpu d, const T* x, const T* w, const T* left, const T* right, int64_t n, T* out) {
  BAGUA_FORWARD(lowprec_decentralized_diff, d, x, w, left, right, n, out)
}

#define BAGUA_INSTANTIATE(T)                                                                        \
  template Status minmax_compress(Cpu, const T*, const float*, int64_t, int64_t, uint8_t*, float*); \
  template Status sign_compress(Cpu, const T*, const float*, int64_t, int64_t, uint8_t*, float*);   \
  template Status minmax_decompress(Cpu, const uint8_t*, int64_t, int64_t, T*);                     \
  template Status sign_decompress(Cpu, const uint8_t*, int64_t, int64_t, T*);                       \
  template Status minmax_decompress_reduce(Cpu, const uint8_t*, int64_t, int64_t, bool, T*);        \
  template Status sign_decompress_reduce(Cpu, const uint8_t*, int64_t, int64_t, bool, T*);          \
  template Status average2(Cpu, const T*, const T*, int64_t, T*);                                   \
  template Status axpy(Cpu, const T*, float, const T*, int64_t, T*);                                \
  template Status async_average(Cpu, const T*, const T*, const T*, float, int64_t, T*);              \
  template Status lowprec_decentralized_diff(Cpu, const T*, const T*, const T*, const T*, int64_t, T*);

BAGUA_INSTANTIATE(float)
BAGUA_INSTANTIATE(Half)
BAGUA_INSTANTIATE(BFloat16)

}  // namespace bagua::kernels
