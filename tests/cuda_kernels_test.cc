// The CUDA reduction kernels held to kernels/cpu's results.
//
// HostMath runs everywhere: the kernels' element templates (element_math.h),
// compiled here for the host, against kernels::reduce and kernels::divide
// for every dtype x op, special values included. Device runs the kernels
// themselves (every dtype x op, 1 to 3 sources, 2 destinations, aligned and
// unaligned, in place) and skips with a message where there is no GPU.
// DeviceBuffers checks that the host-ordered C API refuses device memory
// with a message instead of reading it.
#include <braid/braid.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/reduce_kernels.h"
#include "kernels/cuda/element_math.h"
#include "kernels/cuda/reduce_kernels.h"
#include "tests/rank_test.h"

namespace {

namespace cm = braid::cuda_math;
using braid::kernels::float_to_bfloat16;
using braid::kernels::float_to_half;

const braid_dtype_t kDtypes[] = {BRAID_INT8,   BRAID_UINT8,   BRAID_INT32,    BRAID_UINT32,  BRAID_INT64,
                                 BRAID_UINT64, BRAID_FLOAT16, BRAID_BFLOAT16, BRAID_FLOAT32, BRAID_FLOAT64};
const braid_redop_t kOps[] = {BRAID_SUM, BRAID_PROD, BRAID_MIN, BRAID_MAX,
                              BRAID_AVG, BRAID_BAND, BRAID_BOR, BRAID_BXOR};

// Random elements of `dtype`, with the special values a float type has
// (NaN, infinities, signed zeros, subnormals) sprinkled in.
std::vector<unsigned char> random_elements(braid_dtype_t dtype, size_t count, uint32_t seed) {
  const size_t esize = braid_dtype_size(dtype);
  std::vector<unsigned char> out(count * esize);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> value(-4.0f, 4.0f);
  for (size_t i = 0; i < count; ++i) {
    unsigned char* p = out.data() + i * esize;
    const bool special = rng() % 11 == 0;
    const float specials[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1e-6f, -3e-8f, 70000.0f};
    const float f = special ? specials[rng() % 8] : value(rng);
    switch (dtype) {
      case BRAID_FLOAT16: {
        const uint16_t h = float_to_half(f);
        std::memcpy(p, &h, 2);
        break;
      }
      case BRAID_BFLOAT16: {
        const uint16_t b = float_to_bfloat16(f);
        std::memcpy(p, &b, 2);
        break;
      }
      case BRAID_FLOAT32:
        std::memcpy(p, &f, 4);
        break;
      case BRAID_FLOAT64: {
        const double d = special ? static_cast<double>(f) : static_cast<double>(value(rng)) / 3.0;
        std::memcpy(p, &d, 8);
        break;
      }
      default:
        for (size_t b = 0; b < esize; ++b) p[b] = static_cast<unsigned char>(rng());
        break;
    }
  }
  return out;
}

bool is_nan(braid_dtype_t dtype, const unsigned char* p) {
  uint16_t h;
  switch (dtype) {
    case BRAID_FLOAT16:
      std::memcpy(&h, p, 2);
      return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0;
    case BRAID_BFLOAT16:
      std::memcpy(&h, p, 2);
      return (h & 0x7f80u) == 0x7f80u && (h & 0x7fu) != 0;
    case BRAID_FLOAT32: {
      float f;
      std::memcpy(&f, p, 4);
      return std::isnan(f);
    }
    case BRAID_FLOAT64: {
      double d;
      std::memcpy(&d, p, 8);
      return std::isnan(d);
    }
    default:
      return false;
  }
}

// Element-wise equality, any NaN equal to any NaN (the device quiets NaNs
// to its canonical one; the CPU keeps the payload).
void expect_same(braid_dtype_t dtype, const std::vector<unsigned char>& got,
                 const std::vector<unsigned char>& want, const std::string& what) {
  const size_t esize = braid_dtype_size(dtype);
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t wrong = 0, first = 0;
  for (size_t i = 0; i < want.size() / esize; ++i) {
    const unsigned char *g = got.data() + i * esize, *w = want.data() + i * esize;
    if (std::memcmp(g, w, esize) == 0 || (is_nan(dtype, g) && is_nan(dtype, w))) continue;
    if (wrong++ == 0) first = i;
  }
  EXPECT_EQ(wrong, 0u) << what << ": " << wrong << " wrong elements, the first at " << first;
}

// What kernels/cpu gives for srcs[0] op srcs[1] op ... (pairwise, left to right).
std::vector<unsigned char> cpu_reference(braid_dtype_t dtype, braid_redop_t op,
                                         const std::vector<std::vector<unsigned char>>& srcs, size_t count) {
  std::vector<unsigned char> acc = srcs[0];
  for (size_t s = 1; s < srcs.size(); ++s)
    braid::kernels::reduce(dtype, op, acc.data(), acc.data(), srcs[s].data(), count);
  return acc;
}

// The element templates compiled for the host, over whole arrays.
template <class E, class Op>
void host_reduce(const std::vector<std::vector<unsigned char>>& srcs, size_t count, unsigned char* dst) {
  using S = typename E::Stored;
  std::vector<S> typed[BRAID_CUDA_MAX_SOURCES];
  const S* ptrs[BRAID_CUDA_MAX_SOURCES];
  for (size_t s = 0; s < srcs.size(); ++s) {
    typed[s].resize(count);
    std::memcpy(typed[s].data(), srcs[s].data(), count * sizeof(S));
    ptrs[s] = typed[s].data();
  }
  for (size_t i = 0; i < count; ++i) {
    const S r = cm::reduce_element<E>(ptrs, static_cast<int>(srcs.size()), i, Op{});
    std::memcpy(dst + i * sizeof(S), &r, sizeof(S));
  }
}

bool host_reduce_any(braid_dtype_t dtype, braid_redop_t op,
                     const std::vector<std::vector<unsigned char>>& srcs, size_t count, unsigned char* dst) {
  bool defined = false;
  cm::visit_element(dtype, [&](auto e) {
    using E = decltype(e);
    defined = cm::visit_op<E>(op, [&](auto o) { host_reduce<E, decltype(o)>(srcs, count, dst); });
  });
  return defined;
}

std::string name_of(braid_dtype_t dtype, braid_redop_t op, size_t nsrcs) {
  return std::string(braid_dtype_name(dtype)) + " op " + std::to_string(static_cast<int>(op)) + ", " +
         std::to_string(nsrcs) + " sources";
}

TEST(CudaHostMath, TwoInputsMatchTheCpuKernelsForEveryDtypeAndOp) {
  const size_t count = 5000;
  int combinations = 0;
  for (braid_dtype_t dtype : kDtypes) {
    for (braid_redop_t op : kOps) {
      if (!braid::kernels::redop_supported(dtype, op)) {
        // The kernels refuse exactly what the CPU kernels refuse.
        std::vector<std::vector<unsigned char>> one = {random_elements(dtype, 1, 0)};
        unsigned char out[8];
        EXPECT_FALSE(host_reduce_any(dtype, op, one, 1, out)) << name_of(dtype, op, 1);
        continue;
      }
      ++combinations;
      std::vector<std::vector<unsigned char>> srcs = {random_elements(dtype, count, 1 + dtype * 31 + op),
                                                      random_elements(dtype, count, 7 + dtype * 17 + op)};
      std::vector<unsigned char> got(srcs[0].size());
      ASSERT_TRUE(host_reduce_any(dtype, op, srcs, count, got.data())) << name_of(dtype, op, 2);
      expect_same(dtype, got, cpu_reference(dtype, op, srcs, count), name_of(dtype, op, 2));
    }
  }
  EXPECT_EQ(combinations, 10 * 4 + 4 + 6 * 3);  // every pair redop_supported allows
}

// With more inputs, integers and float32/64 fold left to right as the CPU
// does; float16 and bfloat16 accumulate in float32 and round once.
TEST(CudaHostMath, MoreInputsFoldLeftToRightAndHalvesRoundOnce) {
  const size_t count = 3000;
  for (braid_dtype_t dtype : kDtypes) {
    for (braid_redop_t op : {BRAID_SUM, BRAID_MAX, BRAID_PROD}) {
      std::vector<std::vector<unsigned char>> srcs;
      for (int s = 0; s < 3; ++s) srcs.push_back(random_elements(dtype, count, 100 + s * 13 + dtype));
      std::vector<unsigned char> got(srcs[0].size());
      ASSERT_TRUE(host_reduce_any(dtype, op, srcs, count, got.data()));
      std::vector<unsigned char> want;
      if (dtype == BRAID_FLOAT16 || dtype == BRAID_BFLOAT16) {
        const bool half = dtype == BRAID_FLOAT16;
        want.resize(got.size());
        for (size_t i = 0; i < count; ++i) {
          float acc = 0;
          for (int s = 0; s < 3; ++s) {
            uint16_t v;
            std::memcpy(&v, srcs[s].data() + 2 * i, 2);
            const float x = half ? braid::kernels::half_to_float(v) : braid::kernels::bfloat16_to_float(v);
            if (s == 0)
              acc = x;
            else if (op == BRAID_SUM)
              acc += x;
            else if (op == BRAID_PROD)
              acc *= x;
            else
              acc = (acc > x || acc != acc) ? acc : x;
          }
          const uint16_t r = half ? float_to_half(acc) : float_to_bfloat16(acc);
          std::memcpy(want.data() + 2 * i, &r, 2);
        }
      } else {
        want = cpu_reference(dtype, op, srcs, count);
      }
      expect_same(dtype, got, want, name_of(dtype, op, 3));
    }
  }
}

TEST(CudaHostMath, DivideMatchesTheCpuKernel) {
  const size_t count = 4000;
  for (braid_dtype_t dtype : {BRAID_FLOAT16, BRAID_BFLOAT16, BRAID_FLOAT32, BRAID_FLOAT64}) {
    for (int divisor : {2, 3, 7}) {
      std::vector<unsigned char> data = random_elements(dtype, count, 55 + dtype + divisor);
      std::vector<unsigned char> want = data;
      braid::kernels::divide(dtype, want.data(), want.data(), count, divisor);
      std::vector<unsigned char> got(data.size());
      cm::visit_element(dtype, [&](auto e) {
        using E = decltype(e);
        using S = typename E::Stored;
        if constexpr (!std::is_integral_v<typename E::Compute>) {
          for (size_t i = 0; i < count; ++i) {
            S v;
            std::memcpy(&v, data.data() + i * sizeof(S), sizeof(S));
            const S r = cm::divide_element<E>(v, divisor);
            std::memcpy(got.data() + i * sizeof(S), &r, sizeof(S));
          }
        }
      });
      expect_same(dtype, got, want,
                  std::string("divide ") + braid_dtype_name(dtype) + " by " + std::to_string(divisor));
    }
  }
}

// ---- on a GPU ----

bool have_gpu(std::string* why) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    *why = std::string("no usable CUDA device: ") + cudaGetErrorString(err);
    return false;
  }
  if (n == 0) {
    *why = "no CUDA device";
    return false;
  }
  return true;
}

