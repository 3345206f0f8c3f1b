// The NCCL engine's host logic (xla_ffi/nccl_communicator.cc) against the fake
// NCCL: type and operation mapping, the watchdog's timeout and abort, errors on
// every later or waiting call, asynchronous errors, creation and split
// timeouts (with the abort of a half-made child), and the unique id reaching
// every rank intact. Built with ThreadSanitizer: the watchdog is a thread.
//
// Prints "N passed, M failed"; exits non-zero on any failure.
#include <chrono>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fake_nccl.h"
#include "nccl_communicator.h"
#include "tally.h"

namespace {

using bagua::Communicator;
using bagua::DType;
using bagua::ReduceOp;
using bagua::Status;
using Clock = std::chrono::steady_clock;
using fake_nccl::kForever;

using tally::expect;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Polls `done` for up to `limit` seconds; returns whether it became true.
bool eventually(const std::function<bool()>& done, double limit = 10.0) {
  const auto start = Clock::now();
  while (!done()) {
    if (seconds_since(start) > limit) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

std::shared_ptr<Communicator> create(double timeout, int rank = 0, int size = 1) {
  return bagua::nccl_create(bagua::nccl_unique_id(), rank, size, "world", timeout, 0);
}

// The message of the exception `f` throws, or "" if it returns.
template <typename Exception, typename F>
std::string thrown(F&& f) {
  try {
    f();
  } catch (const Exception& e) {
    return e.what();
  }
  return "";
}

void collectives_map_types_and_complete() {
  fake_nccl::reset();
  auto comm = create(1.0);
  ncclComm_t fake = fake_nccl::comms().at(0);
  float buffer[8] = {};
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  const struct {
    DType type;
    ReduceOp op;
    ncclDataType_t nccl_type;
    ncclRedOp_t nccl_op;
  } cases[] = {
      {DType::kBF16, ReduceOp::kAvg, ncclBfloat16, ncclAvg},
      {DType::kF16, ReduceOp::kMax, ncclFloat16, ncclMax},
      {DType::kF64, ReduceOp::kSum, ncclFloat64, ncclSum},
      {DType::kI64, ReduceOp::kMin, ncclInt64, ncclMin},
      {DType::kU8, ReduceOp::kSum, ncclUint8, ncclSum},
      {DType::kI32, ReduceOp::kMax, ncclInt32, ncclMax},
  };
  for (const auto& c : cases) {
    const Status s = comm->allreduce(buffer, buffer, 3, c.type, c.op, stream);
    const fake_nccl::CommState st = fake_nccl::state(fake);
    expect(s.ok() && st.last_type == c.nccl_type && st.last_op == c.nccl_op && st.last_count == 3,
           "allreduce maps type " + std::to_string(static_cast<int>(c.type)) + " and op " +
               bagua::reduce_op_name(c.op));
  }
  const Status avg_int = comm->allreduce(buffer, buffer, 3, DType::kI32, ReduceOp::kAvg, stream);
  expect(!avg_int.ok() && !avg_int.internal && contains(avg_int.message, "avg needs a float type"),
         "avg on integers is the caller's error: " + avg_int.message);
  const Status root = comm->broadcast(buffer, 3, DType::kF32, 1, stream);
  expect(!root.ok() && contains(root.message, "root 1 is not a rank of 1"),
         "a broadcast root outside the communicator is rejected: " + root.message);
  expect(comm->barrier(stream).ok() && cuda_shim::pending_on(stream) == 0,
         "a barrier completes on its stream");
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // a few watchdog rounds
  expect(!fake_nccl::state(fake).aborted, "a healthy communicator is not aborted");
  comm.reset();
  const fake_nccl::CommState st = fake_nccl::state(fake);
  expect(st.finalized && st.destroyed && !st.aborted, "destruction finalizes and destroys");
  cudaStreamDestroy(stream);
}

void watchdog_timeout_aborts_and_every_later_call_fails() {
  fake_nccl::reset();
  fake_nccl::Script script;
  script.hold_collectives = true;  // the peer never arrives
  fake_nccl::set_script(script);
  auto comm = create(0.2);
  ncclComm_t fake = fake_nccl::comms().at(0);
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  float buffer[4] = {};
  const auto start = Clock::now();
  expect(comm->allreduce(buffer, buffer, 4, DType::kF32, ReduceOp::kSum, stream).ok(),
         "a collective is enqueued without waiting for it");
  const bool aborted = eventually([&] { return fake_nccl::state(fake).aborted; });
  const double elapsed = seconds_since(start);
  expect(aborted && elapsed >= 0.2 && elapsed < 5.0,
         "the watchdog aborts after the timeout (" + std::to_string(elapsed) + " s)");
  expect(cuda_shim::pending_on(stream) == 0, "the abort releases the stream");
  const std::vector<std::pair<const char*, std::function<Status()>>> calls = {
      {"allreduce",
       [&] { return comm->allreduce(buffer, buffer, 4, DType::kF32, ReduceOp::kSum, stream); }},
      {"broadcast", [&] { return comm->broadcast(buffer, 4, DType::kF32, 0, stream); }},
      {"barrier", [&] { return comm->barrier(stream); }},
      {"send", [&] { return comm->send(buffer, 4, DType::kF32, 0, stream); }},
  };
  for (const auto& [name, call] : calls) {
    const Status s = call();
    expect(!s.ok() && s.internal && contains(s.message, "aborted after an earlier failure") &&
               contains(s.message, "allreduce") &&
               contains(s.message, "did not complete within 0.2 s"),
           std::string(name) + " after the abort fails with the reason: " + s.message);
  }
  const std::string split =
      thrown<std::runtime_error>([&] { bagua::nccl_split(*comm, 0, 0, "x"); });
  expect(contains(split, "aborted after an earlier failure"),
         "a split after the abort fails: " + split);
  comm.reset();
  expect(!fake_nccl::state(fake).destroyed, "an aborted communicator is not destroyed again");
  cudaStreamDestroy(stream);
}

void callers_waiting_on_a_stuck_enqueue_all_fail() {
  fake_nccl::reset();
  auto comm = create(0.2);
  ncclComm_t fake = fake_nccl::comms().at(0);
  fake_nccl::Script script;
  script.call_result = ncclInProgress;  // the enqueue itself never completes
  script.call_polls = kForever;
  fake_nccl::set_script(script);
  constexpr int kCallers = 4;
  std::vector<Status> results(kCallers);
  std::vector<std::thread> callers;
  float buffers[kCallers][4] = {};
  const auto start = Clock::now();
  for (int i = 0; i < kCallers; ++i)
    callers.emplace_back([&, i] {
      results[i] = comm->allreduce(buffers[i], buffers[i], 4, DType::kF32, ReduceOp::kSum, nullptr);
    });
  for (std::thread& t : callers) t.join();
  const double elapsed = seconds_since(start);
  int stuck = 0, refused = 0;
  for (const Status& s : results) {
    // The waiting callers' messages repeat the first one's reason after this.
    const bool after_abort = contains(s.message, "aborted after an earlier failure");
    stuck += !s.ok() && !after_abort && contains(s.message, "could not be enqueued within 0.2 s");
    refused += !s.ok() && after_abort;
  }
  expect(stuck == 1 && refused == kCallers - 1 && fake_nccl::state(fake).aborted && elapsed < 5.0,
         "one caller times out and aborts, the waiting ones fail (" + std::to_string(stuck) +
             " / " + std::to_string(refused) + ", " + std::to_string(elapsed) + " s)");
}

void asynchronous_error_aborts() {
  fake_nccl::reset();
  auto comm = create(30.0);  // far beyond the test: only the async error can abort
  ncclComm_t fake = fake_nccl::comms().at(0);
  const auto start = Clock::now();
  fake_nccl::set_async_error(fake, ncclRemoteError);
  const bool aborted = eventually([&] { return fake_nccl::state(fake).aborted; });
  expect(aborted && seconds_since(start) < 5.0, "an asynchronous error aborts the communicator");
  float buffer[2] = {};
  const Status s = comm->allreduce(buffer, buffer, 2, DType::kF32, ReduceOp::kSum, nullptr);
  expect(!s.ok() && contains(s.message, "asynchronous NCCL error") &&
             contains(s.message, "remote process exited"),
         "the next call reports the asynchronous error: " + s.message);
}

void creation_waits_then_times_out() {
  fake_nccl::reset();
  fake_nccl::Script script;
  script.init_result = ncclInProgress;
  script.init_polls = 5;
  fake_nccl::set_script(script);
  expect(create(1.0)->size() == 1, "creation waits for a non-blocking init to finish");
  fake_nccl::reset();
  script.init_polls = kForever;
  fake_nccl::set_script(script);
  const auto start = Clock::now();
  const std::string error = thrown<std::runtime_error>([] { create(0.2); });
  const double elapsed = seconds_since(start);
  expect(contains(error, "did not complete within 0.2 s") && elapsed >= 0.2 && elapsed < 5.0 &&
             fake_nccl::state(fake_nccl::comms().at(0)).aborted,
         "a creation that never finishes times out and aborts: " + error);
  const std::string bad =
      thrown<std::invalid_argument>([] { bagua::nccl_create("short", 0, 1, "world", 1.0, 0); });
  expect(contains(bad, "must be the 128 bytes"),
         "a unique id of the wrong size is rejected: " + bad);
  const std::string rank = thrown<std::invalid_argument>([] { create(1.0, 2, 2); });
  expect(contains(rank, "out of range"), "a rank outside the size is rejected: " + rank);
}

void unique_id_reaches_every_rank() {
  fake_nccl::reset();
  const std::string id = bagua::nccl_unique_id();
  expect(id.size() == NCCL_UNIQUE_ID_BYTES && id.find('\0') != std::string::npos,
         "the unique id is 128 raw bytes, zeros included");
  constexpr int kRanks = 4;
  std::vector<std::shared_ptr<Communicator>> ranks(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r)
    threads.emplace_back([&, r] { ranks[r] = bagua::nccl_create(id, r, kRanks, "world", 1.0, 0); });
  for (std::thread& t : threads) t.join();
  int intact = 0, rank_sum = 0;
  for (ncclComm_t c : fake_nccl::comms()) {
    const fake_nccl::CommState st = fake_nccl::state(c);
    intact += st.unique_id == id && st.size == kRanks;
    rank_sum += st.rank;
  }
  expect(intact == kRanks && rank_sum == 0 + 1 + 2 + 3,
         "every rank's init gets the same id bytes and its own rank");
}

void split_hands_out_the_child_or_aborts_both() {
  fake_nccl::reset();
  auto parent = create(0.3);
  ncclComm_t fake_parent = fake_nccl::comms().at(0);
  fake_nccl::Script script;
  script.split_polls = 3;
  script.split_rank = 1;
  script.split_size = 2;
  fake_nccl::set_script(script);
  auto child = bagua::nccl_split(*parent, 0, 1, "half");
  float buffer[2] = {};
  expect(child->rank() == 1 && child->size() == 2 && child->name() == "half" &&
             child->allreduce(buffer, buffer, 2, DType::kF32, ReduceOp::kSum, nullptr).ok(),
         "a split that completes hands out a working child");
  script.split_polls = 0;
  script.split_child_after_ms = 50;
  fake_nccl::set_script(script);
  auto late = bagua::nccl_split(*parent, 0, 1, "late");
  expect(late->rank() == 1 &&
             late->allreduce(buffer, buffer, 2, DType::kF32, ReduceOp::kSum, nullptr).ok(),
         "a child handed out after the parent reports the split done is waited for");
  script.split_child_after_ms = 0;
  const std::string color =
      thrown<std::invalid_argument>([&] { bagua::nccl_split(*parent, -1, 0, "x"); });
  expect(contains(color, "color must be >= 0"), "a negative color is rejected: " + color);
  script.split_polls = kForever;
  fake_nccl::set_script(script);
  const auto start = Clock::now();
  const std::string error =
      thrown<std::runtime_error>([&] { bagua::nccl_split(*parent, 0, 0, "stuck"); });
  const fake_nccl::CommState st = fake_nccl::state(fake_parent);
  expect(contains(error, "did not complete within 0.3 s") && seconds_since(start) < 5.0 &&
             st.aborted && st.child && fake_nccl::state(st.child).aborted,
         "a split that never completes aborts the parent and the half-made child: " + error);
}

void revoke_stops_the_operation_in_flight_and_shrink_renumbers() {
  fake_nccl::reset();
  fake_nccl::Script script;
  script.hold_collectives = true;  // a peer died: the collective never completes
  fake_nccl::set_script(script);
  auto comm = create(30.0, 2, 4);  // far beyond the test: only the revoke can stop it
  ncclComm_t fake = fake_nccl::comms().at(0);
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  float buffer[4] = {};
  expect(comm->allreduce(buffer, buffer, 4, DType::kF32, ReduceOp::kSum, stream).ok(),
         "a collective is enqueued");
  const auto start = Clock::now();
  comm->revoke("rank 1 left the job");
  const bool released = eventually([&] { return cuda_shim::pending_on(stream) == 0; });
  const double elapsed = seconds_since(start);
  expect(
      released && elapsed < 1.0 && fake_nccl::state(fake).revoked &&
          !fake_nccl::state(fake).aborted,
      "a revoke releases the stream at once, without an abort (" + std::to_string(elapsed) + " s)");
  const Status later = comm->allreduce(buffer, buffer, 4, DType::kF32, ReduceOp::kSum, stream);
  expect(!later.ok() && contains(later.message, "revoked: rank 1 left the job"),
         "every later call fails naming the reason: " + later.message);
  fake_nccl::set_script(fake_nccl::Script{});
  auto shrunk = bagua::nccl_shrink(*comm, {1}, "survivors");
  const fake_nccl::CommState st = fake_nccl::state(fake);
  expect(shrunk->rank() == 1 && shrunk->size() == 3 && st.excluded == std::vector<int>{1} &&
             st.shrink_flags == NCCL_SHRINK_DEFAULT &&
             shrunk->allreduce(buffer, buffer, 4, DType::kF32, ReduceOp::kSum, stream).ok(),
         "the survivors' communicator renumbers the ranks and works; a revoked parent shrinks "
         "without another abort");
  const std::string self =
      thrown<std::invalid_argument>([&] { bagua::nccl_shrink(*comm, {2}, "x"); });
  expect(contains(self, "cannot exclude rank 2"), "a rank cannot exclude itself: " + self);
  auto live = create(30.0, 0, 2);
  ncclComm_t fake_live = fake_nccl::comms().back();
  bagua::nccl_shrink(*live, {1}, "alone");
  expect(fake_nccl::state(fake_live).shrink_flags == NCCL_SHRINK_ABORT,
         "a communicator that was not revoked first stops its operations in the shrink");
  comm.reset();
  expect(fake_nccl::state(fake).destroyed && !fake_nccl::state(fake).finalized,
         "a revoked communicator is destroyed without ncclCommFinalize (invalid after a revoke)");
  shrunk.reset();  // its watchdog looks at events on the stream until then
  live.reset();
  cudaStreamDestroy(stream);
}

}  // namespace

int main() {
  collectives_map_types_and_complete();
  watchdog_timeout_aborts_and_every_later_call_fails();
  callers_waiting_on_a_stuck_enqueue_all_fail();
  asynchronous_error_aborts();
  creation_waits_then_times_out();
  unique_id_reaches_every_rank();
  split_hands_out_the_child_or_aborts_both();
  revoke_stops_the_operation_in_flight_and_shrink_renumbers();
  return tally::summary();
}
