// The MPI engine: collectives on host buffers over MPI (the `mpich` wheel is
// the usual MPI). Non-blocking MPI calls are polled against a deadline, so a
// dead peer turns into an error instead of a hang. Allreduces of 1 MiB or more
// between nodes run the engine's own ring; everything else is MPI's.
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

// Finalizes MPI if this library initialized it and no communicator is stuck in
// a failed collective (MPI_Finalize would wait for it forever).
void mpi_finalize();

}  // namespace bagua
