// Host-memory moves for the host (MPI) engine's collective handlers.
#include <cstring>

#include "communicator.h"

namespace bagua {

Status device_copy(Cpu, void* dst, const void* src, int64_t bytes) {
  if (dst != src) std::memcpy(dst, src, bytes);
  return {};
}

Status device_zero(Cpu, void* dst, int64_t bytes) {
  std::memset(dst, 0, bytes);
  return {};
}

Status copy_to_host(Cpu, void* dst, const void* src, int64_t bytes) {
  std::memcpy(dst, src, bytes);
  return {};
}

Status copy_from_host(Cpu, void* dst, const void* src, int64_t bytes) {
  std::memcpy(dst, src, bytes);
  return {};
}

}  // namespace bagua
