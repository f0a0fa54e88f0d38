// The C API on one process: argument checks with the messages they give,
// handles that outlive their objects, and one-rank collectives.
#include <braid/braid.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "src/core/config.h"
#include "tests/rank_test.h"

namespace {

class OneRank : public ::testing::Test {
 protected:
  void SetUp() override {
    braid_unique_id_t id;
    BRAID_ASSERT_OK(braid_get_unique_id(&id));
    BRAID_ASSERT_OK(braid_comm_init_rank(&comm_, 1, id, 0));
  }
  void TearDown() override {
    if (comm_ != nullptr) {
      BRAID_EXPECT_OK(braid_comm_destroy(comm_));
    }
  }
  // Asserts the call failed with `code` and a message containing `needle`.
  void expect_error(braid_result_t got, braid_result_t code, const std::string& needle) {
    EXPECT_EQ(got, code) << braid_get_last_error();
    EXPECT_NE(std::string(braid_get_last_error()).find(needle), std::string::npos)
        << "message '" << braid_get_last_error() << "' does not mention '" << needle << "'";
  }
  braid_comm_t comm_ = nullptr;
};

TEST(Api, ErrorStringsAndVersion) {
  EXPECT_STREQ(braid_get_error_string(BRAID_SUCCESS), "success");
  EXPECT_STREQ(braid_get_error_string(BRAID_ERR_TIMEOUT), "timed out");
  EXPECT_STREQ(braid_get_error_string(static_cast<braid_result_t>(999)), "unknown result code");
  int v = 0;
  BRAID_EXPECT_OK(braid_get_version(&v));
  EXPECT_EQ(v, BRAID_VERSION_CODE);
  EXPECT_EQ(braid_get_version(nullptr), BRAID_ERR_INVALID_ARGUMENT);
}

TEST(Api, DtypeTable) {
  const size_t sizes[] = {1, 1, 4, 4, 8, 8, 2, 2, 4, 8};
  for (int d = 0; d < BRAID_NUM_DTYPES; ++d)
    EXPECT_EQ(braid_dtype_size(static_cast<braid_dtype_t>(d)), sizes[d]);
  EXPECT_EQ(braid_dtype_size(static_cast<braid_dtype_t>(77)), 0u);
  EXPECT_STREQ(braid_dtype_name(BRAID_BFLOAT16), "bfloat16");
  EXPECT_STREQ(braid_redop_name(BRAID_AVG), "avg");
}

TEST(Api, InitRejectsBadArguments) {
  braid_unique_id_t id;
  BRAID_ASSERT_OK(braid_get_unique_id(&id));
  braid_comm_t comm;
  EXPECT_EQ(braid_comm_init_rank(nullptr, 1, id, 0), BRAID_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(braid_comm_init_rank(&comm, 0, id, 0), BRAID_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(braid_get_last_error()).find("nranks=0"), std::string::npos);
  // More ranks than the rendezvous takes: refused here, before any memory
  // is sized by nranks, naming the limit.
  EXPECT_EQ(braid_comm_init_rank(&comm, INT_MAX, id, 0), BRAID_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(braid_get_last_error())
                .find("nranks=2147483647 exceeds the most ranks a communicator may have, 1048576"),
            std::string::npos)
      << braid_get_last_error();
  EXPECT_EQ(braid_comm_init_rank(&comm, 2, id, 2), BRAID_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(braid_get_last_error()).find("rank=2"), std::string::npos);
  braid_unique_id_t garbage;
  std::memset(&garbage, 0x5a, sizeof(garbage));
  EXPECT_EQ(braid_comm_init_rank(&comm, 1, garbage, 0), BRAID_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(braid_get_last_error()).find("not a braid unique id"), std::string::npos);
  EXPECT_EQ(braid_get_unique_id(nullptr), BRAID_ERR_INVALID_ARGUMENT);
}

TEST(Api, BadEnvironmentNamesTheVariable) {
  const std::string long_host_id(200, 'h');
  struct Case {
    const char* name;
    const char* value;
    const char* expected;  // in the error
  };
  const Case cases[] = {
      {"BRAID_TIMEOUT", "soon", "BRAID_TIMEOUT='soon'"},
      {"BRAID_TRANSPORT", "pigeon", "BRAID_TRANSPORT='pigeon' is invalid: expected auto, shm or tcp"},
      {"BRAID_SHM_SLOT_BYTES", "12Q", "BRAID_SHM_SLOT_BYTES='12Q'"},
      {"BRAID_TCP_BUFFER_BYTES", "4G", "BRAID_TCP_BUFFER_BYTES='4G'"},  // above its 1 GiB bound
      {"BRAID_TUNE_PROBE", "yes", "BRAID_TUNE_PROBE='yes'"},
      {"BRAID_CUDA_P2P_LEVEL", "NV2",
       "BRAID_CUDA_P2P_LEVEL='NV2' is invalid: expected LOC, NVL, PIX, PXB, PHB, NODE or SYS"},
      {"BRAID_CPU_ISA", "sse9",
       "BRAID_CPU_ISA='sse9' is invalid: expected default, avx2, avx512 or avx512_bf16"},
      // Cut to what ranks exchange, two hosts' ids would become one.
      {"BRAID_HOST_ID", long_host_id.c_str(), "expected at most 191 bytes (it has 200)"},
      // A band moved one way and not the other is empty: it streamed nothing.
      {"BRAID_SHM_STREAM_MIN_BYTES", "512K",
       "BRAID_SHM_STREAM_MIN_BYTES (524288) must be below BRAID_SHM_STREAM_MAX_BYTES (262144, its default)"},
      {"BRAID_SHM_STREAM_MAX_BYTES", "8K", "BRAID_SHM_STREAM_MIN_BYTES (16384) must be below"},
  };
  for (const Case& c : cases) {
    const char* outer = std::getenv(c.name);  // as the run was started (sanitize.sh sets some)
    const std::string saved = outer ? outer : "";
    setenv(c.name, c.value, 1);
    braid_unique_id_t id;
    EXPECT_EQ(braid_get_unique_id(&id), BRAID_ERR_INVALID_ARGUMENT) << c.name;
    EXPECT_NE(std::string(braid_get_last_error()).find(c.expected), std::string::npos)
        << braid_get_last_error();
    if (outer)
      setenv(c.name, saved.c_str(), 1);
    else
      unsetenv(c.name);
  }
}

// A BRAID_* variable braid does not read, close to one it does, gets a
// warning naming the likely one; others (a build script's, say) do not.
TEST(Api, MisspeltVariablesAreNamed) {
  const char* env[] = {"BRAID_TIMOUT=5", "BRAID_BUILD_JOBS=2",  "BRAID_TIMEOUT=1",
                       "PATH=/bin",      "BRAID_TRANSPOTR=tcp", "BRAID_=x",
                       nullptr};
  const std::vector<std::string> w = braid::misspelt_variables(env);
  ASSERT_EQ(w.size(), 2u);
  EXPECT_EQ(w[0],
            "environment variable BRAID_TIMOUT is not a braid setting (did you mean BRAID_TIMEOUT?); it is "
            "ignored");
  EXPECT_NE(w[1].find("BRAID_TRANSPOTR is not a braid setting (did you mean BRAID_TRANSPORT?)"),
            std::string::npos);
}

// The list the warning compares against holds every BRAID_* variable the
// library's sources name (a new one left out would be reported as a typo).
TEST(Api, KnownVariablesCoverTheSources) {
  const auto& known = braid::known_variables();
  size_t files = 0;
  for (const char* dir : {"src", "transports", "kernels"}) {
    for (const auto& entry :
         std::filesystem::recursive_directory_iterator(std::string(BRAID_SOURCE_DIR) + "/" + dir)) {
      const std::string ext = entry.path().extension();
      if (ext != ".cc" && ext != ".h" && ext != ".cu") continue;
      ++files;
      std::ifstream in(entry.path());
      const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      // Each string literal "BRAID_[A-Z0-9_]+" (std::regex trips GCC 12's
      // maybe-uninitialized warning under the sanitizers).
      for (size_t at = text.find("\"BRAID_"); at != std::string::npos; at = text.find("\"BRAID_", at + 1)) {
        size_t end = at + 1;
        while (end < text.size() && (std::isupper(static_cast<unsigned char>(text[end])) ||
                                     std::isdigit(static_cast<unsigned char>(text[end])) || text[end] == '_'))
          ++end;
        if (end >= text.size() || text[end] != '"' || end == at + 7) continue;  // "BRAID_" alone: a prefix
        const std::string name = text.substr(at + 1, end - at - 1);
        EXPECT_NE(std::find(known.begin(), known.end(), name), known.end())
            << name << " in " << entry.path() << " is not in known_variables()";
      }
    }
  }
  EXPECT_GT(files, 20u);
}

TEST(Api, InitEnvNeedsItsVariables) {
  unsetenv("MASTER_ADDR");
  braid_comm_t comm;
  EXPECT_EQ(braid_comm_init_env(&comm), BRAID_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(braid_get_last_error()).find("MASTER_ADDR"), std::string::npos);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", "29500", 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("RANK", "7", 1);
  EXPECT_EQ(braid_comm_init_env(&comm), BRAID_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(braid_get_last_error()).find("RANK='7'"), std::string::npos)
      << braid_get_last_error();
  setenv("WORLD_SIZE", "2000000", 1);  // above the 2^20 ranks a rendezvous takes
  setenv("RANK", "0", 1);
  EXPECT_EQ(braid_comm_init_env(&comm), BRAID_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(braid_get_last_error()).find("WORLD_SIZE='2000000'"), std::string::npos)
      << braid_get_last_error();
  EXPECT_NE(std::string(braid_get_last_error()).find("1048576]"), std::string::npos)
      << braid_get_last_error();
  // The root listens on MASTER_PORT+1 unless BRAID_ROOT_PORT says where.
  setenv("WORLD_SIZE", "2", 1);
  setenv("MASTER_PORT", "65535", 1);
  EXPECT_EQ(braid_comm_init_env(&comm), BRAID_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(braid_get_last_error()).find("set BRAID_ROOT_PORT"), std::string::npos)
      << braid_get_last_error();
  for (const char* v : {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"}) unsetenv(v);
}

// A thread_local made before its thread's first braid call is destroyed
// after braid's per-thread cache (frames, the op block): calls from its
// destructor, as from a RAII wrapper at thread exit, must work without that
// cache, never through it once freed (ASan: use after free).
struct CallsAtThreadExit {
  braid_comm_t comm = nullptr;
  int* good = nullptr;
  ~CallsAtThreadExit() {
    if (comm == nullptr) return;
    int n = 0;
    for (int i = 0; i < 3; ++i) {  // ops and frames freed, then made again
      float in[4] = {1, 2, 3, 4}, out[4] = {};
      if (braid_all_reduce(in, out, 4, BRAID_FLOAT32, BRAID_SUM, comm, nullptr) == BRAID_SUCCESS &&
          out[3] == 4)
        ++n;
    }
    *good = n;
  }
};

TEST_F(OneRank, CallsFromThreadExitDestructors) {
  int good = -1;
  std::thread t([&] {
    thread_local CallsAtThreadExit guard;  // made before braid's cache
    guard.comm = comm_;
    guard.good = &good;
    float x = 1, y = 0;
    BRAID_EXPECT_OK(braid_all_reduce(&x, &y, 1, BRAID_FLOAT32, BRAID_SUM, comm_, nullptr));
    EXPECT_EQ(y, 1);
  });
  t.join();
  EXPECT_EQ(good, 3) << "all_reduce from a thread_local's destructor at thread exit";
}

TEST_F(OneRank, RankAndSize) {
  int rank = -1, size = -1;
  BRAID_EXPECT_OK(braid_comm_rank(comm_, &rank));
  BRAID_EXPECT_OK(braid_comm_size(comm_, &size));
  EXPECT_EQ(rank, 0);
  EXPECT_EQ(size, 1);
  expect_error(braid_comm_rank(comm_, nullptr), BRAID_ERR_INVALID_ARGUMENT, "rank is NULL");
}

TEST_F(OneRank, NullBuffersNameTheArgument) {
  float x[4] = {};
  expect_error(braid_all_reduce(nullptr, x, 4, BRAID_FLOAT32, BRAID_SUM, comm_, nullptr),
               BRAID_ERR_INVALID_ARGUMENT, "sendbuf is NULL with count=4");
  expect_error(braid_all_reduce(x, nullptr, 4, BRAID_FLOAT32, BRAID_SUM, comm_, nullptr),
               BRAID_ERR_INVALID_ARGUMENT, "recvbuf is NULL");
  expect_error(braid_all_gather(x, nullptr, 1, BRAID_FLOAT32, comm_, nullptr), BRAID_ERR_INVALID_ARGUMENT,
               "recvbuf is NULL with sendcount=1");
  expect_error(braid_broadcast(nullptr, x, 4, BRAID_FLOAT32, 0, comm_, nullptr), BRAID_ERR_INVALID_ARGUMENT,
               "sendbuf (on the root)");
  // A zero count needs no buffers.
  BRAID_EXPECT_OK(braid_all_reduce(nullptr, nullptr, 0, BRAID_FLOAT32, BRAID_SUM, comm_, nullptr));
}

TEST_F(OneRank, UnknownDtypeAndOp) {
  float x[4] = {};
  expect_error(braid_all_reduce(x, x, 4, static_cast<braid_dtype_t>(42), BRAID_SUM, comm_, nullptr),
               BRAID_ERR_INVALID_ARGUMENT, "dtype=42");
  expect_error(braid_all_reduce(x, x, 4, static_cast<braid_dtype_t>(-1), BRAID_SUM, comm_, nullptr),
               BRAID_ERR_INVALID_ARGUMENT, "dtype=-1");
  expect_error(braid_all_reduce(x, x, 4, BRAID_FLOAT32, static_cast<braid_redop_t>(9), comm_, nullptr),
               BRAID_ERR_INVALID_ARGUMENT, "op=9");
  int32_t i[4] = {};
  expect_error(braid_all_reduce(i, i, 4, BRAID_INT32, BRAID_AVG, comm_, nullptr), BRAID_ERR_INVALID_ARGUMENT,
               "op=avg is not defined for dtype=int32");
  expect_error(braid_reduce_scatter(i, i, 1, BRAID_UINT8, BRAID_AVG, comm_, nullptr),
               BRAID_ERR_INVALID_ARGUMENT, "avg");
}

TEST_F(OneRank, RootAndPeerOutOfRange) {
  float x[4] = {};
  expect_error(braid_broadcast(x, x, 4, BRAID_FLOAT32, 5, comm_, nullptr), BRAID_ERR_INVALID_ARGUMENT,
               "root=5 is out of range for a communicator of 1 ranks");
  expect_error(braid_reduce(x, x, 4, BRAID_FLOAT32, BRAID_SUM, -1, comm_, nullptr),
               BRAID_ERR_INVALID_ARGUMENT, "root=-1");
  expect_error(braid_send(x, 4, BRAID_FLOAT32, 3, comm_, nullptr), BRAID_ERR_INVALID_ARGUMENT, "peer=3");
  expect_error(braid_recv(x, 4, BRAID_FLOAT32, -2, comm_, nullptr), BRAID_ERR_INVALID_ARGUMENT, "peer=-2");
}

TEST_F(OneRank, SendToSelfInAGroup) {
  int32_t out[5] = {1, 2, 3, 4, 5}, in[5] = {};
  BRAID_ASSERT_OK(braid_group_start());
  BRAID_ASSERT_OK(braid_send(out, 5, BRAID_INT32, 0, comm_, nullptr));
  BRAID_ASSERT_OK(braid_recv(in, 5, BRAID_INT32, 0, comm_, nullptr));
  BRAID_ASSERT_OK(braid_group_end());
  for (int i = 0; i < 5; ++i) EXPECT_EQ(in[i], i + 1);
}

TEST_F(OneRank, CountOverflow) {
  float x[4] = {};
  expect_error(braid_all_reduce(x, x, SIZE_MAX / 2, BRAID_FLOAT32, BRAID_SUM, comm_, nullptr),
               BRAID_ERR_INVALID_ARGUMENT, "overflows");
  expect_error(braid_all_gather(x, x, SIZE_MAX / 4, BRAID_FLOAT64, comm_, nullptr),
               BRAID_ERR_INVALID_ARGUMENT, "sendcount=");
}

TEST_F(OneRank, AStreamWithoutACudaDriverInTheProcessIsRefused) {
  float x[4] = {};
  int fake_stream = 0;
  expect_error(braid_all_reduce(x, x, 4, BRAID_FLOAT32, BRAID_SUM, comm_, &fake_stream),
               BRAID_ERR_UNSUPPORTED, "no CUDA driver (libcuda.so.1) is loaded");
}

// Device memory, with a fake CUDA driver (tests/fake_libcuda.cc) that calls
// one address range device memory: braid asks the driver once it is loaded,
// refuses that range naming the buffer and the device, and takes host
// memory, even a buffer it had seen as host memory before the driver came.
// In a child process, so the fake driver stays out of the other tests.
TEST(DeviceMemory, RefusedWithAMessageOnceTheDriverIsLoaded) {
  // _exit: the child leaves without exit-time work (the sanitizers' leak
  // check would count what the parent's threads hold).
  auto child = [] {
    braid_unique_id_t id;
    braid_comm_t comm = nullptr;
    if (braid_get_unique_id(&id) != BRAID_SUCCESS || braid_comm_init_rank(&comm, 1, id, 0) != BRAID_SUCCESS)
      _exit(10);
    std::vector<float> host(64, 1.0f), out(64, 0.0f), later(64, 2.0f);
    // Seen as host memory while no driver is loaded.
    if (braid_all_reduce(later.data(), later.data(), 64, BRAID_FLOAT32, BRAID_SUM, comm, nullptr) !=
        BRAID_SUCCESS)
      _exit(11);
    void* driver = dlopen(BRAID_FAKE_LIBCUDA, RTLD_NOW | RTLD_GLOBAL);
    if (driver == nullptr) _exit(12);
    auto set_range =
        reinterpret_cast<void (*)(const void*, size_t)>(dlsym(driver, "fake_cuda_set_device_range"));
    if (set_range == nullptr) _exit(13);
    set_range(later.data(), later.size() * sizeof(float));  // now "device memory"
    auto refused = [&](braid_result_t got, const char* what) {
      const std::string m = braid_get_last_error();
      return got == BRAID_ERR_UNSUPPORTED && m.find(what) != std::string::npos &&
             m.find("is memory of CUDA device 3") != std::string::npos;
    };
    if (braid_all_reduce(host.data(), out.data(), 64, BRAID_FLOAT32, BRAID_SUM, comm, nullptr) !=
            BRAID_SUCCESS ||
        out[0] != 1.0f)
      _exit(14);
    if (!refused(braid_all_reduce(later.data(), out.data(), 64, BRAID_FLOAT32, BRAID_SUM, comm, nullptr),
                 "sendbuf"))
      _exit(15);
    if (!refused(braid_all_reduce(host.data(), later.data(), 64, BRAID_FLOAT32, BRAID_SUM, comm, nullptr),
                 "recvbuf"))
      _exit(16);
    if (!refused(braid_broadcast(later.data(), later.data(), 64, BRAID_FLOAT32, 0, comm, nullptr), "sendbuf"))
      _exit(17);
    if (later[0] != 2.0f) _exit(18);  // never touched
    _exit(braid_comm_destroy(comm) == BRAID_SUCCESS ? 0 : 19);
  };
  // "threadsafe": the child is a fresh run of this binary, single-threaded
  // (TSan refuses threads started after forking a multi-threaded parent).
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(child(), ::testing::ExitedWithCode(0), "");
}

TEST_F(OneRank, UseAfterDestroyIsAnError) {
  BRAID_ASSERT_OK(braid_comm_destroy(comm_));
  braid_comm_t stale = comm_;
  comm_ = nullptr;
  float x[4] = {};
  expect_error(braid_all_reduce(x, x, 4, BRAID_FLOAT32, BRAID_SUM, stale, nullptr),
               BRAID_ERR_INVALID_ARGUMENT, "not a live communicator");
  expect_error(braid_comm_destroy(stale), BRAID_ERR_INVALID_ARGUMENT, "not a live communicator");
  expect_error(braid_barrier(nullptr, nullptr), BRAID_ERR_INVALID_ARGUMENT, "comm is NULL");
  int rank;
  expect_error(braid_comm_rank(stale, &rank), BRAID_ERR_INVALID_ARGUMENT, "not a live communicator");
}

TEST_F(OneRank, RequestsAreCheckedAndFreedOnce) {
  float x[4] = {1, 2, 3, 4}, y[4] = {};
  expect_error(braid_iall_reduce(x, y, 4, BRAID_FLOAT32, BRAID_SUM, comm_, nullptr, nullptr),
               BRAID_ERR_INVALID_ARGUMENT, "request is NULL");
  braid_request_t req = nullptr;
  BRAID_ASSERT_OK(braid_iall_reduce(x, y, 4, BRAID_FLOAT32, BRAID_SUM, comm_, nullptr, &req));
  braid_request_t copy = req;
  BRAID_EXPECT_OK(braid_wait(&req));
  EXPECT_EQ(req, nullptr);
  EXPECT_EQ(y[3], 4.0f);
  expect_error(braid_wait(&copy), BRAID_ERR_INVALID_ARGUMENT, "not a live request");
  expect_error(braid_group_end(), BRAID_ERR_INVALID_USAGE, "group_end without");
}

// A request the caller still holds does not keep its communicator: destroy
// frees it at once (a registered buffer can then be freed), and the request
// still reports its operation's result.
TEST_F(OneRank, DestroyFreesTheCommunicatorWhileARequestIsHeld) {
  void* mem = nullptr;
  BRAID_ASSERT_OK(braid_mem_alloc(&mem, 1 << 16));
  BRAID_ASSERT_OK(braid_comm_register(comm_, mem, 1 << 16));
  float x[4] = {1, 2, 3, 4}, y[4] = {};
  braid_request_t recv = nullptr, never_waited = nullptr;
  BRAID_ASSERT_OK(braid_irecv(y, 4, BRAID_FLOAT32, 0, comm_, nullptr, &recv));
  BRAID_ASSERT_OK(braid_isend(x, 4, BRAID_FLOAT32, 0, comm_, nullptr, &never_waited));
  BRAID_ASSERT_OK(braid_comm_destroy(comm_));
  comm_ = nullptr;
  BRAID_EXPECT_OK(braid_mem_free(mem));
  BRAID_EXPECT_OK(braid_wait(&recv));
  EXPECT_EQ(y[3], 4.0f);
  int done = 0;
  BRAID_EXPECT_OK(braid_test(&never_waited, &done));
  EXPECT_EQ(done, 1);
}

// Bindings that pass handles as void* can mix the two kinds up: a request's
// handle is never a live communicator, nor the other way round.
TEST_F(OneRank, AHandleOfTheOtherKindIsRefused) {
  float x[4] = {1, 2, 3, 4}, y[4] = {};
  braid_request_t req = nullptr;
  BRAID_ASSERT_OK(braid_irecv(y, 4, BRAID_FLOAT32, 0, comm_, nullptr, &req));
  auto* req_as_comm = reinterpret_cast<braid_comm_t>(req);
  auto* comm_as_req = reinterpret_cast<braid_request_t>(comm_);
  int rank = -1;
  expect_error(braid_comm_rank(req_as_comm, &rank), BRAID_ERR_INVALID_ARGUMENT, "not a live communicator");
  expect_error(braid_comm_destroy(req_as_comm), BRAID_ERR_INVALID_ARGUMENT, "not a live communicator");
  expect_error(braid_request_free(comm_as_req), BRAID_ERR_INVALID_ARGUMENT, "not a live request");
  expect_error(braid_wait(&comm_as_req), BRAID_ERR_INVALID_ARGUMENT, "not a live request");
  // Both are still live and work.
  BRAID_ASSERT_OK(braid_send(x, 4, BRAID_FLOAT32, 0, comm_, nullptr));
  BRAID_ASSERT_OK(braid_wait(&req));
  EXPECT_EQ(y[3], 4.0f);
  BRAID_ASSERT_OK(braid_comm_rank(comm_, &rank));
  EXPECT_EQ(rank, 0);
}

// An op in a group starts at braid_group_end: waiting for it before then
// would wait forever, so it is refused; the request stays valid.
TEST_F(OneRank, WaitingInsideTheGroupThatHoldsTheOpIsRefused) {
  float x[4] = {1, 2, 3, 4}, y[4] = {};
  BRAID_ASSERT_OK(braid_group_start());
  braid_request_t req = nullptr;
  BRAID_ASSERT_OK(braid_iall_reduce(x, y, 4, BRAID_FLOAT32, BRAID_SUM, comm_, nullptr, &req));
  expect_error(braid_wait(&req), BRAID_ERR_INVALID_USAGE, "braid_group_end");
  ASSERT_NE(req, nullptr);
  int done = 1;
  expect_error(braid_test(&req, &done), BRAID_ERR_INVALID_USAGE, "braid_group_end");
  EXPECT_EQ(done, 0);
  expect_error(braid_wait_all(1, &req), BRAID_ERR_INVALID_USAGE, "braid_group_end");
  BRAID_ASSERT_OK(braid_group_end());
  BRAID_EXPECT_OK(braid_wait(&req));
  EXPECT_EQ(y[3], 4.0f);
}

// A communicator whose operations wait in this thread's open group is not
// destroyed (they would start at group_end on a destroyed communicator).
TEST_F(OneRank, DestroyInsideAGroupHoldingItsOperationsIsRefused) {
  float x = 1;
  BRAID_ASSERT_OK(braid_group_start());
  BRAID_ASSERT_OK(braid_all_reduce(&x, &x, 1, BRAID_FLOAT32, BRAID_SUM, comm_, nullptr));
  EXPECT_EQ(braid_comm_destroy(comm_), BRAID_ERR_INVALID_USAGE);
  EXPECT_NE(std::string(braid_get_last_error()).find("open group holds operations on the communicator"),
            std::string::npos)
      << braid_get_last_error();
  BRAID_ASSERT_OK(braid_group_end());
  EXPECT_EQ(x, 1.0f);
}

// The same for a group of small sends and receives, which make no ops
// until group_end (they may be done there without any).
TEST_F(OneRank, DestroyInsideAGroupHoldingItsSendsIsRefused) {
  int32_t x = 7, y = 0;
  BRAID_ASSERT_OK(braid_group_start());
  BRAID_ASSERT_OK(braid_send(&x, 1, BRAID_INT32, 0, comm_, nullptr));
  BRAID_ASSERT_OK(braid_recv(&y, 1, BRAID_INT32, 0, comm_, nullptr));
  EXPECT_EQ(braid_comm_destroy(comm_), BRAID_ERR_INVALID_USAGE);
  EXPECT_NE(std::string(braid_get_last_error()).find("open group holds operations on the communicator"),
            std::string::npos)
      << braid_get_last_error();
  EXPECT_EQ(y, 0) << "a grouped receive ran before group_end";
  BRAID_ASSERT_OK(braid_group_end());
  EXPECT_EQ(y, 7);
}

// A completion callback runs on a thread that drives the engine: braid
// calls from it are refused (a wait there waited on itself, forever, and a
// destroy spun forever on the driver's lock).
TEST_F(OneRank, BraidCallsFromACallbackAreRefused) {
  float x = 1, y = 0, z = 0;
  braid_request_t first = nullptr, second = nullptr;
  BRAID_ASSERT_OK(braid_iall_reduce(&x, &y, 1, BRAID_FLOAT32, BRAID_SUM, comm_, nullptr, &first));
  BRAID_ASSERT_OK(braid_iall_reduce(&x, &z, 1, BRAID_FLOAT32, BRAID_SUM, comm_, nullptr, &second));
  struct Seen {
    braid_request_t other;
    braid_comm_t comm;
    braid_result_t wait = BRAID_SUCCESS, destroy = BRAID_SUCCESS, op = BRAID_SUCCESS, reg = BRAID_SUCCESS,
                   dereg = BRAID_SUCCESS, init = BRAID_SUCCESS;
    std::string message;
  } seen{second, comm_};
  BRAID_ASSERT_OK(braid_request_set_callback(
      first,
      [](void* user, braid_result_t, const char*) {
        auto* s = static_cast<Seen*>(user);
        s->wait = braid_wait(&s->other);
        s->message = braid_get_last_error();
        s->destroy = braid_comm_destroy(s->comm);
        float w = 0;
        s->op = braid_all_reduce(&w, &w, 1, BRAID_FLOAT32, BRAID_SUM, s->comm, nullptr);
        // Calls that wait on an op of their own (they waited forever here).
        s->reg = braid_comm_register(s->comm, &w, sizeof(w));
        s->dereg = braid_comm_deregister(s->comm, &w);
        braid_unique_id_t id{};
        braid_comm_t made = nullptr;
        s->init = braid_comm_init_rank(&made, 1, id, 0);
      },
      &seen));
  BRAID_ASSERT_OK(braid_wait(&first));
  EXPECT_EQ(seen.wait, BRAID_ERR_INVALID_USAGE);
  EXPECT_EQ(seen.destroy, BRAID_ERR_INVALID_USAGE);
  EXPECT_EQ(seen.op, BRAID_ERR_INVALID_USAGE);
  EXPECT_EQ(seen.reg, BRAID_ERR_INVALID_USAGE);
  EXPECT_EQ(seen.dereg, BRAID_ERR_INVALID_USAGE);
  EXPECT_EQ(seen.init, BRAID_ERR_INVALID_USAGE);
  EXPECT_NE(seen.message.find("wait called from a completion callback"), std::string::npos) << seen.message;
  // Outside the callback everything works as before.
  BRAID_ASSERT_OK(braid_wait(&second));
  EXPECT_EQ(z, 1.0f);
}

// A wait on another thread for an op still in this thread's open group
// waits for the group to end, bounded by the communicator's timeout (it had
// no deadline: the op was not posted, and the wait never ended).
TEST_F(OneRank, AWaitForAnOpInAnotherThreadsOpenGroupIsBounded) {
  for (bool ends_in_time : {true, false}) {
    BRAID_ASSERT_OK(braid_comm_set_timeout(comm_, ends_in_time ? 30 : 0.2));
    float x = 1, y = 0;
    braid_request_t req = nullptr;
    BRAID_ASSERT_OK(braid_group_start());
    BRAID_ASSERT_OK(braid_iall_reduce(&x, &y, 1, BRAID_FLOAT32, BRAID_SUM, comm_, nullptr, &req));
    braid_result_t waited = BRAID_ERR_INTERNAL;
    std::string message;
    std::thread waiter([&] {
      waited = braid_wait(&req);
      message = braid_get_last_error();
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(ends_in_time ? 100 : 600));
    BRAID_ASSERT_OK(braid_group_end());
    waiter.join();
    if (ends_in_time) {
      EXPECT_EQ(waited, BRAID_SUCCESS) << message;
      EXPECT_EQ(y, 1.0f);
    } else {
      EXPECT_EQ(waited, BRAID_ERR_TIMEOUT);
      EXPECT_NE(message.find("is in another thread's group that did not end within the timeout of 0.2 s"),
                std::string::npos)
          << message;
    }
  }
}

// A child of fork() cannot use its parent's communicator (the progress
// thread is not in the child, and the sockets and shared memory are the
// parent's): calls are refused, destroy only drops the child's handle (it
// hung where an op was in flight), and the parent works on.
TEST_F(OneRank, AForkedChildCannotUseItsParentsCommunicator) {
  // A receive from itself that the parent completes after the fork.
  float got = 0, sent = 5;
  braid_request_t pending = nullptr;
  BRAID_ASSERT_OK(braid_irecv(&got, 1, BRAID_FLOAT32, 0, comm_, nullptr, &pending));
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    alarm(20);  // a child that hangs is killed, and the test fails
    float x = 1;
    int code = 0;
    if (braid_all_reduce(&x, &x, 1, BRAID_FLOAT32, BRAID_SUM, comm_, nullptr) != BRAID_ERR_INVALID_USAGE)
      code = 1;
    if (std::string(braid_get_last_error()).find("made before this process was forked") == std::string::npos)
      code = 2;
    if (braid_comm_abort(comm_) != BRAID_ERR_INVALID_USAGE) code = 3;
    // The parent's request too: the child hung in braid_wait, or drove the
    // parent's connections and took its message.
    int done = 0;
    if (braid_test(&pending, &done) != BRAID_ERR_INVALID_USAGE || done != 0) code = 5;
    if (braid_request_set_callback(
            pending, [](void*, braid_result_t, const char*) {}, nullptr) != BRAID_ERR_INVALID_USAGE)
      code = 6;
    if (braid_wait(&pending) != BRAID_ERR_INVALID_USAGE) code = 7;
    if (std::string(braid_get_last_error()).find("started before this process was forked") ==
        std::string::npos)
      code = 8;
    if (braid_comm_destroy(comm_) != BRAID_SUCCESS) code = 4;
    _exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  float y = 2;
  BRAID_ASSERT_OK(braid_all_reduce(&y, &y, 1, BRAID_FLOAT32, BRAID_SUM, comm_, nullptr));
  EXPECT_EQ(y, 2.0f);
  BRAID_ASSERT_OK(braid_send(&sent, 1, BRAID_FLOAT32, 0, comm_, nullptr));
  BRAID_ASSERT_OK(braid_wait(&pending));
  EXPECT_EQ(got, 5.0f);
}

// braid_mem_alloc in a child of fork(): the allocator's lock, which another
// parent thread may hold at the fork, is free there (the child hung), and
// memory the parent registered can be freed in the child (the parent's
// registration refused it), while the parent's stays registered.
TEST_F(OneRank, AForkedChildAllocatesAndFreesSharedMemory) {
  void* registered = nullptr;
  BRAID_ASSERT_OK(braid_mem_alloc(&registered, 1 << 16));
  BRAID_ASSERT_OK(braid_comm_register(comm_, registered, 1 << 16));
  std::atomic<bool> stop{false};
  std::thread churn([&] {  // holds the allocator's lock often
    while (!stop.load()) {
      void* p = nullptr;
      if (braid_mem_alloc(&p, 4096) == BRAID_SUCCESS) braid_mem_free(p);
    }
  });
  int failed = 0, last_status = 0;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(4);  // sanitizer builds
  for (int i = 0; i < 1000 && failed == 0 && std::chrono::steady_clock::now() < give_up; ++i) {
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      alarm(10);  // a child stuck on the lock is killed, and the test fails
      void* mine = nullptr;
      if (braid_mem_alloc(&mine, 4096) != BRAID_SUCCESS) _exit(1);
      if (braid_mem_free(mine) != BRAID_SUCCESS) _exit(2);
      if (braid_mem_free(registered) != BRAID_SUCCESS) _exit(3);
      _exit(0);
    }
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      failed = i + 1;
      last_status = status;
    }
  }
  stop = true;
  churn.join();
  EXPECT_EQ(failed, 0) << "child " << failed << " ended with status " << last_status
                       << (WIFSIGNALED(last_status) ? " (killed: stuck)" : "");
  expect_error(braid_mem_free(registered), BRAID_ERR_INVALID_USAGE, "still registered");
  BRAID_ASSERT_OK(braid_comm_deregister(comm_, registered));
  BRAID_EXPECT_OK(braid_mem_free(registered));
}

// Small blocking sends to the rank itself pack as shm's do: 100 of them
// wait for their receives (the fifth waited for its deadline when each took
// a slot), and come out in order, sizes and contents intact; a 1 MiB send
// fills the buffer exactly.
TEST_F(OneRank, SmallSendsToItselfWaitTogether) {
  BRAID_ASSERT_OK(braid_comm_set_timeout(comm_, 5));
  for (int32_t i = 0; i < 100; ++i) {
    std::vector<int32_t> msg(static_cast<size_t>(i % 5), i);
    BRAID_ASSERT_OK(braid_send(msg.data(), msg.size(), BRAID_INT32, 0, comm_, nullptr)) << "send " << i;
  }
  for (int32_t i = 0; i < 100; ++i) {
    std::vector<int32_t> got(static_cast<size_t>(i % 5), -1);
    BRAID_ASSERT_OK(braid_recv(got.data(), got.size(), BRAID_INT32, 0, comm_, nullptr)) << "recv " << i;
    for (int32_t v : got) ASSERT_EQ(v, i);
  }
  std::vector<uint8_t> big(size_t{1} << 20, 3), back(size_t{1} << 20, 0);
  BRAID_ASSERT_OK(braid_send(big.data(), big.size(), BRAID_UINT8, 0, comm_, nullptr));
  BRAID_ASSERT_OK(braid_recv(back.data(), back.size(), BRAID_UINT8, 0, comm_, nullptr));
  EXPECT_EQ(back, big);
}

TEST_F(OneRank, AnIOperationThatCanFinishAtOnceIsDoneWhenTheCallReturns) {
  // The posting thread drives briefly before leaving the op to the progress
  // thread: an op with nothing to wait for never costs a thread hand-off.
  for (int i = 0; i < 100; ++i) {
    float x[4] = {1, 2, 3, static_cast<float>(i)}, y[4] = {};
    braid_request_t req = nullptr;
    BRAID_ASSERT_OK(braid_iall_reduce(x, y, 4, BRAID_FLOAT32, BRAID_SUM, comm_, nullptr, &req));
    int done = 0;
    BRAID_ASSERT_OK(braid_test(&req, &done));
    ASSERT_EQ(done, 1) << "call " << i;
    EXPECT_EQ(req, nullptr);
    EXPECT_EQ(y[3], static_cast<float>(i));
  }
}

TEST_F(OneRank, CollectivesCopyOnOneRank) {
  std::vector<double> in = {1.5, -2, 3, 8}, out(4, 0);
  BRAID_EXPECT_OK(braid_all_reduce(in.data(), out.data(), 4, BRAID_FLOAT64, BRAID_AVG, comm_, nullptr));
  EXPECT_EQ(out, in);
  out.assign(4, 0);
  BRAID_EXPECT_OK(braid_all_gather(in.data(), out.data(), 4, BRAID_FLOAT64, comm_, nullptr));
  EXPECT_EQ(out, in);
  out.assign(4, 0);
  BRAID_EXPECT_OK(braid_all_to_all(in.data(), out.data(), 4, BRAID_FLOAT64, comm_, nullptr));
  EXPECT_EQ(out, in);
  BRAID_EXPECT_OK(braid_barrier(comm_, nullptr));
}

TEST(Api, ReduceLocal) {
  int8_t a[3] = {100, -100, 5}, b[3] = {100, -100, -7}, d[3];
  BRAID_ASSERT_OK(braid_reduce_local(d, a, b, 3, BRAID_INT8, BRAID_SUM));
  EXPECT_EQ(d[0], static_cast<int8_t>(-56));  // wraps
  EXPECT_EQ(d[1], static_cast<int8_t>(56));
  EXPECT_EQ(d[2], -2);
  EXPECT_EQ(braid_reduce_local(nullptr, a, b, 3, BRAID_INT8, BRAID_MAX), BRAID_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(braid_get_last_error()).find("dst is NULL"), std::string::npos);
  // In place (dst is a, or b) is fine; dst partly over a or b is refused.
  std::vector<float> x(1024, 1.0f), y(1024, 2.0f);
  BRAID_ASSERT_OK(braid_reduce_local(x.data(), x.data(), y.data(), x.size(), BRAID_FLOAT32, BRAID_SUM));
  BRAID_ASSERT_OK(braid_reduce_local(y.data(), x.data(), y.data(), x.size(), BRAID_FLOAT32, BRAID_SUM));
  EXPECT_EQ(x[1023], 3.0f);
  EXPECT_EQ(y[1023], 5.0f);
  EXPECT_EQ(braid_reduce_local(x.data() + 16, x.data(), y.data(), 1000, BRAID_FLOAT32, BRAID_SUM),
            BRAID_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(braid_get_last_error()).find("dst overlaps a partly"), std::string::npos);
  EXPECT_EQ(braid_reduce_local(y.data(), x.data(), y.data() + 1, 1000, BRAID_FLOAT32, BRAID_SUM),
            BRAID_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(braid_get_last_error()).find("dst overlaps b partly"), std::string::npos);
  EXPECT_EQ(x[1023], 3.0f);  // nothing written
  // Adjacent, not overlapping: fine.
  BRAID_ASSERT_OK(braid_reduce_local(x.data() + 512, x.data(), y.data(), 512, BRAID_FLOAT32, BRAID_SUM));
  EXPECT_EQ(x[512], 8.0f);
}

}  // namespace
