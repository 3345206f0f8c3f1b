// How a test scripts the fake NCCL (nccl.h here) and reads back what the
// engine did with it.
#pragma once

#include <string>
#include <vector>

#include "nccl.h"

namespace fake_nccl {

inline constexpr int kForever = -1;

// What the next calls return. `*_polls` is how many ncclCommGetAsyncError
// polls report ncclInProgress after a call returned ncclInProgress (kForever:
// it never completes).
struct Script {
  ncclResult_t init_result = ncclSuccess;
  int init_polls = 0;
  ncclResult_t call_result = ncclSuccess;  // every collective, send and receive
  int call_polls = 0;
  bool hold_collectives = false;  // their stream work completes only on abort
  int split_polls = 2;            // a split always returns ncclInProgress
  int split_rank = 0, split_size = 1;
  // > 0: the child is handed out this long after the call, from another thread,
  // whatever the parent reports (NCCL 2.28 does so after the parent is done).
  int split_child_after_ms = 0;
};

// A communicator as the test sees it.
struct CommState {
  int rank = 0, size = 0;
  std::string unique_id;
  bool aborted = false, finalized = false, destroyed = false;
  int calls = 0;  // collectives, sends and receives
  ncclDataType_t last_type = ncclInt8;
  ncclRedOp_t last_op = ncclProd;
  size_t last_count = 0;
  ncclComm_t child = nullptr;  // the last ncclCommSplit's or ncclCommShrink's
  bool revoked = false;
  std::vector<int> excluded;  // the last ncclCommShrink's list
  int shrink_flags = -1;      // and its flags
};

void set_script(const Script& script);
// Makes the communicator report `error` from ncclCommGetAsyncError.
void set_async_error(ncclComm_t comm, ncclResult_t error);
// Every communicator created since the last reset, in order.
std::vector<ncclComm_t> comms();
CommState state(ncclComm_t comm);
// Forgets every communicator and restores the default script.
void reset();

}  // namespace fake_nccl
