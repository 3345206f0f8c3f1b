// MPI's process-wide side for the MPI engine: initialization and thread level,
// the lock MPI calls take without MPI_THREAD_MULTIPLE, the bound on a send's tries,
// datatypes and reductions for every dtype (16-bit floats included), and the ring
// threshold's parsing.
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "communicator.h"
#include "dtypes.h"

namespace bagua {

// Initializes MPI (MPI_THREAD_MULTIPLE asked) once, unless the program did.
void ensure_initialized();

// Whether MPI grants MPI_THREAD_MULTIPLE; without it every MPI call holds lock_mpi().
bool thread_multiple();
std::unique_lock<std::mutex> lock_mpi();

// A collective failed with MPI work still pending: MPI_Finalize would wait for it forever.
void forbid_finalize();

// MPICH's ofi netmod retries a send its provider cannot issue yet (-FI_EAGAIN) inside the MPI
// call, one progress poll per try, up to MPIR_CVAR_CH4_OFI_MAX_EAGAIN_RETRY tries (unbounded
// unless set). The TCP provider answers so while a peer has yet to take a new connection (a live
// one may be busy outside MPI for seconds), and for good once a peer died (it connects again,
// refused each time). A fault-tolerant rank sets a small bound before MPI starts, so that a send
// to a dead peer fails in a fraction of a second; while an instance of this class lives, builds of
// a communicator wait for new connections under kPatientSendRetries instead.
class PatientSends {
 public:
  PatientSends();
  ~PatientSends();
  PatientSends(const PatientSends&) = delete;
  PatientSends& operator=(const PatientSends&) = delete;
};

// A message from every rank of `comm` to every other, waited for: a build calls it under
// PatientSends, while every rank is in the build and takes new connections, so that each pair is
// connected there and, outside builds, a send that cannot be issued means a peer that died.
int connect_every_pair(MPI_Comm comm);

// Memory an abandoned MPI operation may still write into (a live peer's message
// arriving late): it is never freed.
void keep_forever(std::unique_ptr<char[]> memory);

MPI_Datatype mpi_type(DType t);

// Averages are sums divided by the rank count afterwards (divide_in_place, host_reduce.h).
MPI_Op mpi_op(DType t, ReduceOp op);

std::string mpi_error(int code);

// Whether the ranks of `comm` span more than one node (MPI's view: shared memory).
bool ranks_span_nodes(MPI_Comm comm, int size);

void check_ring_min_bytes(int64_t bytes);

// BAGUA_MPI_RING_MIN_BYTES, or 1 MiB when unset; throws on a malformed value.
int64_t ring_min_bytes_from_environment();

// Finalizes MPI if this library initialized it and no communicator is stuck in
// a failed collective.
void mpi_finalize();

}  // namespace bagua
