// Runs every CUDA kernel of xla_ffi/kernels_cuda.cu under the CPU execution
// shim and compares it with the CPU kernels built from the same tree: bytes
// identical except the sign scale (and the residuals that use it), which may
// differ in its last bits because the GPU sums |x| in another order (SPEC 2).
//
// Usage: kernel_suite [--quick]. Prints one line per failing case and a
// summary "N passed, M failed"; exits non-zero on any failure.
// kernel_suite --dump DIR instead writes the CUDA kernels' inputs and outputs
// for a few cases to DIR (listed in DIR/cases.txt), which
// tests/test_cuda_shim.py compares with tests/kernels_reference.py.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "cuda_runtime.h"
#include "kernels.h"
#include "layout.h"
#include "tally.h"

namespace bagua::kernels::generic {
BAGUA_DECLARE_KERNELS(Cpu)
}

namespace {

using bagua::BFloat16;
using bagua::Cpu;
using bagua::Cuda;
using bagua::Format;
using bagua::Half;
using bagua::Status;
namespace cpu = bagua::kernels::generic;
namespace gpu = bagua::kernels;

constexpr double kSignScaleRtol = 2e-6;  // as tests/test_kernels_gpu.py allows on a GPU

// An allocation of exactly `count` elements that starts `offset` elements past
// a 16-byte boundary and ends where the allocation ends, so that AddressSanitizer
// sees any read or write past either end.
template <typename T>
class Buffer {
 public:
  Buffer(int64_t count, int64_t offset) : count_(count), offset_(offset) {
    const std::size_t bytes = sizeof(T) * (count + offset);
    raw_ = static_cast<T*>(std::malloc(bytes > 0 ? bytes : 1));  // malloc(0) may return null
  }
  ~Buffer() { std::free(raw_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  T* data() { return raw_ + offset_; }
  const T* data() const { return raw_ + offset_; }
  int64_t size() const { return count_; }
  T& operator[](int64_t i) { return data()[i]; }
  const T& operator[](int64_t i) const { return data()[i]; }
  void fill_bytes(uint8_t value) { std::memset(data(), value, sizeof(T) * count_); }

 private:
  T* raw_;
  int64_t count_;
  int64_t offset_;
};

void report(const std::string& name, const std::string& problem) {
  tally::fail(name + ": " + problem);
}

void check_status(const std::string& name, const char* who, const Status& s, bool& ok) {
  if (s.ok()) return;
  report(name, std::string(who) + " returned: " + s.message);
  ok = false;
}

template <typename T>
bool same_bytes(const std::string& name, const char* what, const Buffer<T>& a, const Buffer<T>& b) {
  const auto* pa = reinterpret_cast<const uint8_t*>(a.data());
  const auto* pb = reinterpret_cast<const uint8_t*>(b.data());
  for (int64_t i = 0; i < a.size() * int64_t{sizeof(T)}; ++i) {
    if (pa[i] != pb[i]) {
      report(name, std::string(what) + ": first differing byte " + std::to_string(i) + " of " +
                       std::to_string(a.size() * sizeof(T)));
      return false;
    }
  }
  return true;
}

// Gradient-like values; with an amplitude, uniform in [-amplitude, amplitude]
// instead (subnormal, tiny or near the float32 limit: SPEC section 2's edges);
// with a negative one, in [0, -amplitude) with a third of them -0 or +0 (groups
// whose least value is zero of both signs: lo is -0 on every device).
template <typename T>
void random_fill(Buffer<T>& b, std::mt19937& rng, float amplitude = 0.0f) {
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  for (int64_t i = 0; i < b.size(); ++i) {
    float v = normal(rng);
    if (amplitude > 0.0f) v = static_cast<float>(uniform(rng) * amplitude);
    if (amplitude < 0.0f) {
      const double u = uniform(rng);
      v = std::fabs(u) < 1.0 / 3 ? (u < 0 ? -0.0f : 0.0f)
                                 : static_cast<float>(std::fabs(u) * -amplitude);
    }
    b[i] = bagua::from_float<T>(v);
  }
}

// A device as the test wants it: grids from SMs x blocks per SM, compress
// batches from the L2 size.
struct DeviceShape {
  const char* name;
  cuda_shim::Device device;
};

const DeviceShape kShapes[] = {
    {"tiny-grid", {1, 1 << 20, 1, 2, false}},     // one block: every loop strides over all tiles
    {"huge-grid", {132, 50 << 20, 16, 2, true}},  // more blocks than tiles, reverse fibers
    {"small-l2", {4, 4096, 2, 2, false}},         // sign feedback: a batch per chunk
    {"odd-grid", {3, 3 << 20, 3, 2, true}},       // 9 blocks: tiles shared unevenly
};
constexpr int kShapeCount = sizeof(kShapes) / sizeof(kShapes[0]);

template <typename T>
const char* dtype_name() {
  if constexpr (std::is_same_v<T, float>)
    return "f32";
  else if constexpr (std::is_same_v<T, Half>)
    return "f16";
  else
    return "bf16";
}

constexpr Format kFormats[] = {Format::kMinMaxUInt8, Format::kMinMaxUInt4, Format::kSign};

// The codec kernels of `format`, on the CPU or (gpu) the CUDA kernels under the shim.
template <typename T>
Status compress(bool gpu, Format format, const T* x, const float* residual, int64_t n, int64_t k,
                uint8_t* out, float* residual_out) {
  const Cuda cuda{nullptr};
  switch (format) {
    case Format::kMinMaxUInt8:
      return gpu ? gpu::minmax_compress(cuda, x, residual, n, k, out, residual_out)
                 : cpu::minmax_compress(Cpu{}, x, residual, n, k, out, residual_out);
    case Format::kMinMaxUInt4:
      return gpu ? gpu::minmax_uint4_compress(cuda, x, residual, n, k, out, residual_out)
                 : cpu::minmax_uint4_compress(Cpu{}, x, residual, n, k, out, residual_out);
    default:
      return gpu ? gpu::sign_compress(cuda, x, residual, n, k, out, residual_out)
                 : cpu::sign_compress(Cpu{}, x, residual, n, k, out, residual_out);
  }
}

template <typename T>
Status decompress(bool gpu, Format format, const uint8_t* in, int64_t n, int64_t k, T* out) {
  const Cuda cuda{nullptr};
  switch (format) {
    case Format::kMinMaxUInt8:
      return gpu ? gpu::minmax_decompress(cuda, in, n, k, out)
                 : cpu::minmax_decompress(Cpu{}, in, n, k, out);
    case Format::kMinMaxUInt4:
      return gpu ? gpu::minmax_uint4_decompress(cuda, in, n, k, out)
                 : cpu::minmax_uint4_decompress(Cpu{}, in, n, k, out);
    default:
      return gpu ? gpu::sign_decompress(cuda, in, n, k, out)
                 : cpu::sign_decompress(Cpu{}, in, n, k, out);
  }
}

template <typename T>
Status decompress_reduce(bool gpu, Format format, const uint8_t* in, int64_t m, int64_t k,
                         bool average, T* out) {
  const Cuda cuda{nullptr};
  switch (format) {
    case Format::kMinMaxUInt8:
      return gpu ? gpu::minmax_decompress_reduce(cuda, in, m, k, average, out)
                 : cpu::minmax_decompress_reduce(Cpu{}, in, m, k, average, out);
    case Format::kMinMaxUInt4:
      return gpu ? gpu::minmax_uint4_decompress_reduce(cuda, in, m, k, average, out)
                 : cpu::minmax_uint4_decompress_reduce(Cpu{}, in, m, k, average, out);
    default:
      return gpu ? gpu::sign_decompress_reduce(cuda, in, m, k, average, out)
                 : cpu::sign_decompress_reduce(Cpu{}, in, m, k, average, out);
  }
}

// Compresses with both devices and compares, then decompresses the CPU bytes
// with both.
template <typename T>
void check_compress(Format format, int64_t n, int64_t k, int64_t offset, bool feedback,
                    std::mt19937& rng, const std::string& name, float amplitude = 0.0f) {
  Buffer<T> x(n, offset);
  random_fill(x, rng, amplitude);
  Buffer<float> residual(feedback ? n : 0, offset);
  for (int64_t i = 0; i < residual.size(); ++i)
    residual[i] = std::normal_distribution<float>(0.0f, 0.5f)(rng);
  const int64_t bytes = bagua::compressed_bytes(format, n, k);
  Buffer<uint8_t> out_cpu(bytes, 0), out_gpu(bytes, 0);
  Buffer<float> res_cpu(feedback ? n : 0, offset), res_gpu(feedback ? n : 0, offset);
  out_cpu.fill_bytes(0xab);
  out_gpu.fill_bytes(0xcd);
  const float* r = feedback ? residual.data() : nullptr;
  float* rc = feedback ? res_cpu.data() : nullptr;
  float* rg = feedback ? res_gpu.data() : nullptr;
  bool ok = true;
  check_status(name, "cpu", compress(false, format, x.data(), r, n, k, out_cpu.data(), rc), ok);
  check_status(name, "cuda", compress(true, format, x.data(), r, n, k, out_gpu.data(), rg), ok);
  if (!ok) return;
  if (format != Format::kSign) {
    ok = same_bytes(name, "compressed", out_cpu, out_gpu) &&
         (!feedback || same_bytes(name, "residual", res_cpu, res_gpu));
  } else {
    // Scales within tolerance; every other byte (bits, zeros, padding) identical.
    const bagua::Chunking chunking{format, n, k};
    for (int64_t c = 0; c < k && ok; ++c) {
      const int64_t at = chunking.slot_offset(c);
      float a, b;
      std::memcpy(&a, out_cpu.data() + at, 4);
      std::memcpy(&b, out_gpu.data() + at, 4);
      if (!(std::fabs(a - b) <= kSignScaleRtol * std::fabs(a)) && !(a != a && b != b)) {
        report(name, "scale of chunk " + std::to_string(c) + ": " + std::to_string(a) + " vs " +
                         std::to_string(b));
        ok = false;
      }
      std::memcpy(out_gpu.data() + at, out_cpu.data() + at, 4);
      for (int64_t i = chunking.begin(c); feedback && ok && i < chunking.begin(c + 1); ++i) {
        const float tol = kSignScaleRtol * (std::fabs(a) + std::fabs(res_cpu[i])) + 1e-30f;
        if (!(std::fabs(res_cpu[i] - res_gpu[i]) <= tol)) {
          report(name, "residual " + std::to_string(i) + ": " + std::to_string(res_cpu[i]) +
                           " vs " + std::to_string(res_gpu[i]));
          ok = false;
        }
      }
    }
    ok = ok && same_bytes(name, "compressed (scales excepted)", out_cpu, out_gpu);
  }
  if (!ok) return;
  ++tally::passed;

  // Decompress the CPU's bytes with both devices into buffers at the same offset.
  Buffer<T> dec_cpu(n, offset), dec_gpu(n, offset);
  dec_cpu.fill_bytes(0x11);
  dec_gpu.fill_bytes(0x22);
  const std::string dname = name + " decompress";
  check_status(dname, "cpu", decompress(false, format, out_cpu.data(), n, k, dec_cpu.data()), ok);
  check_status(dname, "cuda", decompress(true, format, out_cpu.data(), n, k, dec_gpu.data()), ok);
  if (ok && same_bytes(dname, "decoded", dec_cpu, dec_gpu)) ++tally::passed;
}

// k single-chunk buffers of m elements each, decoded and summed or averaged.
template <typename T>
void check_decompress_reduce(Format format, int64_t m, int64_t k, bool average, std::mt19937& rng,
                             const std::string& name, float amplitude = 0.0f) {
  Buffer<T> x(m * k, 0);
  random_fill(x, rng, amplitude);
  Buffer<uint8_t> packed(bagua::compressed_bytes(format, m * k, k), 0);
  bool ok = true;
  uint8_t* codes = packed.data();
  check_status(name, "cpu compress",
               compress(false, format, x.data(), static_cast<const float*>(nullptr), m * k, k,
                        codes, static_cast<float*>(nullptr)),
               ok);
  Buffer<T> out_cpu(m, 0), out_gpu(m, 0);
  out_cpu.fill_bytes(0x33);
  out_gpu.fill_bytes(0x44);
  check_status(name, "cpu", decompress_reduce(false, format, codes, m, k, average, out_cpu.data()),
               ok);
  check_status(name, "cuda", decompress_reduce(true, format, codes, m, k, average, out_gpu.data()),
               ok);
  if (ok && same_bytes(name, "reduced", out_cpu, out_gpu)) ++tally::passed;
}

// The four elementwise helpers, inputs and output at `offset`.
template <typename T>
void check_elementwise(int64_t n, int64_t offset, std::mt19937& rng, const std::string& name,
                       float amplitude = 0.0f) {
  Buffer<T> a(n, offset), b(n, offset), c(n, offset), d(n, offset);
  random_fill(a, rng, amplitude);
  random_fill(b, rng, amplitude);
  random_fill(c, rng, amplitude);
  random_fill(d, rng, amplitude);
  using Run = std::function<Status(bool gpu, T* out)>;
  const std::pair<const char*, Run> helpers[] = {
      {"average2",
       [&](bool g, T* out) {
         return g ? gpu::average2(Cuda{nullptr}, a.data(), b.data(), n, out)
                  : cpu::average2(Cpu{}, a.data(), b.data(), n, out);
       }},
      {"axpy",
       [&](bool g, T* out) {
         return g ? gpu::axpy(Cuda{nullptr}, a.data(), -0.75f, b.data(), n, out)
                  : cpu::axpy(Cpu{}, a.data(), -0.75f, b.data(), n, out);
       }},
      {"async_average",
       [&](bool g, T* out) {
         return g ? gpu::async_average(Cuda{nullptr}, a.data(), b.data(), c.data(), 3.0f, n, out)
                  : cpu::async_average(Cpu{}, a.data(), b.data(), c.data(), 3.0f, n, out);
       }},
      {"lowprec_decentralized_diff",
       [&](bool g, T* out) {
         return g ? gpu::lowprec_decentralized_diff(Cuda{nullptr}, a.data(), b.data(), c.data(),
                                                    d.data(), n, out)
                  : cpu::lowprec_decentralized_diff(Cpu{}, a.data(), b.data(), c.data(), d.data(),
                                                    n, out);
       }},
  };
  for (const auto& [helper, run] : helpers) {
    const std::string hname = name + " " + helper;
    Buffer<T> out_cpu(n, offset), out_gpu(n, offset);
    out_cpu.fill_bytes(0x55);
    out_gpu.fill_bytes(0x66);
    bool ok = true;
    check_status(hname, "cpu", run(false, out_cpu.data()), ok);
    check_status(hname, "cuda", run(true, out_gpu.data()), ok);
    if (ok && same_bytes(hname, "output", out_cpu, out_gpu)) ++tally::passed;
  }
}

// Chunk counts for n elements: one chunk, chunks that do not divide n, and
// (n < 8) empty chunks. Besides, one-element chunks (k = n) at n = 7 and 31,
// and at n = 257 a header grid of two blocks (k > kThreads); the latter is
// dtype-independent and costs a block per chunk under the shim, so float32 only.
// At n = 20001, two chunks of a full and a partial group each.
template <typename T>
std::vector<int64_t> chunk_counts(int64_t n) {
  std::vector<int64_t> ks = {1, 3, 8};
  if (n == 7 || n == 31 || (n == 257 && std::is_same_v<T, float>)) ks.push_back(n);
  if (n == 20001) ks.push_back(2);
  return ks;
}

// Sizes: a single element; less than a warp; below, at and above a block of
// kThreads; 1000 (slots of 4 or 8 with a partial step); 4099 (several warp steps
// in a tile); a tile (one min-max group of 8192) and one past it; 20001 (several
// groups and tiles per chunk, a partial last one). Larger sizes take no other
// path; --dump checks 65549 against NumPy.
template <typename T>
void run_dtype(bool quick, int& shape_turn) {
  const std::vector<int64_t> sizes =
      quick ? std::vector<int64_t>{1, 7, 257, 1000, 4099, 20001}
            : std::vector<int64_t>{1, 7, 31, 255, 256, 257, 1000, 4099, 8192, 8193, 20001};
  for (const int64_t n : sizes) {
    for (const int64_t k : chunk_counts<T>(n)) {
      for (const int64_t offset : {0, 1}) {
        for (const bool feedback : {false, true}) {
          for (const Format format : kFormats) {
            const DeviceShape& shape = kShapes[shape_turn++ % kShapeCount];
            cuda_shim::device() = shape.device;
            std::mt19937 rng(static_cast<unsigned>(n * 7919 + k * 31 + offset * 7 + feedback));
            const std::string name = std::string(format_name(format)) + " " + dtype_name<T>() +
                                     " n=" + std::to_string(n) + " k=" + std::to_string(k) +
                                     " offset=" + std::to_string(offset) +
                                     (feedback ? " feedback" : "") + " [" + shape.name + "]";
            check_compress<T>(format, n, k, offset, feedback, rng, name);
          }
        }
      }
    }
    for (const int64_t offset : {0, 1}) {
      const DeviceShape& shape = kShapes[shape_turn++ % kShapeCount];
      cuda_shim::device() = shape.device;
      std::mt19937 rng(static_cast<unsigned>(n + offset));
      check_elementwise<T>(n, offset, rng,
                           std::string("elementwise ") + dtype_name<T>() +
                               " n=" + std::to_string(n) + " offset=" + std::to_string(offset) +
                               " [" + shape.name + "]");
    }
    // More inputs than a block computes parameters for at once (kThreads) at n = 31.
    const std::vector<int64_t> inputs =
        n == 31 ? std::vector<int64_t>{1, 3, 300} : std::vector<int64_t>{1, 3};
    for (const int64_t k : inputs) {
      for (const bool average : {false, true}) {
        for (const Format format : kFormats) {
          const DeviceShape& shape = kShapes[shape_turn++ % kShapeCount];
          cuda_shim::device() = shape.device;
          std::mt19937 rng(static_cast<unsigned>(n * 3 + k));
          check_decompress_reduce<T>(format, n, k, average, rng,
                                     std::string(format_name(format)) + " decompress_reduce " +
                                         dtype_name<T>() + " m=" + std::to_string(n) +
                                         " k=" + std::to_string(k) +
                                         (average ? " average" : " sum") + " [" + shape.name + "]");
        }
      }
    }
  }
}

// Chunks whose grid float32 alone cannot compute (subnormal and tiny ranges,
// values near the float32 limit), sign scales whose sum overflows, elementwise
// helpers whose intermediates overflow, 16-bit subnormals and signed zeros: for
// each dtype, amplitudes that reach its edges (random_fill).
template <typename T>
void run_extremes(const std::vector<float>& amplitudes, int& shape_turn) {
  for (const float amplitude : amplitudes) {
    const std::string range =
        std::string(" ") + dtype_name<T>() + " amplitude=" + std::to_string(amplitude);
    for (const int64_t n : {257, 8193}) {  // one group; a full group and one element
      std::mt19937 elementwise_rng(static_cast<unsigned>(n));
      check_elementwise<T>(n, 1, elementwise_rng, "elementwise n=" + std::to_string(n) + range,
                           amplitude);
      for (const int64_t k : {1, 3}) {
        for (const bool feedback : {false, true}) {
          for (const Format format : kFormats) {
            cuda_shim::device() = kShapes[shape_turn++ % kShapeCount].device;
            std::mt19937 rng(static_cast<unsigned>(n * 5 + k + feedback));
            check_compress<T>(format, n, k, 0, feedback, rng,
                              std::string(format_name(format)) + " n=" + std::to_string(n) +
                                  " k=" + std::to_string(k) + (feedback ? " feedback" : "") + range,
                              amplitude);
            for (const bool average : {false, true}) {
              check_decompress_reduce<T>(format, n, 3, average, rng,
                                         std::string(format_name(format)) +
                                             " decompress_reduce m=" + std::to_string(n) +
                                             (average ? " average" : " sum") + range,
                                         amplitude);
            }
          }
        }
      }
    }
  }
}

template <typename T>
void write(const std::string& path, const Buffer<T>& b) {
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(b.data()), sizeof(T) * b.size());
}

// One case of --dump: x (and residual) in, every compress and decompress
// output of the CUDA kernels out, in files named `prefix`.*.bin.
template <typename T>
void dump_case(const std::string& dir, int64_t n, int64_t k, bool feedback, std::ofstream& list) {
  const std::string prefix = std::string(dtype_name<T>()) + "_" + std::to_string(n) + "_" +
                             std::to_string(k) + (feedback ? "_ef" : "");
  std::mt19937 rng(static_cast<unsigned>(n * 13 + k));
  Buffer<T> x(n, 0);
  random_fill(x, rng);
  Buffer<float> residual(feedback ? n : 0, 0);
  for (int64_t i = 0; i < residual.size(); ++i)
    residual[i] = std::normal_distribution<float>(0.0f, 0.5f)(rng);
  write(dir + "/" + prefix + ".x.bin", x);
  write(dir + "/" + prefix + ".residual.bin", residual);
  for (const Format format : kFormats) {
    const char* name = format_name(format);
    Buffer<uint8_t> out(bagua::compressed_bytes(format, n, k), 0);
    Buffer<float> res_out(feedback ? n : 0, 0);
    Buffer<T> decoded(n, 0);
    const float* r = feedback ? residual.data() : nullptr;
    float* ro = feedback ? res_out.data() : nullptr;
    const Status s = compress(true, format, x.data(), r, n, k, out.data(), ro);
    const Status d = decompress(true, format, out.data(), n, k, decoded.data());
    if (!s.ok() || !d.ok()) report(prefix, s.message + d.message);
    write(dir + "/" + prefix + "." + name + ".bin", out);
    write(dir + "/" + prefix + "." + name + "_residual.bin", res_out);
    write(dir + "/" + prefix + "." + name + "_decoded.bin", decoded);
  }
  list << prefix << " " << dtype_name<T>() << " " << n << " " << k << " " << feedback << "\n";
}

template <typename T>
void dump_dtype(const std::string& dir, std::ofstream& list) {
  for (const int64_t n : {257, 4099, 65549})
    for (const int64_t k : {1, 3, 8})
      for (const bool feedback : {false, true}) dump_case<T>(dir, n, k, feedback, list);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 2 && std::strcmp(argv[1], "--dump") == 0) {
    cuda_shim::device() = kShapes[2].device;  // a small L2: several compress batches
    std::ofstream list(std::string(argv[2]) + "/cases.txt");
    dump_dtype<float>(argv[2], list);
    dump_dtype<Half>(argv[2], list);
    dump_dtype<BFloat16>(argv[2], list);
    return tally::failed == 0 ? 0 : 1;
  }
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  int shape_turn = 0;
  run_dtype<float>(quick, shape_turn);
  run_dtype<Half>(quick, shape_turn);
  run_dtype<BFloat16>(quick, shape_turn);
  run_extremes<float>({1e-40f, 1e-37f, 3.4e38f, -1.0f}, shape_turn);
  run_extremes<BFloat16>({1e-40f, 3.3e38f, -1.0f}, shape_turn);
  run_extremes<Half>({1e-6f, 6e4f, -1.0f}, shape_turn);
  return tally::summary();
}
