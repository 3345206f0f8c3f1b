// The MPI engine's membership changes: communicators built for a job whose
// members come and go, each a builder that fails instead of waiting past its
// timeout for a peer that died meanwhile.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "communicator.h"

namespace bagua {

// This process alone (MPI_COMM_SELF duplicated): the group a store-built world
// starts from.
std::shared_ptr<Communicator> mpi_self(const std::string& name, double timeout_seconds);

// The ranks `members` of `parent` (in that order: member i becomes rank i),
// over MPI_Comm_create_group, so only the members take part: the survivors of a
// membership change, whatever became of the others. Every member calls it with
// the same list; it fails instead of waiting past the parent's timeout.
std::shared_ptr<Communicator> mpi_shrink(Communicator& parent, const std::vector<int>& members,
                                         const std::string& name);

// Growing a communicator by one process, e.g. building a world through the
// job's store with every rank its own `mpiexec -n 1` job (so a rank killed by a
// signal ends only its own job): rank 0 of `group` opens a port and publishes
// it, every rank of `group` accepts, and the newcomer connects; the result is
// `group`'s ranks followed by the newcomer. The group waits `wait_seconds` for
// the newcomer (MPICH counts whole seconds, at least 1) and gets null on every
// rank when none connected by then: it may accept again on the same port, or
// give up a newcomer that died (mpi_any). Both sides fail instead of waiting
// past their timeout once the newcomer connected.
std::string mpi_open_port();
void mpi_close_port(const std::string& port);
std::shared_ptr<Communicator> mpi_accept(Communicator& group, const std::string& port,
                                         const std::string& name, double wait_seconds);
std::shared_ptr<Communicator> mpi_connect(const std::string& port, const std::string& name,
                                          double timeout_seconds);

// Whether any rank of `group` passes `yes`: every rank calls it, e.g. to decide together whether
// to accept again. MPI's own allreduce, so it works on a communicator revoked meanwhile (a closed
// epoch's, which the next one grows); it fails instead of waiting past the group's timeout.
bool mpi_any(Communicator& group, bool yes);

}  // namespace bagua
