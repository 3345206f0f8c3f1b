// Stream-ordered device-memory moves for the device (NCCL) engine's collective
// handlers: they are enqueued on XLA's stream like the collectives around them.
#include <cuda_runtime.h>

#include <string>

#include "communicator.h"

namespace bagua {
namespace {

Status cuda_status(const char* what, cudaError_t e) {
  if (e == cudaSuccess) return {};
  return Status{std::string("CUDA ") + what + ": " + cudaGetErrorString(e), true};
}

cudaStream_t stream_of(Cuda device) { return static_cast<cudaStream_t>(device.stream); }

}  // namespace

Status device_copy(Cuda device, void* dst, const void* src, int64_t bytes) {
  if (dst == src || bytes == 0) return {};
  return cuda_status("copy",
                     cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_of(device)));
}

Status device_zero(Cuda device, void* dst, int64_t bytes) {
  if (bytes == 0) return {};
  return cuda_status("memset", cudaMemsetAsync(dst, 0, bytes, stream_of(device)));
}

// The engine's one host synchronization, used only to read the tiny run-time
// peers and counts arrays of send_recv and alltoall_v that XLA hands over in
// device memory. It waits for the work queued before them; a collective hung
// there is ended by its communicator's watchdog, so the wait is bounded.
Status copy_to_host(Cuda device, void* dst, const void* src, int64_t bytes) {
  if (bytes == 0) return {};
  if (Status s =
          cuda_status("copy to host",
                      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_of(device)));
      !s.ok())
    return s;
  return cuda_status("stream synchronize", cudaStreamSynchronize(stream_of(device)));
}

// From pageable host memory the copy is staged before cudaMemcpyAsync returns, so `src` may be a
// local variable of the caller.
Status copy_from_host(Cuda device, void* dst, const void* src, int64_t bytes) {
  if (bytes == 0) return {};
  return cuda_status("copy from host",
                     cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_of(device)));
}

}  // namespace bagua
