#include "mpi_membership.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <future>
#include <memory>
#include <stdexcept>
#include <thread>
#include <type_traits>

#include "mpi_communicator.h"
#include "mpi_runtime.h"

namespace bagua {
namespace {

// MPI_Comm_create_group's tag for a shrink to the survivors.
constexpr int kShrinkTag = 4242;

// An MPI_Info with MPICH's "timeout" key (whole seconds, at least 1) for connect and accept.
struct TimeoutInfo {
  explicit TimeoutInfo(double seconds) {
    MPI_Info_create(&info);
    const std::string text = std::to_string(std::max(1L, std::lround(std::ceil(seconds))));
    MPI_Info_set(info, "timeout", text.c_str());
  }
  ~TimeoutInfo() { MPI_Info_free(&info); }
  MPI_Info info;
};

// Runs `make` (MPI work among the group, such as creating a communicator, that may wait for peers
// without a deadline of its own) on a helper thread and waits for it until `timeout_seconds`. A
// peer that died meanwhile leaves the helper blocked in MPI for good: the caller gets an error
// instead, and the process should leave the job (the elastic launcher restarts it).
template <typename Make, typename Result = std::invoke_result_t<Make&>>
Result within_deadline(const std::string& what, double timeout_seconds, Make make) {
  if (!thread_multiple()) {  // no second thread may call MPI: wait without a deadline
    auto lock = lock_mpi();
    return make();
  }
  auto task = std::make_shared<std::packaged_task<Result()>>(std::move(make));
  std::future<Result> made = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  if (made.wait_for(std::chrono::duration<double>(timeout_seconds)) != std::future_status::ready) {
    forbid_finalize();  // MPI_Finalize would wait for the blocked helper
    char seconds[32];
    std::snprintf(seconds, sizeof seconds, "%g", timeout_seconds);
    throw std::runtime_error(what + " did not complete within " + seconds +
                             " s; a member may have died meanwhile");
  }
  return made.get();
}

// The end of a build by one process, on both sides: `inter`'s two groups merged into one
// communicator (the newcomer's side `last`), `inter` freed, and every pair of the result connected
// while all of them are still in the build.
MPI_Comm merge_and_connect(MPI_Comm inter, bool last, const std::string& what) {
  MPI_Comm merged = MPI_COMM_NULL;
  MPI_Comm_set_errhandler(inter, MPI_ERRORS_RETURN);
  const int rc = MPI_Intercomm_merge(inter, last, &merged);
  MPI_Comm_free(&inter);
  if (rc != MPI_SUCCESS) throw std::runtime_error(what + " failed in the merge: " + mpi_error(rc));
  MPI_Comm_set_errhandler(merged, MPI_ERRORS_RETURN);
  if (connect_every_pair(merged) != MPI_SUCCESS)
    throw std::runtime_error(what +
                             " failed: a member of the new communicator could not be reached");
  return merged;
}

}  // namespace

std::shared_ptr<Communicator> mpi_self(const std::string& name, double timeout_seconds) {
  const int64_t ring_min_bytes = ring_min_bytes_from_environment();
  ensure_initialized();
  MPI_Comm comm;
  MPI_Comm_dup(MPI_COMM_SELF, &comm);
  return mpi_communicator(comm, name, timeout_seconds, ring_min_bytes, true);
}

std::shared_ptr<Communicator> mpi_shrink(Communicator& parent, const std::vector<int>& members,
                                         const std::string& name) {
  const std::string what = "MPI shrink of communicator '" + parent.name() + "' to '" + name + "'";
  const MPI_Comm old = mpi_handle(parent);
  if (members.empty()) throw std::invalid_argument(what + ": no members");
  for (int m : members)
    if (m < 0 || m >= parent.size())
      throw std::invalid_argument(what + ": member " + std::to_string(m) + " is not a rank of " +
                                  std::to_string(parent.size()));
  if (std::find(members.begin(), members.end(), parent.rank()) == members.end())
    throw std::invalid_argument(what + ": this rank (" + std::to_string(parent.rank()) +
                                ") is not among the members");
  MPI_Comm comm = within_deadline(what, mpi_timeout(parent), [old, members] {
    MPI_Group all, kept;
    MPI_Comm_group(old, &all);
    MPI_Group_incl(all, static_cast<int>(members.size()), members.data(), &kept);
    MPI_Comm made = MPI_COMM_NULL;
    // Only the members take part (ULFM's MPIX_Comm_shrink is a stub in MPICH's ch4).
    if (MPI_Comm_create_group(old, kept, kShrinkTag, &made) != MPI_SUCCESS) made = MPI_COMM_NULL;
    MPI_Group_free(&kept);
    MPI_Group_free(&all);
    return made;
  });
  if (comm == MPI_COMM_NULL) throw std::runtime_error(what + " failed");
  return mpi_communicator(comm, name, mpi_timeout(parent), mpi_ring_min_bytes(parent), true);
}

std::string mpi_open_port() {
  ensure_initialized();
  char port[MPI_MAX_PORT_NAME] = {};
  const int rc = MPI_Open_port(MPI_INFO_NULL, port);
  if (rc != MPI_SUCCESS)
    throw std::runtime_error(
        "MPI_Open_port failed (MPICH's UCX netmod writes an address longer than a port name holds: "
        "set MPIR_CVAR_CH4_NETMOD=ofi and FI_PROVIDER=tcp before MPI starts): " +
        mpi_error(rc));
  return port;
}

void mpi_close_port(const std::string& port) { MPI_Close_port(port.c_str()); }

std::shared_ptr<Communicator> mpi_accept(Communicator& group, const std::string& port,
                                         const std::string& name, double wait_seconds) {
  const MPI_Comm local = mpi_handle(group);
  const double timeout = mpi_timeout(group);
  const std::string what = "MPI accept into '" + name + "'";
  MPI_Comm comm = within_deadline(what, wait_seconds + timeout, [local, port, wait_seconds, what] {
    PatientSends patient;
    TimeoutInfo info(wait_seconds);
    MPI_Comm inter = MPI_COMM_NULL;
    // Rank 0 tells the others when no newcomer came in time, and they all fail alike.
    if (MPI_Comm_accept(port.c_str(), info.info, 0, local, &inter) != MPI_SUCCESS)
      return MPI_COMM_NULL;
    return merge_and_connect(inter, false, what);
  });
  if (comm == MPI_COMM_NULL) return nullptr;
  return mpi_communicator(comm, name, timeout, mpi_ring_min_bytes(group), true);
}

std::shared_ptr<Communicator> mpi_connect(const std::string& port, const std::string& name,
                                          double timeout_seconds) {
  const int64_t ring_min_bytes = ring_min_bytes_from_environment();
  ensure_initialized();
  const std::string what = "MPI connect into '" + name + "'";
  MPI_Comm comm = within_deadline(what, timeout_seconds + 1, [port, timeout_seconds, what] {
    PatientSends patient;
    TimeoutInfo info(timeout_seconds);
    MPI_Comm inter = MPI_COMM_NULL;
    MPI_Comm_set_errhandler(MPI_COMM_SELF, MPI_ERRORS_RETURN);
    const int rc = MPI_Comm_connect(port.c_str(), info.info, 0, MPI_COMM_SELF, &inter);
    if (rc != MPI_SUCCESS) throw std::runtime_error(what + " failed: " + mpi_error(rc));
    return merge_and_connect(inter, true, what);
  });
  return mpi_communicator(comm, name, timeout_seconds, ring_min_bytes, true);
}

bool mpi_any(Communicator& group, bool yes) {
  const MPI_Comm comm = mpi_handle(group);
  const std::string what = "MPI agreement on '" + group.name() + "'";
  return within_deadline(what, mpi_timeout(group), [comm, what, yes] {
    int any = yes;
    const int rc = MPI_Allreduce(MPI_IN_PLACE, &any, 1, MPI_INT, MPI_LOR, comm);
    if (rc != MPI_SUCCESS) throw std::runtime_error(what + " failed: " + mpi_error(rc));
    return any != 0;
  });
}

}  // namespace bagua
