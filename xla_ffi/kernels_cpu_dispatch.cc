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
#define BAGUA_FORWARD(fn, ...)         \
  switch (best_isa()) {                \
    case Isa::kAvx512:                 \
      return avx512::fn(__VA_ARGS__);  \
    case Isa::kAvx2:                   \
      return avx2::fn(__VA_ARGS__);    \
    default:                           \
      return generic::fn(__VA_ARGS__); \
  }
#else
#define BAGUA_FORWARD(fn, ...) return generic::fn(__VA_ARGS__);
#endif

#define BAGUA_FORWARD_KERNEL(Device, T, name, parameters, arguments) \
  template <typename T>                                              \
  Status name(Device device, BAGUA_UNPARENTHESIZE parameters) {      \
    BAGUA_FORWARD(name, device, BAGUA_UNPARENTHESIZE arguments)      \
  }
BAGUA_KERNELS(BAGUA_FORWARD_KERNEL, Cpu, T)

BAGUA_INSTANTIATE_KERNELS(Cpu)

}  // namespace bagua::kernels