#define SKIP_WITHOUT_GPU()                                                             \
  do {                                                                                 \
    std::string why;                                                                   \
    if (!have_gpu(&why)) GTEST_SKIP() << why << "; the GPU run is tools/gpu-check.sh"; \
  } while (0)

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

TEST(CudaDevice, EveryDtypeAndOpMatchesTheCpuAtAnyAlignment) {
  SKIP_WITHOUT_GPU();
  for (size_t count : {size_t{1}, size_t{37}, size_t{4099}, size_t{(1 << 20) + 3}}) {
    for (size_t offset : {size_t{0}, size_t{1}}) {  // in elements: 1 breaks 16-byte alignment
      for (braid_dtype_t dtype : kDtypes) {
        for (braid_redop_t op : kOps) {
          if (!braid::kernels::redop_supported(dtype, op)) continue;
          for (int nsrcs = 1; nsrcs <= 3; ++nsrcs) {
            if (count > 5000 && nsrcs != 2) continue;
            const size_t esize = braid_dtype_size(dtype), bytes = (count + offset) * esize;
            std::vector<std::vector<unsigned char>> host;
            std::vector<void*> dev(nsrcs + 2);
            for (int s = 0; s < nsrcs + 2; ++s) CUDA_OK(cudaMalloc(&dev[s], bytes));
            const void* srcs[BRAID_CUDA_MAX_SOURCES];
            for (int s = 0; s < nsrcs; ++s) {
              host.push_back(random_elements(dtype, count, 1000 + s + dtype * 7 + op * 3));
              srcs[s] = static_cast<char*>(dev[s]) + offset * esize;
              CUDA_OK(cudaMemcpy(const_cast<void*>(srcs[s]), host[s].data(), count * esize,
                                 cudaMemcpyHostToDevice));
            }
            void* dsts[2] = {static_cast<char*>(dev[nsrcs]) + offset * esize,
                             static_cast<char*>(dev[nsrcs + 1]) + offset * esize};
            char error[256];
            ASSERT_EQ(
                braid_cuda_reduce_copy(dtype, op, srcs, nsrcs, dsts, 2, count, nullptr, error, sizeof(error)),
                BRAID_SUCCESS)
                << error;
            CUDA_OK(cudaDeviceSynchronize());
            std::vector<unsigned char> want(count * esize);
            if (nsrcs == 1) {
              want = host[0];
            } else if (nsrcs == 2 || (dtype != BRAID_FLOAT16 && dtype != BRAID_BFLOAT16)) {
              want = cpu_reference(dtype, op, host, count);
            } else {
              ASSERT_TRUE(host_reduce_any(dtype, op, host, count, want.data()));
            }
            const std::string what = name_of(dtype, op, nsrcs) + ", count " + std::to_string(count) +
                                     ", offset " + std::to_string(offset);
            for (void* d : dsts) {
              std::vector<unsigned char> got(count * esize);
              CUDA_OK(cudaMemcpy(got.data(), d, got.size(), cudaMemcpyDeviceToHost));
              expect_same(dtype, got, want, what);
            }
            for (void* p : dev) CUDA_OK(cudaFree(p));
          }
        }
      }
    }
  }
}

