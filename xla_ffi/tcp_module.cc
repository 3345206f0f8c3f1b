// The Python extension `_bagua_tcp`: the TCP engine's communicators, its FFI collectives for the
// CPU platform, and the same collectives on DLPack tensors.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "collective_bindings.h"
#include "tcp_communicator.h"

NB_MODULE(_bagua_tcp, m) {
  using namespace bagua;
  collective_bindings::bind<Cpu>(m, "tcp", "Bagua's TCP engine: collectives on host buffers.");

  m.def(
      "listen", &tcp_listen, nb::arg("host"),
      "Open this process's listening socket on `host` (an IPv4 address or name) once; returns its "
      "\"address:port\".");

  // Building waits for the other ranks: without the GIL.
  m.def(
      "build",
      [](const std::string& token, int rank, const std::vector<std::string>& addresses,
         const std::string& name, double timeout_seconds) {
        std::shared_ptr<Communicator> built;
        {
          nb::gil_scoped_release release;
          built = tcp_build(token, rank, addresses, name, timeout_seconds);
        }
        return CommunicatorRegistry::instance().add(std::move(built));
      },
      nb::arg("token"), nb::arg("rank"), nb::arg("addresses"), nb::arg("name"),
      nb::arg("timeout_seconds"),
      "A communicator of the ranks listening at `addresses`, this process being `rank`; every "
      "rank passes the same `token`, unique to the build. Returns its handle.");

  m.def("abandon", &tcp_abandon, nb::arg("token"),
        "Make this process's build of `token` fail at once, whether it is in progress or to come "
        "(the members it was for changed).");

  // Shrinking and splitting wait for other processes.
  collective_bindings::def_derived<const std::vector<int>&, const std::string&>(
      m, "shrink", &tcp_shrink,
      "A communicator of the parent's ranks `members` (member i becomes rank i), on connections of "
      "its own; only the members call it.",
      "members", "name");
  collective_bindings::def_derived<int, int, const std::string&>(
      m, "split", &tcp_split,
      "Split a communicator: ranks with the same color form one, ordered by key.", "color", "key",
      "name");

  m.def(
      "addresses", [](int64_t h) { return tcp_addresses(*collective_bindings::lookup(h)); },
      nb::arg("handle"), "The ranks' addresses the communicator was built with.");
  m.def(
      "timeout", [](int64_t h) { return tcp_timeout(*collective_bindings::lookup(h)); },
      nb::arg("handle"), "The seconds the communicator's operations wait at most.");

  m.def(
      "set_average_divisor",
      [](int64_t h, int ranks) { set_tcp_average_divisor(*collective_bindings::lookup(h), ranks); },
      nb::arg("handle"), nb::arg("ranks"),
      "Set the ranks that averages divide by (1..size; 0: the size) for the collectives "
      "started after it; every rank must set the same value between the same two collectives.");

  m.def(
      "finalize", [] { CommunicatorRegistry::instance().clear(); },
      "Destroy every communicator (called at exit).");
}
