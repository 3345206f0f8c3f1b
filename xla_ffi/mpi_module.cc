// The Python extension `_bagua_mpi`: the MPI engine's communicators, its FFI
// collectives for the CPU platform, and the same collectives on DLPack tensors.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "collective_bindings.h"
#include "mpi_communicator.h"
#include "mpi_membership.h"
#include "mpi_runtime.h"

NB_MODULE(_bagua_mpi, m) {
  using namespace bagua;
  collective_bindings::bind<Cpu>(m, "mpi", "Bagua's MPI engine: collectives on host buffers.");

  m.def(
      "world",
      [](const std::string& name, double timeout_seconds) {
        return CommunicatorRegistry::instance().add(mpi_world(name, timeout_seconds));
      },
      nb::arg("name"), nb::arg("timeout_seconds"),
      "A communicator over MPI_COMM_WORLD (initializes MPI); returns its handle.");

  // Splitting waits for every rank (for good if one died: a thread waits for it).
  collective_bindings::def_derived<int, int, const std::string&>(
      m, "split", &mpi_split,
      "Split a communicator: ranks with the same color form one, ordered by key.", "color", "key",
      "name");

  m.def(
      "self",
      [](const std::string& name, double timeout_seconds) {
        return CommunicatorRegistry::instance().add(mpi_self(name, timeout_seconds));
      },
      nb::arg("name"), nb::arg("timeout_seconds"),
      "A communicator of this process alone (initializes MPI); returns its handle.");

  // Shrinking, accepting and connecting wait for other processes: without the GIL.
  collective_bindings::def_derived<const std::vector<int>&, const std::string&>(
      m, "shrink", &mpi_shrink,
      "A communicator of the parent's ranks `members` (member i becomes rank i); only the members "
      "call it.",
      "members", "name");

  m.def("open_port", &mpi_open_port, "Open an MPI port for mpi accept; returns its name.");
  m.def("close_port", &mpi_close_port, nb::arg("port"), "Close a port from open_port.");

  m.def(
      "accept",
      [](int64_t parent, const std::string& port, const std::string& name,
         double wait_seconds) -> std::optional<int64_t> {
        auto group = collective_bindings::lookup(parent);
        std::shared_ptr<Communicator> grown;
        {
          nb::gil_scoped_release release;
          grown = mpi_accept(*group, port, name, wait_seconds);
        }
        if (!grown) return std::nullopt;
        return CommunicatorRegistry::instance().add(std::move(grown));
      },
      nb::arg("parent"), nb::arg("port"), nb::arg("name"), nb::arg("wait_seconds"),
      "Every rank of `parent`: its ranks and the process that connects to `port` (rank 0's) within "
      "`wait_seconds`, as one communicator; returns its handle, or None on every rank when none "
      "connected in time.");

  m.def(
      "any",
      [](int64_t h, bool yes) {
        auto group = collective_bindings::lookup(h);
        nb::gil_scoped_release release;
        return mpi_any(*group, yes);
      },
      nb::arg("handle"), nb::arg("yes"),
      "Whether any rank of the communicator passes `yes` (every rank calls it); works on a revoked "
      "one.");

  m.def(
      "connect",
      [](const std::string& port, const std::string& name, double timeout_seconds) {
        std::shared_ptr<Communicator> grown;
        {
          nb::gil_scoped_release release;
          grown = mpi_connect(port, name, timeout_seconds);
        }
        return CommunicatorRegistry::instance().add(std::move(grown));
      },
      nb::arg("port"), nb::arg("name"), nb::arg("timeout_seconds"),
      "Join the group accepting on `port` as its last rank; returns the communicator's handle.");

  m.def(
      "timeout", [](int64_t h) { return mpi_timeout(*collective_bindings::lookup(h)); },
      nb::arg("handle"), "The seconds the communicator's operations wait at most.");

  m.def(
      "spans_nodes", [](int64_t h) { return mpi_spans_nodes(*collective_bindings::lookup(h)); },
      nb::arg("handle"), "Whether the communicator's ranks span more than one node.");

  m.def(
      "ring_min_bytes",
      [](int64_t h) { return mpi_ring_min_bytes(*collective_bindings::lookup(h)); },
      nb::arg("handle"),
      "The size from which allreduces between nodes take the engine's ring, in bytes.");

  m.def(
      "set_ring_min_bytes",
      [](int64_t h, int64_t bytes) {
        set_mpi_ring_min_bytes(*collective_bindings::lookup(h), bytes);
      },
      nb::arg("handle"), nb::arg("bytes"),
      "Set the ring threshold (>= 0) for the collectives started after it; every rank must set the "
      "same value between the same two collectives.");

  m.def(
      "set_average_divisor",
      [](int64_t h, int ranks) { set_mpi_average_divisor(*collective_bindings::lookup(h), ranks); },
      nb::arg("handle"), nb::arg("ranks"),
      "Set the ranks that averages divide by (1..size; 0: the size) for the collectives "
      "started after it; every rank must set the same value between the same two collectives.");

  m.def(
      "finalize",
      [] {
        CommunicatorRegistry::instance().clear();
        mpi_finalize();
      },
      "Destroy every communicator and finalize MPI (called at exit).");
}
