#include "mpi_runtime.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <stdexcept>
#include <vector>

#include "host_reduce.h"

namespace bagua {
namespace {

std::atomic<bool> any_broken{false};
bool initialized_here = false;
std::mutex serialize;  // taken around MPI calls when MPI lacks MPI_THREAD_MULTIPLE
bool multiple = false;

// The bound on a send's tries while a communicator is built: seconds of polls on a loaded machine.
constexpr int kPatientSendRetries = 100000;
std::mutex patience;               // guards the three below
int patient_builds = 0;            // PatientSends alive
int impatient_send_retries = 0;    // the bound before the first of them
bool raised = false;               // whether the first of them raised it
constexpr int kConnectTag = 4243;  // connect_every_pair's messages

// MPIR_CVAR_CH4_OFI_MAX_EAGAIN_RETRY through MPI's tool interface; null where the MPI has none.
MPI_T_cvar_handle send_retries_handle() {
  static const MPI_T_cvar_handle handle = [] {
    MPI_T_cvar_handle made = MPI_T_CVAR_HANDLE_NULL;
    int provided = 0, index = 0, count = 0;
    if (MPI_T_init_thread(MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS ||
        MPI_T_cvar_get_index("MPIR_CVAR_CH4_OFI_MAX_EAGAIN_RETRY", &index) != MPI_SUCCESS ||
        MPI_T_cvar_handle_alloc(index, nullptr, &made, &count) != MPI_SUCCESS)
      return MPI_T_CVAR_HANDLE_NULL;
    return made;
  }();
  return handle;
}

// MPI has no 16-bit float types: they travel as 2-byte opaque elements with
// user-defined reductions computed in float32.
MPI_Datatype half_type, bfloat16_type;
MPI_Op half_ops[3], bfloat16_ops[3];  // sum, min, max

template <typename T, ReduceOp kOp>
void reduce16(void* in, void* inout, int* len, MPI_Datatype*) {
  reduce_into<T>(in, inout, *len, kOp);
}

}  // namespace

// Memory an abandoned MPI operation may still write into (a live peer's message arriving late): it
// is never freed.
void keep_forever(std::unique_ptr<char[]> memory) {
  static std::mutex guard;
  static std::vector<std::unique_ptr<char[]>>* kept = new std::vector<std::unique_ptr<char[]>>;
  if (!memory) return;
  std::lock_guard<std::mutex> lock(guard);
  kept->push_back(std::move(memory));
}

std::unique_lock<std::mutex> lock_mpi() {
  std::unique_lock<std::mutex> lock(serialize, std::defer_lock);
  if (!multiple) lock.lock();
  return lock;
}

bool thread_multiple() { return multiple; }

void forbid_finalize() { any_broken = true; }

PatientSends::PatientSends() {
  std::lock_guard<std::mutex> lock(patience);
  if (patient_builds++ > 0) return;
  const MPI_T_cvar_handle handle = send_retries_handle();
  if (handle == MPI_T_CVAR_HANDLE_NULL) return;
  MPI_T_cvar_read(handle, &impatient_send_retries);
  raised = impatient_send_retries > 0 && impatient_send_retries < kPatientSendRetries;
  if (raised) {
    int patient = kPatientSendRetries;
    MPI_T_cvar_write(handle, &patient);
  }
}

PatientSends::~PatientSends() {
  std::lock_guard<std::mutex> lock(patience);
  if (--patient_builds > 0) return;
  if (raised) MPI_T_cvar_write(send_retries_handle(), &impatient_send_retries);
}

int connect_every_pair(MPI_Comm comm) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  std::vector<MPI_Request> requests;
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    requests.resize(requests.size() + 2);
    int rc = MPI_Irecv(nullptr, 0, MPI_BYTE, peer, kConnectTag, comm, &requests.end()[-2]);
    if (rc == MPI_SUCCESS)
      rc = MPI_Isend(nullptr, 0, MPI_BYTE, peer, kConnectTag, comm, &requests.end()[-1]);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE);
}

