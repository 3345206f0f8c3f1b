// The MPI engine: collectives on host buffers over MPI (the `mpich` wheel is
// the usual MPI). Non-blocking MPI calls are polled against a deadline, so a
// dead peer turns into an error instead of a hang. Allreduces of at least the
// communicator's ring threshold (1 MiB unless BAGUA_MPI_RING_MIN_BYTES says
// otherwise) between nodes run the engine's own ring; everything else is MPI's.
#pragma once

#include <mpi.h>

#include <cstdint>
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

// `comm` as the engine's communicator, which owns it from now on. `abandonable`: it belongs to a
// membership that may change, so an operation may be abandoned with live peers still sending to it.
std::shared_ptr<Communicator> mpi_communicator(MPI_Comm comm, const std::string& name,
                                               double timeout_seconds, int64_t ring_min_bytes,
                                               bool abandonable);

// The MPI communicator under an engine communicator.
MPI_Comm mpi_handle(const Communicator& comm);

// The seconds the communicator's operations wait at most.
double mpi_timeout(const Communicator& comm);

// Whether the ranks of `comm` span more than one node (MPI's view of shared
// memory): only then does the ring threshold matter.
bool mpi_spans_nodes(const Communicator& comm);

// The ring threshold in bytes. Every rank must set the same value between the
// same two collectives (ranks that disagree pick different algorithms, and the
// allreduce fails at the timeout); it applies to collectives started after it.
int64_t mpi_ring_min_bytes(const Communicator& comm);
void set_mpi_ring_min_bytes(Communicator& comm, int64_t bytes);

// The number of ranks that "avg" reductions divide by, for collectives started after it: `ranks`
// (1..size), or the size for 0. Every rank sets the same value between the same two collectives. A
// fault-tolerant job's joiner sends zeros in the step it takes weighed out, and the average is the
// members' that trained it.
void set_mpi_average_divisor(Communicator& comm, int ranks);

}  // namespace bagua
