// The TCP engine: collectives on host buffers over one TCP connection per pair of ranks, without
// MPI. It serves a membership that changes (a fault-tolerant JAX job): every communicator is built
// on connections of its own, a peer that dies closes them and fails the operation in flight at
// once, and an operation writes into the caller's buffers only while it runs, so an abandoned one
// leaves nothing pending. MPICH's ch4 device aborts the process instead when a connection to a dead
// peer breaks with a message in flight (docs/guides/fault_tolerance.md).
//
// Every message travels behind a header naming its operation and size, so ranks that call
// different collectives fail with an error saying so instead of reading each other's bytes.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "communicator.h"

namespace bagua {

// This process's listening socket on `host` (an IPv4 address or a name of one), opened by the
// first call; every call returns its "address:port".
std::string tcp_listen(const std::string& host);

// A communicator of `addresses.size()` ranks, this process being `rank`, rank j listening at
// addresses[j] (tcp_listen's). Every rank calls it with the same `token`, unique to this build and
// known only to the job's processes: it introduces each connection, and a connection without it is
// closed. Rank r connects to the ranks below it and accepts the ranks above; fails, naming the
// rank, rather than wait past `timeout_seconds`, and at once when a rank's address refuses or the
// build is abandoned (tcp_abandon).
std::shared_ptr<Communicator> tcp_build(const std::string& token, int rank,
                                        const std::vector<std::string>& addresses,
                                        const std::string& name, double timeout_seconds);

// Makes this process's tcp_build of `token`, in progress or to come, fail at once: the members it
// was for changed meanwhile (a rank died before connecting, say).
void tcp_abandon(const std::string& token);

// Communicators of some of `parent`'s ranks, on connections of their own; the parent stays as it
// was, and revoking it abandons their builds. The ranks `members` (member i becomes rank i): only
// the members call it, each with the same list, so the survivors of a membership change can,
// whatever became of the others.
std::shared_ptr<Communicator> tcp_shrink(Communicator& parent, const std::vector<int>& members,
                                         const std::string& name);
// The ranks with the same `color`, ordered by `key` then rank: every rank calls it.
std::shared_ptr<Communicator> tcp_split(Communicator& parent, int color, int key,
                                        const std::string& name);

// The addresses a TCP communicator was built with: what admitting newcomers into a communicator
// of its ranks and theirs needs.
const std::vector<std::string>& tcp_addresses(const Communicator& comm);
// The seconds a TCP communicator's operations wait at most: what a communicator built to replace it
// takes.
double tcp_timeout(const Communicator& comm);

// The number of ranks that "avg" reductions divide by, for collectives started after it: `ranks`
// (1..size), or the size for 0 (as the MPI engine's set_mpi_average_divisor).
void set_tcp_average_divisor(Communicator& comm, int ranks);

}  // namespace bagua
