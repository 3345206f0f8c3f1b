// The Python extension `_bagua_nccl`: the NCCL engine's communicators, its FFI
// collectives for the CUDA platform, and the same collectives on DLPack tensors.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "collective_bindings.h"
#include "nccl_communicator.h"

NB_MODULE(_bagua_nccl, m) {
  using namespace bagua;
  collective_bindings::bind<Cuda>(m, "nccl",
                                  "Bagua's NCCL engine: collectives on CUDA device buffers.");

  m.def(
      "unique_id",
      [] {
        const std::string id = nccl_unique_id();
        return nb::bytes(id.data(), id.size());
      },
      "A fresh NCCL unique id (bytes) for rank 0 to share with the other ranks.");

  // Creating and splitting wait for every rank: the GIL is released so that
  // ranks may be threads of one process.
  m.def(
      "create",
      [](nb::bytes unique_id, int rank, int size, const std::string& name, double timeout_seconds,
         int device) {
        const std::string id(unique_id.c_str(), unique_id.size());
        std::shared_ptr<Communicator> comm;
        {
          nb::gil_scoped_release release;
          comm = nccl_create(id, rank, size, name, timeout_seconds, device);
        }
        return CommunicatorRegistry::instance().add(std::move(comm));
      },
      nb::arg("unique_id"), nb::arg("rank"), nb::arg("size"), nb::arg("name"),
      nb::arg("timeout_seconds"), nb::arg("device") = -1,
      "This process's rank of an NCCL communicator over `unique_id`, on CUDA device `device` "
      "(-1: the current one); returns its handle.");

  m.def(
      "split",
      [](int64_t parent, int color, int key, const std::string& name) {
        auto comm = collective_bindings::lookup(parent);
        std::shared_ptr<Communicator> child;
        {
          nb::gil_scoped_release release;
          child = nccl_split(*comm, color, key, name);
        }
        return CommunicatorRegistry::instance().add(std::move(child));
      },
      nb::arg("parent"), nb::arg("color"), nb::arg("key"), nb::arg("name"),
      "Split a communicator: ranks with the same color (>= 0) form one, ordered by key.");

  m.def(
      "shrink",
      [](int64_t parent, const std::vector<int>& excluded, const std::string& name) {
        auto comm = collective_bindings::lookup(parent);
        std::shared_ptr<Communicator> shrunk;
        {
          nb::gil_scoped_release release;
          shrunk = nccl_shrink(*comm, excluded, name);
        }
        return CommunicatorRegistry::instance().add(std::move(shrunk));
      },
      nb::arg("parent"), nb::arg("excluded"), nb::arg("name"),
      "The parent's ranks but `excluded` (ncclCommShrink, NCCL 2.27); only the survivors call it.");

  m.def(
      "finalize",
      [] {
        nb::gil_scoped_release release;
        CommunicatorRegistry::instance().clear();
      },
      "Destroy every communicator (called at exit).");
}
