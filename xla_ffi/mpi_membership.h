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
// `group`'s ranks followed by the newcomer. Both sides fail instead of waiting
// past their timeout.
std::string mpi_open_port();
void mpi_close_port(const std::string& port);
std::shared_ptr<Communicator> mpi_accept(Communicator& group, const std::string& port,
                                         const std::string& name);
std::shared_ptr<Communicator> mpi_connect(const std::string& port, const std::string& name,
                                          double timeout_seconds);

}  // namespace bagua
