// The NCCL engine: collectives on device buffers, enqueued on the caller's CUDA
// stream without synchronizing the host. A watchdog thread per communicator
// watches the enqueued operations; one that does not complete in time, or an
// asynchronous NCCL error, aborts the communicator (which unblocks the stream),
// and every later call on it fails with the recorded reason.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "communicator.h"

namespace bagua {

// A fresh ncclUniqueId (NCCL_UNIQUE_ID_BYTES raw bytes) for rank 0 to share.
std::string nccl_unique_id();

// This process's rank of a communicator of `size` ranks sharing `unique_id`, on
// CUDA device `device` (-1: the calling thread's current device). Every rank
// must call it; it fails instead of waiting longer than `timeout_seconds`.
std::shared_ptr<Communicator> nccl_create(const std::string& unique_id, int rank, int size,
                                          const std::string& name, double timeout_seconds,
                                          int device);

// The ranks of `parent` with the same color (>= 0), ordered by key
// (ncclCommSplit). `parent` must be an NCCL communicator; every rank calls it.
std::shared_ptr<Communicator> nccl_split(Communicator& parent, int color, int key,
                                         const std::string& name);

// The ranks of `parent` but `excluded`, renumbered in order (ncclCommShrink,
// NCCL 2.27; throws on older NCCLs): the survivors of a membership change, each
// calling it with the same list. Revoke the parent first where its operations
// may be waiting for an excluded rank.
std::shared_ptr<Communicator> nccl_shrink(Communicator& parent, const std::vector<int>& excluded,
                                          const std::string& name);

}  // namespace bagua
