// The fake NCCL's calls and the test's control of them. One mutex guards all
// state: the engine's watchdog polls from its own thread.
#include "fake_nccl.h"

#include <chrono>
#include <memory>
#include <mutex>
#include <thread>

struct ncclComm {
  fake_nccl::CommState state;
  int polls_left = 0;  // ncclInProgress polls before the state settles
  ncclResult_t async_error = ncclSuccess;
  std::vector<cudaStream_t> held;  // streams whose work waits for an abort
};

namespace fake_nccl {
namespace {

std::mutex g_mutex;
Script g_script;
std::vector<std::unique_ptr<ncclComm>> g_comms;

ncclComm_t create(int rank, int size) {
  g_comms.push_back(std::make_unique<ncclComm>());
  ncclComm_t comm = g_comms.back().get();
  comm->state.rank = rank;
  comm->state.size = size;
  return comm;
}

ncclResult_t operation(ncclComm_t comm, ncclDataType_t type, ncclRedOp_t op, size_t count,
                       cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(g_mutex);
  comm->state.calls += 1;
  comm->state.last_type = type;
  comm->state.last_op = op;
  comm->state.last_count = count;
  if (g_script.call_result == ncclInProgress) comm->polls_left = g_script.call_polls;
  if (g_script.call_result != ncclSuccess && g_script.call_result != ncclInProgress)
    return g_script.call_result;
  cuda_shim::enqueue(stream, g_script.hold_collectives);
  if (g_script.hold_collectives) comm->held.push_back(stream);
  return g_script.call_result;
}

}  // namespace

void set_script(const Script& script) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_script = script;
}

void set_async_error(ncclComm_t comm, ncclResult_t error) {
  std::lock_guard<std::mutex> lock(g_mutex);
  comm->async_error = error;
}

std::vector<ncclComm_t> comms() {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<ncclComm_t> all;
  for (const auto& c : g_comms) all.push_back(c.get());
  return all;
}

CommState state(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return comm->state;
}

void reset() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_comms.clear();
  g_script = Script{};
}

}  // namespace fake_nccl

using fake_nccl::g_mutex;
using fake_nccl::g_script;

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error";
    case ncclSystemError:
      return "unhandled system error";
    case ncclInternalError:
      return "internal error";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInProgress:
      return "NCCL operation in progress";
    default:
      return "fake NCCL error";
  }
}

const char* ncclGetLastError(ncclComm_t) { return "scripted by the test"; }

// Bytes 0..127, zeros included, so that a text-only exchange would be caught.
ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; ++i) id->internal[i] = static_cast<char>(i * 37);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t*) {
  std::lock_guard<std::mutex> lock(g_mutex);
  *comm = fake_nccl::create(rank, nranks);
  (*comm)->state.unique_id.assign(id.internal, NCCL_UNIQUE_ID_BYTES);
  (*comm)->polls_left = g_script.init_polls;
  return g_script.init_result;
}

// As NCCL's non-blocking split: the child appears while the parent is busy.
ncclResult_t ncclCommSplit(ncclComm_t comm, int, int, ncclComm_t* child, ncclConfig_t*) {
  std::lock_guard<std::mutex> lock(g_mutex);
  ncclComm_t created = fake_nccl::create(g_script.split_rank, g_script.split_size);
  comm->state.child = created;
  comm->polls_left = g_script.split_polls;
  if (g_script.split_child_after_ms > 0) {
    std::thread([child, created, delay = std::chrono::milliseconds(g_script.split_child_after_ms)] {
      std::this_thread::sleep_for(delay);
      __atomic_store_n(child, created, __ATOMIC_RELEASE);
    }).detach();
  } else {
    __atomic_store_n(child, created, __ATOMIC_RELEASE);
  }
  return ncclInProgress;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (comm->async_error != ncclSuccess) {
    *state = comm->async_error;
  } else if (comm->polls_left != 0) {
    if (comm->polls_left > 0) --comm->polls_left;
    *state = ncclInProgress;
  } else {
    *state = ncclSuccess;
  }
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(ncclComm_t comm, int* rank) {
  std::lock_guard<std::mutex> lock(g_mutex);
  *rank = comm->state.rank;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(ncclComm_t comm, int* count) {
  std::lock_guard<std::mutex> lock(g_mutex);
  *count = comm->state.size;
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(g_mutex);
  comm->state.finalized = true;
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(g_mutex);
  comm->state.destroyed = true;
  return ncclSuccess;
}

// Ends the communicator's held work, as a real abort stops its kernels.
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(g_mutex);
  comm->state.aborted = true;
  comm->polls_left = 0;
  for (cudaStream_t s : comm->held) cuda_shim::release(s);
  comm->held.clear();
  return ncclSuccess;
}

// As 2.28's revoke: the operations in flight stop (their streams move on) and the communicator
// stays, quiescent, for a shrink or a destroy.
ncclResult_t ncclCommRevoke(ncclComm_t comm, int) {
  std::lock_guard<std::mutex> lock(g_mutex);
  comm->state.revoked = true;
  comm->polls_left = 1;
  for (cudaStream_t s : comm->held) cuda_shim::release(s);
  comm->held.clear();
  return ncclInProgress;
}

// The child's rank is the parent's less the excluded ranks below it, as NCCL renumbers.
ncclResult_t ncclCommShrink(ncclComm_t comm, int* excluded, int count, ncclComm_t* child,
                            ncclConfig_t*, int flags) {
  std::lock_guard<std::mutex> lock(g_mutex);
  int below = 0;
  for (int i = 0; i < count; ++i) below += excluded[i] < comm->state.rank;
  ncclComm_t created = fake_nccl::create(comm->state.rank - below, comm->state.size - count);
  comm->state.child = created;
  comm->state.excluded.assign(excluded, excluded + count);
  comm->state.shrink_flags = flags;
  comm->polls_left = g_script.split_polls;
  __atomic_store_n(child, created, __ATOMIC_RELEASE);
  return ncclInProgress;
}

ncclResult_t ncclGroupStart() { return ncclSuccess; }
ncclResult_t ncclGroupEnd() { return ncclSuccess; }

ncclResult_t ncclAllReduce(const void*, void*, size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  return fake_nccl::operation(comm, type, op, count, stream);
}
ncclResult_t ncclReduce(const void*, void*, size_t count, ncclDataType_t type, ncclRedOp_t op, int,
                        ncclComm_t comm, cudaStream_t stream) {
  return fake_nccl::operation(comm, type, op, count, stream);
}
ncclResult_t ncclBroadcast(const void*, void*, size_t count, ncclDataType_t type, int,
                           ncclComm_t comm, cudaStream_t stream) {
  return fake_nccl::operation(comm, type, ncclSum, count, stream);
}
ncclResult_t ncclReduceScatter(const void*, void*, size_t count, ncclDataType_t type,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return fake_nccl::operation(comm, type, op, count, stream);
}
ncclResult_t ncclAllGather(const void*, void*, size_t count, ncclDataType_t type, ncclComm_t comm,
                           cudaStream_t stream) {
  return fake_nccl::operation(comm, type, ncclSum, count, stream);
}
ncclResult_t ncclSend(const void*, size_t count, ncclDataType_t type, int, ncclComm_t comm,
                      cudaStream_t stream) {
  return fake_nccl::operation(comm, type, ncclSum, count, stream);
}
ncclResult_t ncclRecv(void*, size_t count, ncclDataType_t type, int, ncclComm_t comm,
                      cudaStream_t stream) {
  return fake_nccl::operation(comm, type, ncclSum, count, stream);
}
