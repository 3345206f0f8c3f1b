// The MPI engine: collectives on host buffers over MPI (the `mpich` wheel is
// the usual MPI). Non-blocking MPI calls are polled against a deadline, so a
// dead peer turns into an error instead of a hang. Allreduces of at least the
// communicator's ring threshold (1 MiB unless BAGUA_MPI_RING_MIN_BYTES says
// otherwise) between nodes run the engine's own ring; everything else is MPI's.
#pragma once

#include <memory>
#include <string>

#include "communicator.h"

namespace bagua {

// MPI_COMM_WORLD (duplicated), initializing MPI on first use.
std::shared_ptr<Communicator> mpi_world(const std::string& name, double timeout_seconds);

// The ranks of `parent` with the same color, ordered by key (MPI_Comm_split).
// `parent` must be an MPI communicator.
std::shared_ptr<Communicator> mpi_split(Communicator& parent, int color, int key,
                                        const std::string& name);

// Whether the ranks of `comm` span more than one node (MPI's view of shared
// memory): only then does the ring threshold matter.
bool mpi_spans_nodes(const Communicator& comm);

// The ring threshold in bytes. Every rank must set the same value between the
// same two collectives (ranks that disagree pick different algorithms, and the
// allreduce fails at the timeout); it applies to collectives started after it.
int64_t mpi_ring_min_bytes(const Communicator& comm);
void set_mpi_ring_min_bytes(Communicator& comm, int64_t bytes);

// Finalizes MPI if this library initialized it and no communicator is stuck in
// a failed collective (MPI_Finalize would wait for it forever).
void mpi_finalize();

}  // namespace bagua