void ensure_initialized() {
  static std::once_flag once;
  std::call_once(once, [] {
    int ready = 0;
    MPI_Initialized(&ready);
    int provided = MPI_THREAD_SINGLE;
    if (!ready) {
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      initialized_here = true;
    } else {
      MPI_Query_thread(&provided);
    }
    multiple = provided == MPI_THREAD_MULTIPLE;
    MPI_Type_contiguous(2, MPI_BYTE, &half_type);
    MPI_Type_commit(&half_type);
    MPI_Type_contiguous(2, MPI_BYTE, &bfloat16_type);
    MPI_Type_commit(&bfloat16_type);
    MPI_Op_create(&reduce16<Half, ReduceOp::kSum>, 1, &half_ops[0]);
    MPI_Op_create(&reduce16<Half, ReduceOp::kMin>, 1, &half_ops[1]);
    MPI_Op_create(&reduce16<Half, ReduceOp::kMax>, 1, &half_ops[2]);
    MPI_Op_create(&reduce16<BFloat16, ReduceOp::kSum>, 1, &bfloat16_ops[0]);
    MPI_Op_create(&reduce16<BFloat16, ReduceOp::kMin>, 1, &bfloat16_ops[1]);
    MPI_Op_create(&reduce16<BFloat16, ReduceOp::kMax>, 1, &bfloat16_ops[2]);
  });
}

MPI_Datatype mpi_type(DType t) {
#define BAGUA_DTYPE_TO_MPI(enumerator, name, bits, dlpack, xla, nccl, mpi, ...) \
  if (t == DType::enumerator) return mpi;
  BAGUA_DTYPES(BAGUA_DTYPE_TO_MPI)
  return MPI_DATATYPE_NULL;
}

// Averages are sums divided by the rank count afterwards.
MPI_Op mpi_op(DType t, ReduceOp op) {
  const int index = op == ReduceOp::kMin ? 1 : op == ReduceOp::kMax ? 2 : 0;
  if (t == DType::kF16) return half_ops[index];
  if (t == DType::kBF16) return bfloat16_ops[index];
  return index == 1 ? MPI_MIN : index == 2 ? MPI_MAX : MPI_SUM;
}

std::string mpi_error(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(text, length);
}

// Whether the ranks of `comm` span more than one node (MPI's view: shared memory).
bool ranks_span_nodes(MPI_Comm comm, int size) {
  MPI_Comm node;
  if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) != MPI_SUCCESS)
    return false;
  int node_size = size;
  MPI_Comm_size(node, &node_size);
  MPI_Comm_free(&node);
  return node_size < size;
}

// Allreduces of at least this many bytes between nodes take the ring, unless
// BAGUA_MPI_RING_MIN_BYTES or set_mpi_ring_min_bytes says otherwise.
constexpr int64_t kDefaultRingMinBytes = 1 << 20;

void check_ring_min_bytes(int64_t bytes) {
  if (bytes < 0)
    throw std::invalid_argument("the MPI ring threshold must be >= 0 bytes, got " +
                                std::to_string(bytes));
}

int64_t ring_min_bytes_from_environment() {
  const char* text = std::getenv("BAGUA_MPI_RING_MIN_BYTES");
  if (text == nullptr || *text == '\0') return kDefaultRingMinBytes;
  char* end = nullptr;
  errno = 0;
  const long long bytes = std::strtoll(text, &end, 10);
  if (*end != '\0' || errno == ERANGE || bytes < 0 ||
      !std::isdigit(static_cast<unsigned char>(*text)))
    throw std::invalid_argument(
        std::string("BAGUA_MPI_RING_MIN_BYTES must be a whole number of bytes >= 0, got '") + text +
        "'");
  return bytes;
}

void mpi_finalize() {
  int ready = 0, finalized = 0;
  MPI_Initialized(&ready);
  MPI_Finalized(&finalized);
  if (ready && !finalized && initialized_here && !any_broken) MPI_Finalize();
}

}  // namespace bagua