TEST(CudaDevice, InPlaceAndDivide) {
  SKIP_WITHOUT_GPU();
  const size_t count = 100003;
  const braid_dtype_t dtype = BRAID_BFLOAT16;
  std::vector<std::vector<unsigned char>> host = {random_elements(dtype, count, 5),
                                                  random_elements(dtype, count, 6)};
  void *a = nullptr, *b = nullptr;
  CUDA_OK(cudaMalloc(&a, count * 2));
  CUDA_OK(cudaMalloc(&b, count * 2));
  CUDA_OK(cudaMemcpy(a, host[0].data(), count * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(b, host[1].data(), count * 2, cudaMemcpyHostToDevice));
  const void* srcs[2] = {a, b};
  void* dsts[1] = {a};
  ASSERT_EQ(braid_cuda_reduce_copy(dtype, BRAID_AVG, srcs, 2, dsts, 1, count, nullptr, nullptr, 0),
            BRAID_SUCCESS);
  ASSERT_EQ(braid_cuda_divide(dtype, a, a, count, 2, nullptr, nullptr, 0), BRAID_SUCCESS);
  std::vector<unsigned char> got(count * 2);
  CUDA_OK(cudaMemcpy(got.data(), a, got.size(), cudaMemcpyDeviceToHost));
  std::vector<unsigned char> want = cpu_reference(dtype, BRAID_SUM, host, count);
  braid::kernels::divide(dtype, want.data(), want.data(), count, 2);
  expect_same(dtype, got, want, "bfloat16 avg in place");
  CUDA_OK(cudaFree(a));
  CUDA_OK(cudaFree(b));
}

// One pointer off 16-byte alignment takes every element on the single-element
// path; a destination that is also a source is read before it is written.
TEST(CudaDevice, MixedAlignmentAndADestinationThatIsASource) {
  SKIP_WITHOUT_GPU();
  const size_t count = 70001;
  const braid_dtype_t dtype = BRAID_FLOAT32;
  std::vector<std::vector<unsigned char>> host = {random_elements(dtype, count, 21),
                                                  random_elements(dtype, count, 22)};
  void *a = nullptr, *b = nullptr, *c = nullptr;
  CUDA_OK(cudaMalloc(&a, count * 4));
  CUDA_OK(cudaMalloc(&b, (count + 1) * 4));
  CUDA_OK(cudaMalloc(&c, count * 4));
  float* b_off = static_cast<float*>(b) + 1;  // only this one is unaligned
  CUDA_OK(cudaMemcpy(a, host[0].data(), count * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(b_off, host[1].data(), count * 4, cudaMemcpyHostToDevice));
  const void* srcs[2] = {a, b_off};
  void* dsts[2] = {c, a};  // the second destination is the first source
  ASSERT_EQ(braid_cuda_reduce_copy(dtype, BRAID_SUM, srcs, 2, dsts, 2, count, nullptr, nullptr, 0),
            BRAID_SUCCESS);
  const std::vector<unsigned char> want = cpu_reference(dtype, BRAID_SUM, host, count);
  for (void* d : dsts) {
    std::vector<unsigned char> got(count * 4);
    CUDA_OK(cudaMemcpy(got.data(), d, got.size(), cudaMemcpyDeviceToHost));
    expect_same(dtype, got, want, "float32 sum, one source unaligned, destination == source");
  }
  CUDA_OK(cudaFree(a));
  CUDA_OK(cudaFree(b));
  CUDA_OK(cudaFree(c));
}

// Checked before any launch, so they hold without a GPU too.
TEST(CudaKernels, BadArgumentsAreRefusedWithAMessage) {
  char error[256] = {};
  const void* srcs[9] = {};
  void* dsts[5] = {};
  float x = 0;
  srcs[0] = &x;
  dsts[0] = &x;
  EXPECT_EQ(
      braid_cuda_reduce_copy(BRAID_FLOAT32, BRAID_SUM, srcs, 9, dsts, 1, 4, nullptr, error, sizeof(error)),
      BRAID_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(error, "reduce_copy: 9 sources (1 to 8)");
  EXPECT_EQ(
      braid_cuda_reduce_copy(BRAID_FLOAT32, BRAID_SUM, srcs, 1, dsts, 5, 4, nullptr, error, sizeof(error)),
      BRAID_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(error, "reduce_copy: 5 destinations (1 to 4)");
  EXPECT_EQ(
      braid_cuda_reduce_copy(BRAID_FLOAT32, BRAID_BXOR, srcs, 1, dsts, 1, 4, nullptr, error, sizeof(error)),
      BRAID_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(error, "reduce_copy: reduction 7 is not defined for dtype 8");
  EXPECT_EQ(
      braid_cuda_reduce_copy(BRAID_INT32, BRAID_AVG, srcs, 1, dsts, 1, 4, nullptr, error, sizeof(error)),
      BRAID_ERR_INVALID_ARGUMENT);
  srcs[0] = nullptr;
  EXPECT_EQ(
      braid_cuda_reduce_copy(BRAID_FLOAT32, BRAID_SUM, srcs, 1, dsts, 1, 4, nullptr, error, sizeof(error)),
      BRAID_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(error, "reduce_copy: source 0 is NULL");
  EXPECT_EQ(braid_cuda_divide(BRAID_INT32, &x, &x, 1, 2, nullptr, error, sizeof(error)),
            BRAID_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(error, "divide: dtype 2 is not floating");
  EXPECT_EQ(braid_cuda_divide(BRAID_FLOAT32, &x, &x, 1, 0, nullptr, error, sizeof(error)),
            BRAID_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(error, "divide: divisor is 0");
}

TEST(CudaDeviceBuffers, HostOrderedCallsRefuseDeviceMemoryWithAMessage) {
  SKIP_WITHOUT_GPU();
  braid_unique_id_t id;
  braid_comm_t comm = nullptr;
  BRAID_ASSERT_OK(braid_get_unique_id(&id));
  BRAID_ASSERT_OK(braid_comm_init_rank(&comm, 1, id, 0));
  void* dev = nullptr;
  CUDA_OK(cudaMalloc(&dev, 1024));
  std::vector<float> host(256, 1.0f);
  EXPECT_EQ(braid_all_reduce(dev, host.data(), 256, BRAID_FLOAT32, BRAID_SUM, comm, nullptr),
            BRAID_ERR_UNSUPPORTED);
  const std::string message = braid_get_last_error();
  EXPECT_NE(message.find("sendbuf"), std::string::npos) << message;
  EXPECT_NE(message.find("is memory of CUDA device"), std::string::npos) << message;
  EXPECT_EQ(braid_all_reduce(host.data(), dev, 256, BRAID_FLOAT32, BRAID_SUM, comm, nullptr),
            BRAID_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(braid_get_last_error()).find("recvbuf"), std::string::npos) << braid_get_last_error();
  // Pinned host memory is host memory.
  void* pinned = nullptr;
  CUDA_OK(cudaMallocHost(&pinned, 1024));
  BRAID_EXPECT_OK(braid_all_reduce(pinned, pinned, 256, BRAID_FLOAT32, BRAID_SUM, comm, nullptr));
  CUDA_OK(cudaFreeHost(pinned));
  CUDA_OK(cudaFree(dev));
  BRAID_EXPECT_OK(braid_comm_destroy(comm));
}

}  // namespace
