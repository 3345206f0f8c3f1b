// The shim's host streams, events and device memory (see cuda_runtime.h).
// Every call may come from any thread (the NCCL engine's watchdog queries
// events while the caller enqueues), so one mutex guards them all.
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "cuda_runtime.h"

struct CUstream_st {
  int64_t enqueued = 0;
  int64_t completed = 0;
  int64_t held_from = -1;  // first held operation, -1 if none
};

struct CUevent_st {
  CUstream_st* stream = nullptr;
  int64_t position = 0;
};

namespace cuda_shim {
namespace {

std::mutex g_mutex;
CUstream_st g_default_stream;

}  // namespace

cudaStream_t resolve(cudaStream_t stream) { return stream ? stream : &g_default_stream; }

void enqueue(cudaStream_t stream, bool hold) {
  std::lock_guard<std::mutex> lock(g_mutex);
  CUstream_st* s = resolve(stream);
  ++s->enqueued;
  if (hold && s->held_from < 0) s->held_from = s->enqueued;
  if (s->held_from < 0) s->completed = s->enqueued;
}

void release(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(g_mutex);
  CUstream_st* s = resolve(stream);
  s->held_from = -1;
  s->completed = s->enqueued;
}

int64_t pending_on(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(g_mutex);
  CUstream_st* s = resolve(stream);
  return s->enqueued - s->completed;
}

}  // namespace cuda_shim

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  *stream = new CUstream_st;
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  delete stream;
  return cudaSuccess;
}

// Bounded: a held stream reports not ready instead of blocking the host.
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  return cuda_shim::pending_on(stream) == 0 ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned) {
  *event = new CUevent_st;
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete event;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(cuda_shim::g_mutex);
  event->stream = cuda_shim::resolve(stream);
  event->position = event->stream->enqueued;
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  std::lock_guard<std::mutex> lock(cuda_shim::g_mutex);
  if (event->stream == nullptr || event->stream->completed >= event->position) return cudaSuccess;
  return cudaErrorNotReady;
}

cudaError_t cudaMalloc(void** p, std::size_t bytes) {
  *p = std::malloc(bytes);
  return *p ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t cudaFree(void* p) {
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaMemset(void* p, int value, std::size_t bytes) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}

// One device, 0.
cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : cudaErrorInvalidValue; }

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
