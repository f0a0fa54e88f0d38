// Failures become errors, never hangs: a killed peer, a peer that never
// comes, abort from another thread, mismatched calls, strangers at the root,
// and resources that run out.
#include <arpa/inet.h>
#include <braid/braid.h>
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "src/algo/primitives.h"
#include "src/core/bootstrap.h"
#include "src/core/socket.h"
#include "tests/rank_test.h"

namespace braid::test {
namespace {

bool contains(const char* haystack, const std::string& needle) {
  return std::string(haystack).find(needle) != std::string::npos;
}

class FailureTransports : public ::testing::TestWithParam<std::string> {};

// A timeout (120 s) beyond the launcher's limit (60 s): an error proves that
// a failure was detected; falling back to the deadline shows as a hang.
Env detection_env(const std::string& transport) {
  Env env = transport_env(transport);
  env.push_back({"BRAID_TIMEOUT", "120"});
  env.push_back({"BRAID_DEBUG", "NONE"});
  return env;
}

TEST_P(FailureTransports, KilledPeerGivesRemoteErrorNotTimeout) {
  // A long timeout: an error that names a dead peer proves detection, not expiry.
  Env env = detection_env(GetParam());
  // Where rank 0 leaves a fresh unique id for the survivors' new communicator.
  struct NewId {
    std::atomic<int> ready;
    braid_unique_id_t id;
  };
  auto* fresh = static_cast<NewId*>(
      mmap(nullptr, sizeof(NewId), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(fresh, MAP_FAILED);
  new (fresh) NewId{};
  auto result = launch(
      3, env,
      [fresh](braid_comm_t comm, int rank, int) {
        std::vector<float> buf(1 << 20, 1.0f);
        BRAID_ASSERT_OK(
            braid_all_reduce(buf.data(), buf.data(), buf.size(), BRAID_FLOAT32, BRAID_SUM, comm, nullptr));
        if (rank == 2) raise(SIGKILL);
        braid_result_t r = BRAID_SUCCESS;
        for (int i = 0; i < 3 && r == BRAID_SUCCESS; ++i)
          r = braid_all_reduce(buf.data(), buf.data(), buf.size(), BRAID_FLOAT32, BRAID_SUM, comm, nullptr);
        EXPECT_EQ(r, BRAID_ERR_REMOTE) << braid_comm_get_last_error(comm);
        // The dead rank and its host are named (directly, or through the
        // survivor that saw it first).
        const std::string msg = braid_comm_get_last_error(comm);
        EXPECT_TRUE(contains(msg.c_str(), "rank 2 (")) << msg;
        EXPECT_TRUE(contains(msg.c_str(), "host")) << msg;
        braid_result_t async = BRAID_SUCCESS;
        BRAID_EXPECT_OK(braid_comm_get_async_error(comm, &async));
        EXPECT_EQ(async, BRAID_ERR_REMOTE);
        // The communicator stays broken but destroyable; the launcher destroys it.
        float x = 0;
        EXPECT_EQ(braid_all_reduce(&x, &x, 1, BRAID_FLOAT32, BRAID_SUM, comm, nullptr), BRAID_ERR_REMOTE);
        // The survivors build a new communicator and carry on.
        if (rank == 0) {
          BRAID_ASSERT_OK(braid_get_unique_id(&fresh->id));
          fresh->ready.store(1);
        }
        for (int i = 0; i < 10000 && fresh->ready.load() == 0; ++i) usleep(1000);
        ASSERT_EQ(fresh->ready.load(), 1);
        braid_comm_t again = nullptr;
        BRAID_ASSERT_OK(braid_comm_init_rank(&again, 2, fresh->id, rank));
        int32_t v = rank + 1;
        BRAID_EXPECT_OK(braid_all_reduce(&v, &v, 1, BRAID_INT32, BRAID_SUM, again, nullptr));
        EXPECT_EQ(v, 3);
        BRAID_EXPECT_OK(braid_comm_destroy(again));
      },
      60);
  munmap(fresh, sizeof(NewId));
  ASSERT_EQ(result.ranks.size(), 3u);
  EXPECT_EQ(result.ranks[2].signal, SIGKILL);
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(result.ranks[r].timed_out) << "rank " << r << " hung";
    EXPECT_EQ(result.ranks[r].exit_code, 0) << "rank " << r;
  }
}

// Ranks 0 .. survivors-1 of an n-rank launch finished on their own, in time.
void expect_survivors_exited(const launcher::LaunchResult& result, int survivors, size_t nranks = 3) {
  ASSERT_EQ(result.ranks.size(), nranks);
  for (int r = 0; r < survivors; ++r) {
    EXPECT_FALSE(result.ranks[r].timed_out) << "rank " << r << " hung";
    EXPECT_EQ(result.ranks[r].exit_code, 0) << "rank " << r;
  }
}

// A rank that forked a child (a DataLoader worker) and then died is found
// dead as one that did not: the child lets go of braid's sockets, so rank
// 0's receive fails naming it. Over tcp it waited for its deadline while
// the child held the connection open.
TEST_P(FailureTransports, ARankWhoseForkedChildLivesOnIsFoundDead) {
  auto result = launch(
      2, detection_env(GetParam()),
      [](braid_comm_t comm, int rank, int) {
        float x[4];
        if (rank == 1) {
          if (fork() == 0) {  // the worker outlives its parent and rank 0's deadline
            close(1);         // (not holding the launcher's output open)
            close(2);
            usleep(20 * 1000 * 1000);
            _exit(0);
          }
          usleep(300 * 1000);
          _exit(0);
        }
        // Found dead (REMOTE), not waited for until this deadline (TIMEOUT).
        BRAID_ASSERT_OK(braid_comm_set_timeout(comm, 5));
        EXPECT_EQ(braid_recv(x, 4, BRAID_FLOAT32, 1, comm, nullptr), BRAID_ERR_REMOTE)
            << braid_get_last_error();
        EXPECT_TRUE(contains(braid_get_last_error(), "rank 1 (")) << braid_get_last_error();
      },
      60);
  expect_survivors_exited(result, 2, 2);
}

// braid_comm_get_last_error gives the error that broke the communicator
// where no call on it failed: rank 1 dies while rank 0's only receive from
// it was freed. It said "" until braid_comm_get_async_error was called.
TEST_P(FailureTransports, LastErrorOfACommunicatorBrokenWithoutAFailedCall) {
  auto result = launch(
      2, detection_env(GetParam()),
      [](braid_comm_t comm, int rank, int) {
        if (rank == 1) {
          usleep(200 * 1000);
          _exit(0);
        }
        float b[4];
        braid_request_t request = nullptr;
        BRAID_ASSERT_OK(braid_irecv(b, 4, BRAID_FLOAT32, 1, comm, nullptr, &request));
        BRAID_ASSERT_OK(braid_request_free(request));
        std::string msg;
        for (int i = 0; i < 1000 && msg.empty(); ++i) {
          usleep(10 * 1000);
          msg = braid_comm_get_last_error(comm);
        }
        EXPECT_TRUE(contains(msg.c_str(), "rank 1 (")) << "'" << msg << "'";
        braid_result_t async = BRAID_SUCCESS;
        BRAID_EXPECT_OK(braid_comm_get_async_error(comm, &async));
        EXPECT_EQ(async, BRAID_ERR_REMOTE);
        // A later failed call's message replaces it.
        EXPECT_EQ(braid_broadcast(b, b, 4, BRAID_FLOAT32, 99, comm, nullptr), BRAID_ERR_INVALID_ARGUMENT);
        EXPECT_TRUE(contains(braid_comm_get_last_error(comm), "root")) << braid_comm_get_last_error(comm);
      },
      60);
  expect_survivors_exited(result, 2, 2);
}

// A receive from any source waits on every peer. A peer that is gone
// without reporting a failure may just have finished its part: the receive
// goes on while another peer may still send, and fails once none is left
// (it waited for the deadline before).
TEST_P(FailureTransports, AReceiveFromAnySourceFailsOnceNoPeerIsLeft) {
  auto result = launch(
      3, detection_env(GetParam()),
      [](braid_comm_t comm, int rank, int) {
        if (rank == 2) raise(SIGKILL);
        int32_t v = 7;
        if (rank == 1) {
          // Sends once rank 2's death has been seen by several checks, then leaves.
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          BRAID_EXPECT_OK(braid_send(&v, 1, BRAID_INT32, 0, comm, nullptr));
          _exit(::testing::Test::HasFailure() ? 1 : 0);
        }
        int source = -1;
        v = 0;
        BRAID_EXPECT_OK(braid_recv_any(&v, 1, BRAID_INT32, &source, comm, nullptr));
        EXPECT_EQ(source, 1);
        EXPECT_EQ(v, 7);
        // The dead peers' error, not the deadline's.
        EXPECT_EQ(braid_recv_any(&v, 1, BRAID_INT32, &source, comm, nullptr), BRAID_ERR_REMOTE)
            << braid_comm_get_last_error(comm);
        const std::string msg = braid_comm_get_last_error(comm);
        EXPECT_TRUE(contains(msg.c_str(), "recv (any source)")) << msg;
        EXPECT_TRUE(contains(msg.c_str(), "every rank it could receive from is gone")) << msg;
      },
      60);
  expect_survivors_exited(result, 2);
}

// A peer that reported a failure fails a receive from any source at once,
// though another peer lives on.
TEST_P(FailureTransports, AReceiveFromAnySourceFailsWhenAPeerFails) {
  auto result = launch(
      3, detection_env(GetParam()),
      [](braid_comm_t comm, int rank, int) {
        int32_t v = 0;
        if (rank == 2) {
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
          EXPECT_EQ(braid_comm_abort(comm), BRAID_SUCCESS);
          // Lives on (a rank whose communicator failed), then leaves
          // without the launcher's destroy of the released handle.
          std::this_thread::sleep_for(std::chrono::seconds(3));
          _exit(::testing::Test::HasFailure() ? 1 : 0);
        }
        if (rank == 1) {
          // Sends nothing; learns of rank 0's failure.
          EXPECT_NE(braid_recv(&v, 1, BRAID_INT32, 0, comm, nullptr), BRAID_SUCCESS);
          return;
        }
        // Fails while rank 1 lives: waiting for every peer to go would
        // hang (rank 1 waits for rank 0's failure), and the launcher says so.
        int source = -1;
        const braid_result_t r = braid_recv_any(&v, 1, BRAID_INT32, &source, comm, nullptr);
        EXPECT_NE(r, BRAID_SUCCESS);
        EXPECT_NE(r, BRAID_ERR_TIMEOUT);
        const std::string msg = braid_comm_get_last_error(comm);
        EXPECT_TRUE(contains(msg.c_str(), "recv (any source)")) << msg;
        EXPECT_TRUE(contains(msg.c_str(), "rank 2")) << msg;
        EXPECT_FALSE(contains(msg.c_str(), "timed out")) << msg;
      },
      60);
  expect_survivors_exited(result, 3);
}

// Steady traffic with one peer keeps the driver busy (a spin of a second:
// it never sleeps): a receive from a peer that died still fails, within
// the check interval, not at the deadline.
TEST_P(FailureTransports, SteadyTrafficDoesNotHideADeadPeer) {
  Env env = detection_env(GetParam());
  env.push_back({"BRAID_SPIN_US", "1000000"});
  auto result = launch(
      3, env,
      [](braid_comm_t comm, int rank, int) {
        if (rank == 2) raise(SIGKILL);
        const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        int32_t v = 0;
        braid_result_t r = BRAID_SUCCESS;
        if (rank == 1) {
          while (r == BRAID_SUCCESS && std::chrono::steady_clock::now() < give_up) {
            r = braid_recv(&v, 1, BRAID_INT32, 0, comm, nullptr);
            if (r == BRAID_SUCCESS) r = braid_send(&v, 1, BRAID_INT32, 0, comm, nullptr);
          }
          EXPECT_NE(r, BRAID_SUCCESS) << "rank 0's failure never reached rank 1";
          return;
        }
        braid_request_t from_dead = nullptr;
        int32_t lost = 0;
        BRAID_ASSERT_OK(braid_irecv(&lost, 1, BRAID_INT32, 2, comm, nullptr, &from_dead));
        long rounds = 0;
        while (r == BRAID_SUCCESS && std::chrono::steady_clock::now() < give_up) {
          r = braid_send(&v, 1, BRAID_INT32, 1, comm, nullptr);
          if (r == BRAID_SUCCESS) r = braid_recv(&v, 1, BRAID_INT32, 1, comm, nullptr);
          ++rounds;
        }
        EXPECT_EQ(r, BRAID_ERR_REMOTE)
            << "after " << rounds << " round trips: " << braid_comm_get_last_error(comm);
        EXPECT_EQ(braid_wait(&from_dead), BRAID_ERR_REMOTE);
        const std::string msg = braid_comm_get_last_error(comm);
        EXPECT_TRUE(contains(msg.c_str(), "rank 2 (")) << msg;
      },
      60);
  expect_survivors_exited(result, 2);
}

// Two ranks: rank 1 stays alive for `peer_seconds` without calling braid;
// rank 0 runs `body`, whose calls wait for rank 1.
void with_absent_peer(const std::string& transport, const Env& extra, int peer_seconds,
                      const std::function<void(braid_comm_t)>& body) {
  Env env = transport_env(transport);
  env.insert(env.end(), extra.begin(), extra.end());
  run_ranks(2, env, [&](braid_comm_t comm, int rank, int) {
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::seconds(peer_seconds));
      return;
    }
    body(comm);
  });
}

TEST_P(FailureTransports, AbsentPeerTimesOutNamingOperationAndPeer) {
  // Rank 1 stays alive but never joins the collective.
  with_absent_peer(GetParam(), {{"BRAID_DEBUG", "INFO"}}, 2, [&](braid_comm_t comm) {
    // Capture this rank's log to check the pending-operation report.
    char path[] = "/tmp/braid-failure-test-XXXXXX";
    int fd = mkstemp(path);
    ASSERT_GE(fd, 0);
    int saved = dup(STDERR_FILENO);
    dup2(fd, STDERR_FILENO);
    BRAID_ASSERT_OK(braid_comm_set_timeout(comm, 0.5));
    float x = 1;
    braid_result_t r = braid_all_reduce(&x, &x, 1, BRAID_FLOAT32, BRAID_SUM, comm, nullptr);
    dup2(saved, STDERR_FILENO);
    EXPECT_EQ(r, BRAID_ERR_TIMEOUT);
    const char* msg = braid_comm_get_last_error(comm);
    EXPECT_TRUE(contains(msg, "all_reduce #0")) << msg;
    EXPECT_TRUE(contains(msg, "rank 1")) << msg;
    std::string log(4096, '\0');
    log.resize(static_cast<size_t>(std::max<ssize_t>(0, pread(fd, log.data(), log.size(), 0))));
    close(fd);
    unlink(path);
    EXPECT_TRUE(contains(log.c_str(), "DUMP timed out: 1 operation(s) in flight")) << log;
    // The algorithm is the tuner's (direct over shm, rd over tcp).
    EXPECT_TRUE(contains(log.c_str(), GetParam() == "shm"
                                          ? "all_reduce #0 (direct, 4 bytes): step 1, running for"
                                          : "all_reduce #0 (rd, 4 bytes): step 1, running for"))
        << log;
    EXPECT_TRUE(contains(log.c_str(), "waiting for a message from rank 1")) << log;
  });
}

struct FailureLog {
  std::atomic<int> calls{0};
  std::atomic<int> result{-1};
  std::string message;
};

TEST_P(FailureTransports, CallbackReportsATimeoutWithoutAWaiter) {
  with_absent_peer(GetParam(), {{"BRAID_DEBUG", "NONE"}}, 2, [](braid_comm_t comm) {
    BRAID_ASSERT_OK(braid_comm_set_timeout(comm, 0.3));
    FailureLog log;
    float x = 1;
    braid_request_t req = nullptr;
    BRAID_ASSERT_OK(braid_iall_reduce(&x, &x, 1, BRAID_FLOAT32, BRAID_SUM, comm, nullptr, &req));
    BRAID_ASSERT_OK(braid_request_set_callback(
        req,
        [](void* user, braid_result_t result, const char* message) {
          auto* l = static_cast<FailureLog*>(user);
          l->message = message;
          l->result.store(result);
          l->calls.fetch_add(1);
        },
        &log));
    for (int i = 0; i < 1000 && log.calls.load() == 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ASSERT_EQ(log.calls.load(), 1) << "no callback for an operation past its deadline";
    EXPECT_EQ(log.result.load(), BRAID_ERR_TIMEOUT);
    EXPECT_TRUE(contains(log.message.c_str(), "all_reduce")) << log.message;
    EXPECT_TRUE(contains(log.message.c_str(), "rank 1")) << log.message;
    EXPECT_EQ(braid_wait(&req), BRAID_ERR_TIMEOUT);
  });
}

// Rank 0 runs `waits` (a call that waits for rank 1, which sleeps) while
// another thread aborts its communicator 200 ms in: the call must return
// BRAID_ERR_ABORTED then, not at the 60 s deadline.
void abort_while_waiting(const std::string& transport, void (*waits)(braid_comm_t)) {
  with_absent_peer(transport, {{"BRAID_DEBUG", "NONE"}, {"BRAID_TIMEOUT", "60"}}, 1,
                   [waits](braid_comm_t comm) {
                     std::thread aborter([comm] {
                       std::this_thread::sleep_for(std::chrono::milliseconds(200));
                       EXPECT_EQ(braid_comm_abort(comm), BRAID_SUCCESS);
                     });
                     const auto start = std::chrono::steady_clock::now();
                     waits(comm);
                     EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
                     EXPECT_TRUE(contains(braid_get_last_error(), "aborted by braid_comm_abort"))
                         << braid_get_last_error();
                     aborter.join();
                     // Abort released the handle: the launcher's destroy must fail cleanly, so
                     // make a fresh communicator-less exit path instead.
                     _exit(::testing::Test::HasFailure() ? 1 : 0);
                   });
}

// A peer's abort that reaches a rank with nothing in flight (over tcp the
// progress thread reads it at once) fails its next call, which the message
// names ("rank 1: all_reduce #0: rank 0 ... aborted"; it began with the
// peer before).
TEST_P(FailureTransports, APeersAbortNamesTheCallItFails) {
  auto result = launch(
      2, detection_env(GetParam()),
      [](braid_comm_t comm, int rank, int) {
        if (rank == 0) {
          usleep(300 * 1000);
          EXPECT_EQ(braid_comm_abort(comm), BRAID_SUCCESS);
          usleep(1000 * 1000);
          _exit(::testing::Test::HasFailure() ? 1 : 0);  // the handle is gone: no destroy
        }
        usleep(1000 * 1000);
        float x = 1;
        EXPECT_EQ(braid_all_reduce(&x, &x, 1, BRAID_FLOAT32, BRAID_SUM, comm, nullptr), BRAID_ERR_ABORTED);
        const std::string msg = braid_get_last_error();
        EXPECT_EQ(msg.rfind("rank 1: all_reduce #0: ", 0), 0u) << msg;
        EXPECT_TRUE(contains(msg.c_str(), "aborted by braid_comm_abort")) << msg;
      },
      60);
  expect_survivors_exited(result, 2, 2);
}

// braid_comm_destroy waits for a receive nobody matches; an abort from
// another thread (a watchdog) cancels it, as braid.h promises of abort. The
// abort was refused before ("not a live communicator": destroy had let go
// of the handle), and destroy waited for the receive's deadline.
TEST_P(FailureTransports, AbortFromAnotherThreadEndsAWaitingDestroy) {
  with_absent_peer(GetParam(), {{"BRAID_DEBUG", "NONE"}, {"BRAID_TIMEOUT", "60"}}, 1, [](braid_comm_t comm) {
    float b[4];
    braid_request_t request = nullptr;
    BRAID_ASSERT_OK(braid_irecv(b, 4, BRAID_FLOAT32, 1, comm, nullptr, &request));
    braid_result_t aborted = BRAID_ERR_INTERNAL;
    std::thread watchdog([comm, &aborted] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      aborted = braid_comm_abort(comm);
    });
    EXPECT_EQ(braid_comm_destroy(comm), BRAID_SUCCESS);
    watchdog.join();
    EXPECT_EQ(aborted, BRAID_SUCCESS) << braid_get_last_error();
    EXPECT_EQ(braid_wait(&request), BRAID_ERR_ABORTED);
    EXPECT_EQ(braid_comm_abort(comm), BRAID_ERR_INVALID_ARGUMENT);  // once only
    _exit(::testing::Test::HasFailure() ? 1 : 0);  // the handle is gone: no destroy by the launcher
  });
}

TEST_P(FailureTransports, AbortFromAnotherThreadWakesTheWaiter) {
  abort_while_waiting(GetParam(), [](braid_comm_t comm) {
    float x = 1;
    EXPECT_EQ(braid_all_reduce(&x, &x, 1, BRAID_FLOAT32, BRAID_SUM, comm, nullptr), BRAID_ERR_ABORTED);
  });
}

// braid_comm_set_timeout around one call sets that call's deadline even
// while it waits in its lane behind an earlier op with a longer one (only
// the lane's front was checked: B returned after 6 s, when A's peer sent).
TEST_P(FailureTransports, AQueuedOpKeepsItsOwnDeadline) {
  with_absent_peer(GetParam(), {{"BRAID_DEBUG", "NONE"}}, 2, [](braid_comm_t comm) {
    float a = 0, b = 0;
    braid_request_t ra = nullptr, rb = nullptr;
    BRAID_ASSERT_OK(braid_comm_set_timeout(comm, 60));
    BRAID_ASSERT_OK(braid_irecv(&a, 1, BRAID_FLOAT32, 1, comm, nullptr, &ra));
    BRAID_ASSERT_OK(braid_comm_set_timeout(comm, 0.5));
    BRAID_ASSERT_OK(braid_irecv(&b, 1, BRAID_FLOAT32, 1, comm, nullptr, &rb));
    const auto start = std::chrono::steady_clock::now();
    EXPECT_EQ(braid_wait(&rb), BRAID_ERR_TIMEOUT);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(1800));
    EXPECT_TRUE(contains(braid_get_last_error(),
                         "recv #1 timed out: not done within the timeout of 0.5 s, queued "
                         "behind recv #0"))
        << braid_get_last_error();
    EXPECT_NE(braid_wait(&ra), BRAID_SUCCESS);
  });
}

// The same for a receive waiting unstarted behind a receive from any rank
// (which may still take its message): only started ops' deadlines were
// checked, so it waited for the any-source receive's 60 s. Rank 1 lives
// and sends nothing.
TEST_P(FailureTransports, AReceiveBehindAnAnySourceReceiveKeepsItsOwnDeadline) {
  with_absent_peer(GetParam(), {{"BRAID_DEBUG", "NONE"}}, 3, [](braid_comm_t comm) {
    float a = 0, b = 0;
    int source = -1;
    braid_request_t ra = nullptr, rb = nullptr;
    BRAID_ASSERT_OK(braid_comm_set_timeout(comm, 60));
    BRAID_ASSERT_OK(braid_irecv_any(&a, 1, BRAID_FLOAT32, &source, comm, nullptr, &ra));
    BRAID_ASSERT_OK(braid_comm_set_timeout(comm, 0.5));
    BRAID_ASSERT_OK(braid_irecv(&b, 1, BRAID_FLOAT32, 1, comm, nullptr, &rb));
    const auto start = std::chrono::steady_clock::now();
    EXPECT_EQ(braid_wait(&rb), BRAID_ERR_TIMEOUT) << braid_get_last_error();
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(1800));
    EXPECT_TRUE(
        contains(braid_get_last_error(),
                 "recv #1 timed out: not done within the timeout of 0.5 s, waiting to start, behind a "
                 "receive from any rank"))
        << braid_get_last_error();
    EXPECT_NE(braid_wait(&ra), BRAID_SUCCESS);
  });
}

// braid_comm_abort also ends a comm_split waiting on another thread for a
// peer (it timed out at the deadline: split talks over the bootstrap ring).
TEST_P(FailureTransports, AbortEndsACommSplitInProgress) {
  abort_while_waiting(GetParam(), [](braid_comm_t comm) {
    braid_comm_t part = nullptr;
    EXPECT_EQ(braid_comm_split(comm, 0, 0, &part), BRAID_ERR_ABORTED) << braid_get_last_error();
  });
}

// ... and once the exchange is over and the child is being set up: rank 1
// stops (SIGSTOP) inside its split, after sending its part of the exchange,
// so rank 0 finishes the exchange and waits for rank 1 in the child's
// setup, which the abort did not reach (the split timed out at its
// deadline: 120 s here, beyond the launcher's 60).
TEST_P(FailureTransports, AbortEndsTheSetupOfASplitsChild) {
  auto* pid1 = static_cast<std::atomic<pid_t>*>(
      mmap(nullptr, sizeof(std::atomic<pid_t>), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(pid1, MAP_FAILED);
  new (pid1) std::atomic<pid_t>(0);
  auto result = launch(
      2, detection_env(GetParam()),
      [pid1](braid_comm_t comm, int rank, int) {
        braid_comm_t part = nullptr;
        if (rank == 1) {
          pid1->store(getpid());
          // Rank 0 lets it go once it aborted: its own part then fails.
          EXPECT_NE(braid_comm_split(comm, 0, 0, &part), BRAID_SUCCESS);
          _exit(::testing::Test::HasFailure() ? 1 : 0);
        }
        while (pid1->load() == 0) usleep(1000);
        usleep(1000 * 1000);  // rank 1 has sent its part and waits for ours
        ASSERT_EQ(kill(pid1->load(), SIGSTOP), 0);
        std::thread watchdog([comm] {
          usleep(500 * 1000);
          EXPECT_EQ(braid_comm_abort(comm), BRAID_SUCCESS);
        });
        EXPECT_EQ(braid_comm_split(comm, 0, 0, &part), BRAID_ERR_ABORTED) << braid_get_last_error();
        EXPECT_TRUE(contains(braid_get_last_error(), "aborted by braid_comm_abort"))
            << braid_get_last_error();
        watchdog.join();
        kill(pid1->load(), SIGCONT);
        _exit(::testing::Test::HasFailure() ? 1 : 0);  // the handle is gone: no destroy
      },
      60);
  EXPECT_TRUE(result.ok()) << result.describe();
}

// `calls` makes the group's calls, one of them bad on rank 1 only, over
// `a` and `b` (which live until group_end, as a group's buffers must).
// Every rank's group_end must fail at once, rank 1's naming `refused`.
void expect_refused_group_fails(const std::string& transport,
                                const std::function<void(braid_comm_t, int, float*, float*)>& calls,
                                const char* refused, braid_result_t code = BRAID_ERR_INVALID_ARGUMENT) {
  Env env = transport_env(transport);
  env.push_back({"BRAID_DEBUG", "NONE"});
  env.push_back({"BRAID_TIMEOUT", "60"});
  run_ranks(2, env, [&](braid_comm_t comm, int rank, int) {
    const auto start = std::chrono::steady_clock::now();
    float a = 1, b = 2;
    BRAID_ASSERT_OK(braid_group_start());
    calls(comm, rank, &a, &b);
    const braid_result_t end = braid_group_end();
    const std::string msg = braid_get_last_error();
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20)) << "rank " << rank;
    if (rank == 1) {
      EXPECT_EQ(end, code) << msg;
      EXPECT_TRUE(contains(msg.c_str(), refused)) << msg;
    } else {
      EXPECT_NE(end, BRAID_SUCCESS) << msg;
      EXPECT_TRUE(contains(msg.c_str(), "rank 1")) << msg;
    }
  });
}

// A call a group refuses (a bad dtype on rank 1 only) fails the group:
// group_end returns the refusal, and since the group's other operation on
// the communicator is made, the communicator is aborted and rank 0 learns
// why at once (its group_end waited for the deadline before, and rank 1's
// returned success).
TEST_P(FailureTransports, ARefusedCallFailsItsGroupOnEveryRank) {
  expect_refused_group_fails(
      GetParam(),
      [](braid_comm_t comm, int rank, float* a, float* b) {
        braid_dtype_t second = BRAID_FLOAT32;
        if (rank == 1) {
          const int bad = 99;
          std::memcpy(&second, &bad, sizeof(bad));
        }
        EXPECT_EQ(braid_all_reduce(a, a, 1, BRAID_FLOAT32, BRAID_SUM, comm, nullptr), BRAID_SUCCESS);
        EXPECT_EQ(braid_all_reduce(b, b, 1, second, BRAID_SUM, comm, nullptr),
                  rank == 1 ? BRAID_ERR_INVALID_ARGUMENT : BRAID_SUCCESS);
      },
      "a call in this group was refused: rank 1: all_reduce");
}

// The same where the group holds small sends and receives, which make no
// ops until group_end (the bad call: a peer out of range).
TEST_P(FailureTransports, ARefusedCallFailsAGroupOfSendsOnEveryRank) {
  expect_refused_group_fails(
      GetParam(),
      [](braid_comm_t comm, int rank, float* a, float* b) {
        EXPECT_EQ(braid_send(a, 1, BRAID_FLOAT32, 1 - rank, comm, nullptr), BRAID_SUCCESS);
        EXPECT_EQ(braid_recv(b, 1, BRAID_FLOAT32, 1 - rank, comm, nullptr), BRAID_SUCCESS);
        EXPECT_EQ(braid_send(a, 1, BRAID_FLOAT32, rank == 1 ? 99 : 1, comm, nullptr),
                  rank == 1 ? BRAID_ERR_INVALID_ARGUMENT : BRAID_SUCCESS);
        EXPECT_EQ(braid_recv(b, 1, BRAID_FLOAT32, 1 - rank, comm, nullptr), BRAID_SUCCESS);
      },
      "a call in this group was refused: rank 1: send");
}

// The same where rank 1's refused call is stream-ordered: a stream with no
// CUDA driver in the process (this test loads none). Before, its refusal
// was not kept: rank 1's group_end returned success, and rank 0 waited for
// its deadline.
TEST_P(FailureTransports, ARefusedStreamOrderedCallFailsItsGroupToo) {
  expect_refused_group_fails(
      GetParam(),
      [](braid_comm_t comm, int rank, float* a, float* b) {
        void* stream = rank == 1 ? reinterpret_cast<void*>(uintptr_t{1}) : nullptr;  // the legacy stream
        EXPECT_EQ(braid_all_reduce(a, a, 1, BRAID_FLOAT32, BRAID_SUM, comm, stream),
                  rank == 1 ? BRAID_ERR_UNSUPPORTED : BRAID_SUCCESS);
        EXPECT_EQ(braid_send(b, 1, BRAID_FLOAT32, 1 - rank, comm, nullptr), BRAID_SUCCESS);
        EXPECT_EQ(braid_recv(b, 1, BRAID_FLOAT32, 1 - rank, comm, nullptr), BRAID_SUCCESS);
      },
      "a call in this group was refused: rank 1: all_reduce: stream is not NULL, but no CUDA driver",
      BRAID_ERR_UNSUPPORTED);
}

// The same where rank 1's call is refused before any op is made for it:
// all_to_allv without its receive displacements, an i-form without a place
// for its request, a handle that names no communicator (before, such
// refusals were not kept, and rank 1's group_end returned success).
TEST_P(FailureTransports, ACallRefusedBeforeItIsMadeFailsItsGroupToo) {
  static braid_request_t kept = nullptr;  // rank 0's request, waited for by no one (its group fails)
  const size_t zero[2] = {0, 0};
  const struct {
    std::function<braid_result_t(braid_comm_t, int, float*)> call;
    const char* refused;
  } cases[] = {
      {[&zero](braid_comm_t comm, int rank, float* b) {
         return braid_all_to_allv(b, zero, zero, b, zero, rank == 1 ? nullptr : zero, BRAID_FLOAT32, comm,
                                  nullptr);
       },
       "a call in this group was refused: rank 1: all_to_allv: rdispls is NULL"},
      {[](braid_comm_t comm, int rank, float* b) {
         return braid_iall_reduce(b, b, 1, BRAID_FLOAT32, BRAID_SUM, comm, nullptr,
                                  rank == 1 ? nullptr : &kept);
       },
       "a call in this group was refused: request is NULL"},
      {[](braid_comm_t comm, int rank, float* b) {
         braid_comm_t named = rank == 1 ? reinterpret_cast<braid_comm_t>(uintptr_t{0x5ca1ab1e0}) : comm;
         return braid_all_reduce(b, b, 1, BRAID_FLOAT32, BRAID_SUM, named, nullptr);
       },
       "a call in this group was refused: all_reduce: comm 0x5ca1ab1e0 is not a live communicator"},
  };
  for (const auto& c : cases) {
    expect_refused_group_fails(
        GetParam(),
        [&c](braid_comm_t comm, int rank, float* a, float* b) {
          EXPECT_EQ(braid_all_reduce(a, a, 1, BRAID_FLOAT32, BRAID_SUM, comm, nullptr), BRAID_SUCCESS);
          EXPECT_EQ(c.call(comm, rank, b), rank == 1 ? BRAID_ERR_INVALID_ARGUMENT : BRAID_SUCCESS);
        },
        c.refused);
  }
}

// A grouped receive whose message has another size fails with
// BRAID_ERR_MISMATCH and writes nothing; the group's next receive from that
// peer does not take the message in its place (small messages, which the
// group may receive without ops).
TEST_P(FailureTransports, AGroupedReceiveOfAnotherSizeIsReportedNotSkipped) {
  Env env = transport_env(GetParam());
  env.push_back({"BRAID_DEBUG", "NONE"});
  env.push_back({"BRAID_TIMEOUT", "30"});
  run_ranks(2, env, [](braid_comm_t comm, int rank, int) {
    std::vector<float> four = {1, 2, 3, 4}, two(2, -1.0f), other(4, -1.0f);
    if (rank == 0) {
      BRAID_ASSERT_OK(braid_group_start());
      BRAID_ASSERT_OK(braid_send(four.data(), 4, BRAID_FLOAT32, 1, comm, nullptr));
      BRAID_ASSERT_OK(braid_group_end());
      // Stays until rank 1 has seen the message (a rank gone would be
      // reported instead).
      braid_barrier(comm, nullptr);
      return;
    }
    BRAID_ASSERT_OK(braid_group_start());
    BRAID_ASSERT_OK(braid_recv(two.data(), 2, BRAID_FLOAT32, 0, comm, nullptr));
    BRAID_ASSERT_OK(braid_recv(other.data(), 4, BRAID_FLOAT32, 0, comm, nullptr));
    const braid_result_t end = braid_group_end();
    const std::string msg = braid_comm_get_last_error(comm);
    EXPECT_EQ(end, BRAID_ERR_MISMATCH) << msg;
    EXPECT_TRUE(contains(msg.c_str(), "16 bytes")) << msg;
    EXPECT_EQ(two, std::vector<float>(2, -1.0f));
    EXPECT_EQ(other, std::vector<float>(4, -1.0f)) << "the second receive took the first one's message";
    braid_barrier(comm, nullptr);
  });
}

// A rank that failed but lives on (its communicator aborted while requests
// still hold it) no longer reads its sockets. A peer blocked sending to it
// fails at once, though the failed rank's abort frame could not go out
// behind messages the peer had not received (with a half-close it waited
// until the failed rank exited, or for its own timeout).
TEST(TcpFailure, ASenderBlockedOnAFailedLivePeerFailsAtOnce) {
  Env env = transport_env("tcp");
  env.push_back({"BRAID_TIMEOUT", "30"});
  env.push_back({"BRAID_DEBUG", "NONE"});
  run_ranks(2, env, [](braid_comm_t comm, int rank, int) {
    const size_t big = 64u << 20;  // more than both socket buffers hold
    std::vector<char> buf(big, 1);
    if (rank == 1) {
      // Messages rank 0 never receives: they fill its slots and its socket.
      std::vector<braid_request_t> reqs(2, nullptr);
      for (auto& r : reqs) BRAID_EXPECT_OK(braid_isend(buf.data(), big, BRAID_UINT8, 0, comm, nullptr, &r));
      std::this_thread::sleep_for(std::chrono::seconds(1));
      EXPECT_EQ(braid_comm_abort(comm), BRAID_SUCCESS);
      std::this_thread::sleep_for(std::chrono::seconds(4));
      _exit(::testing::Test::HasFailure() ? 1 : 0);
    }
    // Blocks: rank 1 never receives it.
    const auto start = std::chrono::steady_clock::now();
    const braid_result_t r = braid_send(buf.data(), big, BRAID_UINT8, 1, comm, nullptr);
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_NE(r, BRAID_SUCCESS);
    EXPECT_LT(took, 3.0) << "the send waited " << took << " s: " << braid_get_last_error();
    EXPECT_TRUE(contains(braid_get_last_error(), "rank 1")) << braid_get_last_error();
    EXPECT_TRUE(contains(braid_get_last_error(), "failed or exited")) << braid_get_last_error();
    _exit(::testing::Test::HasFailure() ? 1 : 0);
  });
}

// Every message carries its call's tag, so a rank that receives bytes sent
// by a different call fails with BRAID_ERR_MISMATCH naming both calls, and
// its peers report the same code, without BRAID_CHECK_CALLS.
void expect_mismatch(braid_comm_t comm, braid_result_t r, const std::vector<std::string>& named) {
  EXPECT_EQ(r, BRAID_ERR_MISMATCH) << braid_comm_get_last_error(comm);
  const std::string msg = braid_comm_get_last_error(comm);
  EXPECT_TRUE(contains(msg.c_str(), "call mismatch")) << msg;
  for (const std::string& s : named)
    EXPECT_TRUE(contains(msg.c_str(), s)) << "missing '" << s << "' in: " << msg;
}

TEST_P(FailureTransports, MismatchedCountsAreReported) {
  Env env = transport_env(GetParam());
  env.push_back({"BRAID_DEBUG", "NONE"});
  run_ranks(2, env, [](braid_comm_t comm, int rank, int) {
    std::vector<float> buf(20, 1.0f);
    size_t count = rank == 0 ? 10 : 20;
    expect_mismatch(comm,
                    braid_all_reduce(buf.data(), buf.data(), count, BRAID_FLOAT32, BRAID_SUM, comm, nullptr),
                    {"all_reduce #0 (count 10, float32, sum)", "all_reduce #0 (count 20, float32, sum)"});
  });
  // Where ranks write into each other's buffers (peer reads on shm): the
  // counts are compared before any byte moves, so the rank with the smaller
  // count keeps everything past its buffer.
  env.push_back({"BRAID_ALGO", "all_reduce:peer_read;broadcast:peer_read"});
  run_ranks(2, env, [](braid_comm_t comm, int rank, int) {
    const size_t small = 70000, large = 140000, count = rank == 0 ? small : large;
    std::vector<float> buf(large, 2.0f);
    expect_mismatch(
        comm, braid_all_reduce(buf.data(), buf.data(), count, BRAID_FLOAT32, BRAID_SUM, comm, nullptr),
        {"all_reduce #0 (count 70000, float32, sum)", "all_reduce #0 (count 140000, float32, sum)"});
    if (rank == 0) {
      for (size_t i = small; i < large; ++i) ASSERT_EQ(buf[i], 2.0f) << i;
    }
  });
  // A small broadcast's root is done once its message is sent (inline,
  // on shm): the receiver finds the count differs.
  run_ranks(2, env, [](braid_comm_t comm, int rank, int) {
    std::vector<float> buf(5, static_cast<float>(rank));
    const braid_result_t r =
        braid_broadcast(buf.data(), buf.data(), rank == 0 ? 3 : 5, BRAID_FLOAT32, 0, comm, nullptr);
    if (rank == 0) {
      EXPECT_TRUE(r == BRAID_SUCCESS || r == BRAID_ERR_MISMATCH) << braid_comm_get_last_error(comm);
      return;
    }
    expect_mismatch(comm, r,
                    {"broadcast #0 (count 3, float32, root 0)", "broadcast #0 (count 5, float32, root 0)"});
    for (float v : buf) EXPECT_EQ(v, 1.0f);
  });
  // (Over tcp the broadcast is a chain, whose root may finish sending
  // before the receiver sees the mismatch.)
  if (std::string(GetParam()) != "shm") return;
  run_ranks(2, env, [](braid_comm_t comm, int rank, int) {
    const size_t small = 70000, large = 140000, count = rank == 0 ? small : large;
    std::vector<float> buf(large, static_cast<float>(rank));
    expect_mismatch(
        comm, braid_broadcast(buf.data(), buf.data(), count, BRAID_FLOAT32, 1, comm, nullptr),
        {"broadcast #0 (count 70000, float32, root 1)", "broadcast #0 (count 140000, float32, root 1)"});
    if (rank == 0) {
      for (size_t i = 0; i < large; ++i) ASSERT_EQ(buf[i], 0.0f) << i;
    }
  });
}

// The last call of a job, with nothing after it to see that ranks
// disagreed, returned wrong data silently: here each rank believes it is
// broadcast's root, or a send has no receive. braid_comm_destroy finds the
// message no call took (rank 1 destroys once rank 0's destroy returned, so
// that rank 0's message has arrived) and fails, naming it.
TEST_P(FailureTransports, DestroyNamesAMessageNoCallTook) {
  Env env = transport_env(GetParam());
  env.push_back({"BRAID_DEBUG", "NONE"});
  auto* destroyed = static_cast<std::atomic<int>*>(
      mmap(nullptr, sizeof(std::atomic<int>), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(destroyed, MAP_FAILED);
  const auto destroy_in_turn = [destroyed](braid_comm_t comm, int rank,
                                           const std::vector<std::string>& named) {
    if (rank == 0) {
      const braid_result_t r = braid_comm_destroy(comm);
      EXPECT_TRUE(r == BRAID_SUCCESS || r == BRAID_ERR_MISMATCH) << braid_get_last_error();
      destroyed->store(1);
    } else {
      while (destroyed->load() == 0) usleep(1000);
      EXPECT_EQ(braid_comm_destroy(comm), BRAID_ERR_MISMATCH);
      const std::string msg = braid_get_last_error();
      for (const std::string& s : named)
        EXPECT_TRUE(contains(msg.c_str(), s)) << "missing '" << s << "' in: " << msg;
    }
    _exit(::testing::Test::HasFailure() ? 1 : 0);  // destroyed: not again by the launcher
  };
  new (destroyed) std::atomic<int>(0);
  run_ranks(2, env, [&](braid_comm_t comm, int rank, int) {
    std::vector<float> buf(4, static_cast<float>(rank));
    BRAID_ASSERT_OK(braid_broadcast(buf.data(), buf.data(), 4, BRAID_FLOAT32, rank, comm, nullptr));
    destroy_in_turn(comm, rank,
                    {"rank 1: comm_destroy: rank 0 sent a message of broadcast #0 (count 4, float32, root 0) "
                     "that no call on this rank took",
                     "a root that differs between ranks"});
  });
  new (destroyed) std::atomic<int>(0);
  run_ranks(2, env, [&](braid_comm_t comm, int rank, int) {
    float x[3] = {1, 2, 3};
    if (rank == 0) {
      BRAID_ASSERT_OK(braid_send_tagged(x, 3, BRAID_FLOAT32, 1, 7, comm, nullptr));
    }
    destroy_in_turn(comm, rank,
                    {"rank 0 sent a message of send/recv with tag 7 of 12 bytes", "a send with no receive"});
  });
  // A send to itself that no receive took (read from the self connection).
  run_ranks(2, env, [](braid_comm_t comm, int rank, int) {
    float x[2] = {1, 2};
    if (rank == 0) {
      BRAID_ASSERT_OK(braid_send_tagged(x, 2, BRAID_FLOAT32, 0, 9, comm, nullptr));
      EXPECT_EQ(braid_comm_destroy(comm), BRAID_ERR_MISMATCH);
      EXPECT_TRUE(contains(
          braid_get_last_error(),
          "rank 0: comm_destroy: this rank sent itself a message of send/recv with tag 9 of 8 bytes"))
          << braid_get_last_error();
    } else {
      EXPECT_EQ(braid_comm_destroy(comm), BRAID_SUCCESS) << braid_get_last_error();
    }
    _exit(::testing::Test::HasFailure() ? 1 : 0);
  });
  munmap(destroyed, sizeof(std::atomic<int>));
}

TEST_P(FailureTransports, MismatchedCallsFailWithoutCheckCalls) {
  Env env = transport_env(GetParam());
  env.push_back({"BRAID_DEBUG", "NONE"});
  // Another dtype.
  run_ranks(2, env, [](braid_comm_t comm, int rank, int) {
    std::vector<double> v(8, 1.0);
    expect_mismatch(comm,
                    braid_all_reduce(v.data(), v.data(), rank == 0 ? 16 : 8,
                                     rank == 0 ? BRAID_FLOAT32 : BRAID_FLOAT64, BRAID_SUM, comm, nullptr),
                    {"all_reduce #0 (count 16, float32, sum)", "all_reduce #0 (count 8, float64, sum)"});
  });
  // Another collective, after matching ones; the wrong messages sit where no
  // rank reads them, so the engine's watch of waiting messages reports (long
  // before this timeout).
  env.push_back({"BRAID_TIMEOUT", "60"});
  run_ranks(3, env, [](braid_comm_t comm, int rank, int) {
    int x = rank;
    BRAID_ASSERT_OK(braid_all_reduce(&x, &x, 1, BRAID_INT32, BRAID_SUM, comm, nullptr));
    EXPECT_EQ(x, 3);
    std::vector<float> in(4, 1.0f), out(12, 0.0f);
    const braid_result_t r =
        rank == 1 ? braid_all_gather(in.data(), out.data(), 4, BRAID_FLOAT32, comm, nullptr)
                  : braid_all_reduce(in.data(), in.data(), 4, BRAID_FLOAT32, BRAID_MAX, comm, nullptr);
    expect_mismatch(comm, r, {"all_gather #1 (count 4, float32)", "all_reduce #1 (count 4, float32, max)"});
  });
  // One more call on one rank (a count-0 all_reduce moves no data): the
  // calls after it differ only in their sequence numbers.
  run_ranks(2, env, [](braid_comm_t comm, int rank, int) {
    std::vector<int64_t> v(3, 1);
    if (rank == 0) {
      BRAID_ASSERT_OK(braid_all_reduce(v.data(), v.data(), 0, BRAID_INT64, BRAID_SUM, comm, nullptr));
    }
    expect_mismatch(comm, braid_all_reduce(v.data(), v.data(), 3, BRAID_INT64, BRAID_SUM, comm, nullptr),
                    {"all_reduce #1 (count 3, int64, sum)", "all_reduce #0 (count 3, int64, sum)"});
  });
  // Roots that differ, where each rank thinks it is the root: no rank reads
  // the other's message, so the broadcast itself succeeds; the next call
  // finds the unread message of a finished call and fails.
  run_ranks(2, env, [](braid_comm_t comm, int rank, int) {
    std::vector<float> v(5, static_cast<float>(rank));
    BRAID_ASSERT_OK(braid_broadcast(v.data(), v.data(), 5, BRAID_FLOAT32, rank, comm, nullptr));
    EXPECT_EQ(v[0], static_cast<float>(rank));
    expect_mismatch(comm, braid_barrier(comm, nullptr),
                    {"barrier #1", "broadcast #0 (count 5, float32, root "});
  });
  // Counts that only the receiver can check (all_to_allv's differ by rank).
  run_ranks(2, env, [](braid_comm_t comm, int rank, int) {
    std::vector<int32_t> in(8, rank), out(8, -1);
    const size_t sc[2] = {4, 4}, sd[2] = {0, 4};
    const size_t rc[2] = {4, rank == 0 ? size_t{3} : size_t{4}}, rd[2] = {0, 4};
    const braid_result_t r =
        braid_all_to_allv(in.data(), sc, sd, out.data(), rc, rd, BRAID_INT32, comm, nullptr);
    // Rank 1 got what it expected; it fails only if rank 0's error reaches it first.
    if (rank == 1 && r == BRAID_SUCCESS) return;
    EXPECT_EQ(r, BRAID_ERR_MISMATCH) << braid_comm_get_last_error(comm);
    if (rank == 0) {
      EXPECT_TRUE(
          contains(braid_comm_get_last_error(comm), "sent a block of 16 bytes where 12 were expected"))
          << braid_comm_get_last_error(comm);
    }
  });
}

// A message or all_to_allv block a whole number of pieces longer than its
// receiver expects fails there, naming both sizes: its pieces lined up with
// the ones expected, the receive succeeded short, and the rest was taken as
// the next message (or the receiver waited for a piece that never came).
TEST_P(FailureTransports, SizesThatDifferByWholePiecesAreReported) {
  Env env = transport_env(GetParam());
  env.push_back({"BRAID_DEBUG", "NONE"});
  env.push_back({"BRAID_SHM_SLOT_BYTES", "4096"});
  env.push_back({"BRAID_TCP_SLOT_BYTES", "4096"});
  env.push_back({"BRAID_TIMEOUT", "30"});
  for (bool shorter : {true, false}) {
    run_ranks(2, env, [shorter](braid_comm_t comm, int rank, int) {
      std::vector<int32_t> buf(2048, rank == 0 ? 5 : -1);
      const size_t sent = shorter ? 1025 : 1024, expected = shorter ? 1024 : 1025;
      if (rank == 0) {
        BRAID_EXPECT_OK(braid_send(buf.data(), sent, BRAID_INT32, 1, comm, nullptr));
        int32_t next = 42;
        braid_send(&next, 1, BRAID_INT32, 1, comm, nullptr);  // fails where the peer's failure is seen first
        return;
      }
      EXPECT_EQ(braid_recv(buf.data(), expected, BRAID_INT32, 0, comm, nullptr), BRAID_ERR_MISMATCH);
      const std::string want = "rank 0 sent a message of " + std::to_string(4 * sent) + " bytes where " +
                               std::to_string(4 * expected) + " were expected";
      EXPECT_TRUE(contains(braid_comm_get_last_error(comm), want.c_str())) << braid_comm_get_last_error(comm);
    });
    // all_to_allv: rank 0's block for rank 1 against rank 1's count for it.
    run_ranks(2, env, [shorter](braid_comm_t comm, int rank, int) {
      const size_t sent = shorter ? 1025 : 1024, expected = shorter ? 1024 : 1025;
      std::vector<int32_t> in(2050, rank), out(2050, -1);
      const size_t sc0[2] = {1, sent}, sd0[2] = {0, 1}, rc0[2] = {1, 1}, rd0[2] = {0, 1};
      const size_t sc1[2] = {1, 1}, sd1[2] = {0, 1}, rc1[2] = {expected, 1}, rd1[2] = {0, expected};
      const braid_result_t r =
          rank == 0
              ? braid_all_to_allv(in.data(), sc0, sd0, out.data(), rc0, rd0, BRAID_INT32, comm, nullptr)
              : braid_all_to_allv(in.data(), sc1, sd1, out.data(), rc1, rd1, BRAID_INT32, comm, nullptr);
      if (rank == 0) return;  // its own receives were right
      EXPECT_EQ(r, BRAID_ERR_MISMATCH) << braid_comm_get_last_error(comm);
      const std::string want = "rank 0 sent a block of " + std::to_string(4 * sent) + " bytes where " +
                               std::to_string(4 * expected) + " were expected";
      EXPECT_TRUE(contains(braid_comm_get_last_error(comm), want.c_str())) << braid_comm_get_last_error(comm);
    });
  }
}

// Sends and receives done inline (small, over shm) count in the numbers that
// errors give later calls: the fourth receive is recv #3 (it was #0).
TEST(Failure, InlineReceivesCountInTheNumbersOfLaterOnes) {
  run_ranks(2, {{"BRAID_TRANSPORT", "shm"}, {"BRAID_TIMEOUT", "1"}, {"BRAID_DEBUG", "NONE"}},
            [](braid_comm_t comm, int rank, int) {
              int32_t v = 7;
              for (int k = 0; k < 3; ++k) {
                BRAID_ASSERT_OK(rank == 0 ? braid_send(&v, 1, BRAID_INT32, 1, comm, nullptr)
                                          : braid_recv(&v, 1, BRAID_INT32, 0, comm, nullptr));
              }
              if (rank == 0) {
                sleep(2);  // sends no fourth message
                return;
              }
              EXPECT_EQ(braid_recv(&v, 1, BRAID_INT32, 0, comm, nullptr), BRAID_ERR_TIMEOUT);
              EXPECT_TRUE(contains(braid_comm_get_last_error(comm), "recv #3 timed out"))
                  << braid_comm_get_last_error(comm);
            });
}

// BRAID_CHECK_CALLS=1: different collectives, dtypes or roots at the same
// sequence number fail on every rank, naming both sides, before data moves.
TEST_P(FailureTransports, CheckCallsNamesBothSidesOfAMismatch) {
  Env env = transport_env(GetParam());
  env.push_back({"BRAID_CHECK_CALLS", "1"});
  env.push_back({"BRAID_DEBUG", "NONE"});
  run_ranks(3, env, [](braid_comm_t comm, int rank, int) {
    // Matching calls run as usual.
    float x = static_cast<float>(rank + 1);
    BRAID_ASSERT_OK(braid_all_reduce(&x, &x, 1, BRAID_FLOAT32, BRAID_SUM, comm, nullptr));
    EXPECT_EQ(x, 6.0f);
    BRAID_ASSERT_OK(braid_barrier(comm, nullptr));
    std::vector<float> v(8, 1.0f);
    const braid_result_t r =
        rank == 2 ? braid_broadcast(v.data(), v.data(), 8, BRAID_FLOAT32, 1, comm, nullptr)
                  : braid_all_reduce(v.data(), v.data(), 8, BRAID_FLOAT32, BRAID_SUM, comm, nullptr);
    EXPECT_EQ(r, BRAID_ERR_MISMATCH) << braid_get_last_error();
    const std::string msg = braid_get_last_error();
    EXPECT_TRUE(contains(msg.c_str(), "(BRAID_CHECK_CALLS)")) << msg;
    if (rank == 2) {
      EXPECT_TRUE(contains(msg.c_str(),
                           "rank 2 called broadcast #2 (count 8, float32, root 1), rank 0 called "
                           "all_reduce #2 (count 8, float32, sum)"))
          << msg;
    } else {
      EXPECT_TRUE(contains(msg.c_str(), "rank " + std::to_string(rank) +
                                            " called all_reduce #2 (count 8, float32, sum), rank 2 called "
                                            "broadcast #2 (count 8, float32, root 1)"))
          << msg;
    }
  });
  run_ranks(2, env, [](braid_comm_t comm, int rank, int) {
    std::vector<double> v(4, 1.0);
    const braid_result_t r = braid_reduce(v.data(), v.data(), 4, rank == 0 ? BRAID_FLOAT64 : BRAID_INT64,
                                          BRAID_MAX, 0, comm, nullptr);
    EXPECT_EQ(r, BRAID_ERR_MISMATCH) << braid_get_last_error();
    EXPECT_TRUE(contains(braid_get_last_error(),
                         rank == 0 ? "rank 1 called reduce #0 (count 4, int64, max, root 0)"
                                   : "rank 0 called reduce #0 (count 4, float64, max, root 0)"))
        << braid_get_last_error();
  });
  // A count of 0 on one rank only (a call the others' data never reaches)
  // and a different root are found too.
  run_ranks(2, env, [](braid_comm_t comm, int rank, int) {
    std::vector<float> v(8, 1.0f);
    braid_result_t r =
        braid_all_reduce(v.data(), v.data(), rank == 0 ? 0 : 8, BRAID_FLOAT32, BRAID_SUM, comm, nullptr);
    EXPECT_EQ(r, BRAID_ERR_MISMATCH) << braid_get_last_error();
    EXPECT_TRUE(contains(braid_get_last_error(), rank == 0 ? "rank 1 called all_reduce #0 (count 8,"
                                                           : "rank 0 called all_reduce #0 (count 0,"))
        << braid_get_last_error();
  });
  run_ranks(2, env, [](braid_comm_t comm, int rank, int) {
    std::vector<float> v(8, 1.0f);
    const braid_result_t r = braid_broadcast(v.data(), v.data(), 8, BRAID_FLOAT32, rank, comm, nullptr);
    EXPECT_EQ(r, BRAID_ERR_MISMATCH) << braid_get_last_error();
    EXPECT_TRUE(contains(braid_get_last_error(), rank == 0 ? "root 1)" : "root 0)"))
        << braid_get_last_error();
  });
}

// A grouped send of 16 KiB and up on shm offers its buffer for the
// receiver to read (ShmPeerReads in collectives_test).
braid_result_t offer(const void* buf, size_t bytes, int peer, braid_comm_t comm, braid_request_t* req) {
  braid_result_t r = braid_group_start();
  if (r == BRAID_SUCCESS) r = braid_isend(buf, bytes, BRAID_UINT8, peer, comm, nullptr, req);
  const braid_result_t end = braid_group_end();
  return r != BRAID_SUCCESS ? r : end;
}

// Sends offer their buffers whatever the init probe would find (where
// reading peers lost to slots there, sends take the slots).
const Env kShmDetection = {
    {"BRAID_TRANSPORT", "shm"}, {"BRAID_DEBUG", "NONE"}, {"BRAID_TIMEOUT", "120"}, {"BRAID_TUNE_PROBE", "0"}};

// A receive of another size fails, on the receiver with both sizes named,
// on the sender (which waits for the read) with the receiver's failure: no
// hang, no partial data.
TEST(ShmPeerReadFailures, SizesThatDifferAreReported) {
  struct Case {
    size_t recv_count;
    const char* named;
  };
  // The receiver expects another large message (it looks for an offer), or
  // a small one (it takes the offer for the data's first piece).
  for (Case c :
       {Case{size_t{1} << 18, "rank 0 sent 1048576 bytes where 262144 were expected"},
        Case{1000,
             "rank 0 sent it a message of send/recv of 1048576 bytes (a buffer offered to be read in "
             "place)"}}) {
    run_ranks(2, kShmDetection, [c](braid_comm_t comm, int rank, int) {
      std::vector<uint8_t> buf(size_t{1} << 20, 7);
      if (rank == 0) {
        braid_request_t req;
        BRAID_ASSERT_OK(offer(buf.data(), buf.size(), 1, comm, &req));
        EXPECT_EQ(braid_wait(&req), BRAID_ERR_MISMATCH) << braid_comm_get_last_error(comm);
        return;
      }
      std::fill(buf.begin(), buf.end(), 0);
      EXPECT_EQ(braid_recv(buf.data(), c.recv_count, BRAID_UINT8, 0, comm, nullptr), BRAID_ERR_MISMATCH);
      const std::string msg = braid_comm_get_last_error(comm);
      EXPECT_TRUE(contains(msg.c_str(), c.named)) << msg;
      EXPECT_EQ(std::count(buf.begin(), buf.end(), 0), static_cast<long>(buf.size()))
          << "data arrived anyway";
    });
  }
}

// A sender waiting for its buffer to be read learns that its receiver died
// (rank 0 offers to rank 2), and a receiver whose sender died after
// offering fails its read (rank 2 offers to rank 1, then dies).
TEST(ShmPeerReadFailures, ADeadPeerFailsAnOfferedSend) {
  auto result = launch(
      3, kShmDetection,
      [](braid_comm_t comm, int rank, int) {
        std::vector<uint8_t> buf(size_t{1} << 20, 7);
        braid_request_t req;
        if (rank == 2) {
          BRAID_ASSERT_OK(offer(buf.data(), buf.size(), 1, comm, &req));
          std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the offer is out
          raise(SIGKILL);
        }
        if (rank == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          EXPECT_EQ(braid_recv(buf.data(), buf.size(), BRAID_UINT8, 2, comm, nullptr), BRAID_ERR_REMOTE);
          const std::string msg = braid_comm_get_last_error(comm);
          EXPECT_TRUE(contains(msg.c_str(), "rank 2")) << msg;
          return;
        }
        BRAID_ASSERT_OK(offer(buf.data(), buf.size(), 2, comm, &req));
        EXPECT_EQ(braid_wait(&req), BRAID_ERR_REMOTE) << braid_comm_get_last_error(comm);
        const std::string msg = braid_comm_get_last_error(comm);
        EXPECT_TRUE(contains(msg.c_str(), "rank 2")) << msg;
        EXPECT_FALSE(contains(msg.c_str(), "timed out")) << msg;
      },
      60);
  expect_survivors_exited(result, 2);
}

// A sender that gave up (here an abort) gets its buffer back and may reuse
// it: a receiver that comes to the offer later fails, and takes nothing.
TEST(ShmPeerReadFailures, AnOfferWithdrawnByAFailedSenderIsNotRead) {
  run_ranks(2, kShmDetection, [](braid_comm_t comm, int rank, int) {
    std::vector<uint8_t> buf(size_t{1} << 20, 7);
    if (rank == 0) {
      braid_request_t req;
      BRAID_ASSERT_OK(offer(buf.data(), buf.size(), 1, comm, &req));
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the offer is out
      EXPECT_EQ(braid_comm_abort(comm), BRAID_SUCCESS);
      EXPECT_EQ(braid_wait(&req), BRAID_ERR_ABORTED);
      std::fill(buf.begin(), buf.end(), 0xEE);  // reused
      // Lives on while rank 1 tries; abort released the handle, so it
      // leaves without the launcher's destroy.
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      _exit(::testing::Test::HasFailure() ? 1 : 0);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    std::fill(buf.begin(), buf.end(), 0);
    EXPECT_NE(braid_recv(buf.data(), buf.size(), BRAID_UINT8, 0, comm, nullptr), BRAID_SUCCESS);
    const std::string msg = braid_comm_get_last_error(comm);
    EXPECT_TRUE(contains(msg.c_str(), "rank 0")) << msg;
    EXPECT_EQ(std::count(buf.begin(), buf.end(), 0), static_cast<long>(buf.size())) << "read anyway";
  });
}

// A receive that fails while its sender is between its check of the
// receiver's failure mark and its write of a chunk returns only once that
// write is in: a program that reuses the buffer at once keeps what it wrote.
// The test hook holds the sender there (and the receiver's first chunk
// until then, so the sender surely claims one) until the receiver aborts,
// and 300 ms more.
struct HeldCopy {
  std::atomic<int> sender_held, aborted, send_returned;
};
HeldCopy* g_held = nullptr;  // shared between the forked ranks

void hold_copies(bool as_sender) {
  static bool first = true;  // each process holds its first chunk only
  if (!first) return;
  first = false;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  std::atomic<int>& wait_for = as_sender ? g_held->aborted : g_held->sender_held;
  if (as_sender) g_held->sender_held.store(1);
  while (wait_for.load() == 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (as_sender) std::this_thread::sleep_for(std::chrono::milliseconds(300));
}

TEST(ShmPeerReadFailures, AFailedReceiveReturnsNoWriteLandsAfter) {
  void* shared = mmap(nullptr, sizeof(HeldCopy), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(shared, MAP_FAILED);
  g_held = new (shared) HeldCopy{};
  braid::test_hook_before_chunk_copy = hold_copies;
  run_ranks(2, kShmDetection, [](braid_comm_t comm, int rank, int) {
    std::vector<uint8_t> buf(size_t{4} << 20, 7);
    if (rank == 0) {
      braid_request_t req;
      BRAID_ASSERT_OK(offer(buf.data(), buf.size(), 1, comm, &req));
      EXPECT_NE(braid_wait(&req), BRAID_SUCCESS);
      g_held->send_returned.store(1);
      return;
    }
    std::fill(buf.begin(), buf.end(), 0);
    std::thread aborter([comm] {
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (g_held->sender_held.load() == 0 && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      EXPECT_EQ(g_held->sender_held.load(), 1) << "rank 0 never copied a chunk";
      // Marked first: the abort may take over the driver and wait for the
      // held write, which waits for this mark.
      g_held->aborted.store(1);
      EXPECT_EQ(braid_comm_abort(comm), BRAID_SUCCESS);
    });
    EXPECT_EQ(braid_recv(buf.data(), buf.size(), BRAID_UINT8, 0, comm, nullptr), BRAID_ERR_ABORTED);
    std::fill(buf.begin(), buf.end(), 0xEE);  // reused
    aborter.join();
    for (int i = 0; i < 20000 && g_held->send_returned.load() == 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_EQ(g_held->send_returned.load(), 1);
    EXPECT_EQ(std::count(buf.begin(), buf.end(), 0xEE), static_cast<long>(buf.size()))
        << "a write landed after the receive returned";
    _exit(::testing::Test::HasFailure() ? 1 : 0);  // abort released the handle
  });
  braid::test_hook_before_chunk_copy = nullptr;
  munmap(shared, sizeof(HeldCopy));
}

// Abort while another thread drives (here braid's progress thread, held in
// a receive's chunk copy): abort returns once the op has failed, not merely
// been asked to fail, so its buffer is the caller's again (braid.h).
std::atomic<int> g_copy_held{0};
std::atomic<int> g_sender_waited{0};

TEST(ShmPeerReadFailures, AbortReturnsOnceThePendingOpsHaveFailed) {
  braid::test_hook_before_chunk_copy = [](bool as_sender) {
    // Both ends claim chunks: the sender waits before its first, or on a
    // loaded machine it could copy them all before the receiver claims one
    // (1 run in 12 with two busy loops beside it).
    if (as_sender && g_sender_waited.exchange(1) == 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    if (!as_sender && g_copy_held.exchange(1) == 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
  };
  run_ranks(2, kShmDetection, [](braid_comm_t comm, int rank, int) {
    std::vector<uint8_t> buf(size_t{4} << 20, 7);
    braid_request_t req = nullptr;
    if (rank == 0) {
      BRAID_ASSERT_OK(offer(buf.data(), buf.size(), 1, comm, &req));
      (void)braid_wait(&req);  // the copy held may finish before the abort is served
      return;
    }
    BRAID_ASSERT_OK(braid_irecv(buf.data(), buf.size(), BRAID_UINT8, 0, comm, nullptr, &req));
    for (int i = 0; i < 20000 && g_copy_held.load() == 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ASSERT_EQ(g_copy_held.load(), 1) << "the receive never copied a chunk";
    // A thread blocked in a call holds the communicator: abort cannot lean
    // on tearing it down, which would wait for the ops anyway.
    std::thread blocked([comm] {
      float x = 0;
      EXPECT_NE(braid_recv(&x, 1, BRAID_FLOAT32, 0, comm, nullptr), BRAID_SUCCESS);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(braid_comm_abort(comm), BRAID_SUCCESS);
    // A callback set on a finished op runs at once, here (braid_test would
    // give the driver a moment first).
    std::atomic<int> failed_with{-1};
    BRAID_ASSERT_OK(braid_request_set_callback(
        req,
        [](void* user, braid_result_t r, const char*) { static_cast<std::atomic<int>*>(user)->store(r); },
        &failed_with));
    // Done, one way or the other: the copy held may have ended the receive
    // before the driver got to the abort.
    const int result = failed_with.load();
    EXPECT_TRUE(result == BRAID_ERR_ABORTED || result == BRAID_SUCCESS)
        << "the irecv was not done when abort returned (" << result << ")";
    EXPECT_EQ(braid_wait(&req), result) << braid_get_last_error();
    blocked.join();
    _exit(::testing::Test::HasFailure() ? 1 : 0);  // abort released the handle
  });
  braid::test_hook_before_chunk_copy = nullptr;
}

INSTANTIATE_TEST_SUITE_P(, FailureTransports, ::testing::Values("shm", "tcp"));

// Tuning that decides algorithms must agree, set or not: BRAID_PEER_READ_MIN_BYTES
// at its reductions' default on one rank only still moves broadcast's and
// all_gather's threshold there (64 KiB unset), so init refuses, naming it.
// So does BRAID_TUNE_PROBE, which decides whether init runs collectives.
TEST(Config, DecidingSettingsThatDifferBetweenRanksFailInit) {
  struct Case {
    const char* name;
    const char* rank0;
    const char* rank1;  // nullptr: unset
    const char* expected;
  };
  const Case cases[] = {
      {"BRAID_PEER_READ_MIN_BYTES", "256K", nullptr,
       "BRAID_PEER_READ_MIN_BYTES (set on some ranks only) differs between ranks: rank 0 has 262144, rank 1 "
       "has "
       "65536"},
      {"BRAID_TUNE_PROBE", "0", "1", "BRAID_TUNE_PROBE differs between ranks: rank 0 has 0, rank 1 has 1"},
      {"BRAID_CHECK_CALLS", "1", nullptr,
       "BRAID_CHECK_CALLS differs between ranks: rank 0 has 1, rank 1 has 0"},
  };
  for (const Case& c : cases) {
    launcher::LaunchOptions o;
    o.nranks = 2;
    o.make_comm = false;
    o.env = {{"BRAID_DEBUG", "NONE"}};
    o.per_rank_setup = [&c](int rank) {
      const char* v = rank == 0 ? c.rank0 : c.rank1;
      if (v != nullptr)
        setenv(c.name, v, 1);
      else
        unsetenv(c.name);
    };
    auto r = launcher::fork_ranks(o, [&c](braid_comm_t, int rank, int n, const braid_unique_id_t& id) {
      braid_comm_t comm = nullptr;
      const braid_result_t res = braid_comm_init_rank(&comm, n, id, rank);
      const std::string msg = braid_get_last_error();
      if (res != BRAID_ERR_MISMATCH || msg.find(c.expected) == std::string::npos) {
        std::fprintf(stderr, "rank %d got %d: %s\n", rank, res, msg.c_str());
        return 1;
      }
      return 0;
    });
    EXPECT_TRUE(r.ok()) << c.name << ": " << r.describe();
  }
}

// Running out of file descriptors fails the call with the limit and its fix.
TEST(Resources, TooManyOpenFilesNamesTheLimit) {
#if defined(__SANITIZE_ADDRESS__)
  // UBSan's vptr check opens /proc/self/maps; with no descriptor left it
  // reports every virtual call as invalid.
  GTEST_SKIP() << "no descriptors left also starves ASan/UBSan's runtime; runs in the plain build";
#endif
  launcher::LaunchOptions o;
  o.nranks = 1;
  o.make_comm = false;
  auto r = launcher::fork_ranks(o, [](braid_comm_t, int, int, const braid_unique_id_t&) {
    const int lowest_free = dup(0);  // descriptors below it are all in use
    close(lowest_free);
    rlimit lim{};
    getrlimit(RLIMIT_NOFILE, &lim);
    lim.rlim_cur = static_cast<rlim_t>(lowest_free);  // no descriptor left for braid
    if (setrlimit(RLIMIT_NOFILE, &lim) != 0) return 2;
    braid_unique_id_t id;
    braid_comm_t comm = nullptr;
    braid_result_t res = braid_get_unique_id(&id);
    if (res == BRAID_SUCCESS) res = braid_comm_init_rank(&comm, 1, id, 0);
    const std::string msg = braid_get_last_error();
    if (res != BRAID_ERR_SYSTEM || msg.find("Too many open files") == std::string::npos ||
        msg.find("ulimit -n") == std::string::npos) {
      std::fprintf(stderr, "got %d: %s\n", res, msg.c_str());
      return 1;
    }
    return 0;
  });
  ASSERT_TRUE(r.ok()) << r.describe();
}

// The rendezvous root holds a socket per joined rank until all have joined.
// Out of descriptors, it tells the ranks that joined, naming the limit,
// rather than spinning on a connection it cannot accept until the timeout.
TEST(Resources, ARendezvousRootOutOfDescriptorsSaysSo) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "no descriptors left also starves ASan/UBSan's runtime; runs in the plain build";
#endif
  auto* told = static_cast<std::atomic<int>*>(
      mmap(nullptr, sizeof(std::atomic<int>), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(static_cast<void*>(told), MAP_FAILED);
  new (told) std::atomic<int>(0);
  launcher::LaunchOptions o;
  o.nranks = 4;
  o.make_comm = false;
  o.env = {{"BRAID_DEBUG", "NONE"}, {"BRAID_TIMEOUT", "8"}};
  const auto start = std::chrono::steady_clock::now();
  auto r = launcher::fork_ranks(o, [told](braid_comm_t, int rank, int, const braid_unique_id_t& id) {
    if (rank == 0) {
      // This process runs the root: room for two more descriptors, so the
      // third of ranks 1-3 to connect finds none.
      const int lowest_free = dup(0);
      close(lowest_free);
      rlimit lim{};
      getrlimit(RLIMIT_NOFILE, &lim);
      lim.rlim_cur = static_cast<rlim_t>(lowest_free + 2);
      if (setrlimit(RLIMIT_NOFILE, &lim) != 0) return 2;
      sleep(4);  // the root answers on its own thread
      return 0;
    }
    braid_comm_t comm = nullptr;
    if (braid_comm_init_rank(&comm, 4, id, rank) == BRAID_SUCCESS) return 3;
    // The ranks accepted (those that joined) are told; one left queued or
    // arriving after the root gave up sees the connection go.
    const std::string msg = braid_get_last_error();
    if (msg.find("could not accept") != std::string::npos &&
        msg.find("Too many open files") != std::string::npos)
      told->fetch_add(1);
    return 0;
  });
  EXPECT_TRUE(r.ok()) << r.describe();
  EXPECT_GE(told->load(), 1);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  munmap(told, sizeof(std::atomic<int>));
}

// A rank whose shared memory segment cannot be made (here a file size limit
// below the segment's size, as a full /dev/shm would do) makes every rank use
// tcp instead, with a warning; under BRAID_TRANSPORT=shm the job fails,
// naming the limit and the remedy.
TEST(Resources, SharedMemoryFailureFallsBackToTcp) {
  auto small_file_limit = [](int rank) {
    if (rank != 1) return;
    signal(SIGXFSZ, SIG_IGN);  // the limit then fails the call (EFBIG) instead of killing
    rlimit lim{64 * 1024, 64 * 1024};
    setrlimit(RLIMIT_FSIZE, &lim);
  };
  auto fallback = launch(
      3, {{"BRAID_DEBUG", "NONE"}},
      [](braid_comm_t comm, int rank, int) {
        std::vector<int32_t> v(100000, rank + 1);
        BRAID_ASSERT_OK(
            braid_all_reduce(v.data(), v.data(), v.size(), BRAID_INT32, BRAID_SUM, comm, nullptr));
        EXPECT_EQ(v[0], 6);
        EXPECT_EQ(v.back(), 6);
        uint64_t shm = 1, tcp = 0;
        BRAID_ASSERT_OK(braid_comm_transport_bytes(comm, "shm", &shm));
        BRAID_ASSERT_OK(braid_comm_transport_bytes(comm, "tcp", &tcp));
        EXPECT_EQ(shm, 0u);
        EXPECT_GT(tcp, 0u);
      },
      60, true, small_file_limit);
  ASSERT_TRUE(fallback.ok()) << fallback.describe();

  launcher::LaunchOptions o;
  o.nranks = 3;
  o.make_comm = false;
  o.env = {{"BRAID_DEBUG", "NONE"}, {"BRAID_TRANSPORT", "shm"}};
  o.per_rank_setup = small_file_limit;
  auto r = launcher::fork_ranks(o, [](braid_comm_t, int rank, int n, const braid_unique_id_t& id) {
    braid_comm_t comm = nullptr;
    const braid_result_t res = braid_comm_init_rank(&comm, n, id, rank);
    const std::string msg = braid_get_last_error();
    const bool named =
        rank == 1 ? msg.find("file size limit (ulimit -f)") != std::string::npos &&
                        msg.find("BRAID_TRANSPORT=tcp") != std::string::npos
                  : msg.find("rank 1 could not create its shared memory segment") != std::string::npos;
    if (res != BRAID_ERR_SYSTEM && res != BRAID_ERR_REMOTE) return 1;
    if (!named) {
      std::fprintf(stderr, "rank %d got %d: %s\n", rank, res, msg.c_str());
      return 2;
    }
    return 0;
  });
  ASSERT_TRUE(r.ok()) << r.describe();
}

// Names in /dev/shm that start with `prefix` ("braid-<token>-").
std::vector<std::string> shm_names(const std::string& prefix) {
  std::vector<std::string> found;
  if (DIR* dir = opendir("/dev/shm")) {
    while (const dirent* e = readdir(dir))
      if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) found.push_back(e->d_name);
    closedir(dir);
  }
  return found;
}

uint64_t pid_namespace_inode() {
  struct stat st;
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

// A segment name as braid makes it: token, rank, creator pid and pid namespace.
std::string shm_segment_name(const JobToken& token, int rank, pid_t pid, uint64_t ns) {
  return "braid-" + token_hex(token, 8) + "-" + std::to_string(rank) + "-" + std::to_string(pid) + "-" +
         std::to_string(ns);
}

bool make_shm_file(const std::string& name) {
  const int fd = shm_open(("/" + name).c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return false;
  close(fd);
  return true;
}

// A rank killed while the shared memory segments are being set up (its
// segment made, not yet mapped by every peer) leaves nothing in /dev/shm:
// the survivors' init fails naming it, and they unlink what processes now
// gone left, the dead rank's segment too, which it can no longer do itself.
TEST(Resources, ARankKilledDuringShmSetupLeavesNoSegment) {
  struct Shared {
    char prefix[64];
    std::atomic<int> killed;
  };
  auto* shared = static_cast<Shared*>(
      mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(shared, MAP_FAILED);
  new (shared) Shared{};
  launcher::LaunchOptions o;
  o.nranks = 3;
  o.make_comm = false;
  o.timeout_s = 60;
  o.env = {{"BRAID_DEBUG", "NONE"}, {"BRAID_TRANSPORT", "shm"}, {"BRAID_TIMEOUT", "30"}};
  auto r = launcher::fork_ranks(o, [&](braid_comm_t, int rank, int n, const braid_unique_id_t& id) {
    UniqueId decoded;
    if (!UniqueId::decode(&id, &decoded)) return 3;
    if (rank == 1) {
      std::snprintf(shared->prefix, sizeof(shared->prefix), "braid-%s-", token_hex(decoded.token, 8).c_str());
      // Dies the moment its own segment exists, before its peers are done with it.
      std::thread([mine = "/dev/shm/" + shm_segment_name(decoded.token, 1, getpid(), pid_namespace_inode()),
                   shared] {
        while (access(mine.c_str(), F_OK) != 0) std::this_thread::sleep_for(std::chrono::microseconds(20));
        shared->killed.store(1);
        raise(SIGKILL);
      }).detach();
    }
    braid_comm_t comm = nullptr;
    const braid_result_t res = braid_comm_init_rank(&comm, n, id, rank);
    if (res == BRAID_SUCCESS) {
      braid_comm_destroy(comm);
      return 4;  // rank 1 died during init: nobody's init may succeed
    }
    // Each survivor names the ring neighbour it lost: rank 1, or a survivor
    // that gave up because of rank 1.
    const char* err = braid_get_last_error();
    if (res != BRAID_ERR_REMOTE || !(contains(err, "to rank 1") || contains(err, "from rank 1") ||
                                     contains(err, "from rank 2") || contains(err, "to rank 0"))) {
      std::fprintf(stderr, "rank %d: %s\n", rank, braid_get_last_error());
      return 5;
    }
    return 0;
  });
  ASSERT_EQ(shared->killed.load(), 1) << r.describe();
  ASSERT_EQ(r.ranks.size(), 3u);
  EXPECT_EQ(r.ranks[1].signal, SIGKILL);
  for (int rank : {0, 2}) {
    EXPECT_FALSE(r.ranks[rank].timed_out) << "rank " << rank << " hung";
    EXPECT_EQ(r.ranks[rank].exit_code, 0) << "rank " << rank << ": " << r.describe();
  }
  for (const std::string& name : shm_names(shared->prefix)) {
    ADD_FAILURE() << name << " was left behind";
    shm_unlink(("/" + name).c_str());
  }
  munmap(shared, sizeof(Shared));
}

// Segment names carry the creator's pid: a job whose token another live job
// shares (braid_comm_init_env hashes MASTER_ADDR:PORT, which two containers
// sharing /dev/shm may both use) meets none of its names, and a job that
// finds segments left by processes now gone (a job killed during init)
// removes them. Before, names were token and rank: the second job's
// shm_open failed with EEXIST (tcp instead, or a failed init under
// BRAID_TRANSPORT=shm), and its cleanup unlinked the first job's segment;
// a killed job's segments stayed in /dev/shm for good.
TEST(Resources, SegmentsOfOtherJobsAreLeftAloneAndThoseOfDeadOnesRemoved) {
  launcher::LaunchOptions o;
  o.nranks = 2;
  o.make_comm = false;
  o.env = {{"BRAID_TRANSPORT", "shm"}};
  // A process that is gone by the time the ranks look: its pid is stale.
  const pid_t gone = fork();
  if (gone == 0) _exit(0);
  ASSERT_GT(gone, 0);
  ASSERT_EQ(waitpid(gone, nullptr, 0), gone);
  const uint64_t ns = pid_namespace_inode();
  ASSERT_NE(ns, 0u);
  struct Shared {
    char live[128], dead[128], elsewhere[128];
  };
  auto* shared = static_cast<Shared*>(
      mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(shared, MAP_FAILED);
  new (shared) Shared{};
  auto r = launcher::fork_ranks(o, [&](braid_comm_t, int rank, int n, const braid_unique_id_t& id) {
    UniqueId decoded;
    if (!UniqueId::decode(&id, &decoded)) return 3;
    if (rank == 0) {
      // This job's token under a live process (the test's), under a gone
      // one, and under a live-looking pid of another pid namespace.
      std::snprintf(shared->live, sizeof(shared->live), "%s",
                    shm_segment_name(decoded.token, 1, getppid(), ns).c_str());
      std::snprintf(shared->dead, sizeof(shared->dead), "%s",
                    shm_segment_name(decoded.token, 0, gone, ns).c_str());
      std::snprintf(shared->elsewhere, sizeof(shared->elsewhere), "%s",
                    shm_segment_name(decoded.token, 1, gone, ns + 1).c_str());
      for (const char* name : {shared->live, shared->dead, shared->elsewhere})
        if (!make_shm_file(name)) return 4;
    }
    braid_comm_t comm = nullptr;
    if (braid_comm_init_rank(&comm, n, id, rank) != BRAID_SUCCESS) {
      std::fprintf(stderr, "rank %d: %s\n", rank, braid_get_last_error());
      return 5;
    }
    uint64_t shm_bytes = 0;
    float x = 1;
    const bool ok = braid_all_reduce(&x, &x, 1, BRAID_FLOAT32, BRAID_SUM, comm, nullptr) == BRAID_SUCCESS &&
                    x == 2 && braid_comm_transport_bytes(comm, "shm", &shm_bytes) == BRAID_SUCCESS &&
                    shm_bytes > 0;
    braid_comm_destroy(comm);
    return ok ? 0 : 6;
  });
  ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_EQ(access(("/dev/shm/" + std::string(shared->live)).c_str(), F_OK), 0)
      << "a live job's segment went";
  EXPECT_EQ(access(("/dev/shm/" + std::string(shared->elsewhere)).c_str(), F_OK), 0)
      << "another pid namespace's segment went";
  EXPECT_NE(access(("/dev/shm/" + std::string(shared->dead)).c_str(), F_OK), 0)
      << "a dead job's segment stayed";
  for (const char* name : {shared->live, shared->dead, shared->elsewhere})
    shm_unlink(("/" + std::string(name)).c_str());
  munmap(shared, sizeof(Shared));
}

// A collective whose work buffers cannot be allocated fails with
// BRAID_ERR_SYSTEM on that rank (std::bad_alloc escaped the C API and
// aborted the process), and its peers learn why at once.
TEST(Resources, OutOfMemoryForWorkBuffersIsAnError) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "an address space limit starves the sanitizers' runtime; runs in the plain build";
#endif
  auto r =
      launch(2, {{"BRAID_DEBUG", "NONE"}, {"BRAID_TIMEOUT", "60"}}, [](braid_comm_t comm, int rank, int) {
        // In place, all_to_all reads a copy of its input: 64 MiB.
        const size_t count = size_t{8} << 20;
        std::vector<int32_t> a(count * 2, rank);
        if (rank == 0) {
          std::ifstream status("/proc/self/status");
          std::string line;
          size_t vm_kb = 0;
          while (std::getline(status, line))
            if (line.rfind("VmSize:", 0) == 0) vm_kb = std::stoul(line.substr(7));
          ASSERT_GT(vm_kb, 0u);
          rlimit lim{};
          getrlimit(RLIMIT_AS, &lim);
          lim.rlim_cur = static_cast<rlim_t>((vm_kb << 10) + (size_t{16} << 20));
          ASSERT_EQ(setrlimit(RLIMIT_AS, &lim), 0);
        }
        const auto start = std::chrono::steady_clock::now();
        const braid_result_t res = braid_all_to_all(a.data(), a.data(), count, BRAID_INT32, comm, nullptr);
        const std::string msg = braid_comm_get_last_error(comm);
        EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30)) << "rank " << rank;
        if (rank == 0) {
          EXPECT_EQ(res, BRAID_ERR_SYSTEM) << msg;
        } else {
          EXPECT_NE(res, BRAID_SUCCESS) << msg;
        }
        EXPECT_TRUE(
            contains(msg.c_str(), "all_to_all #0: out of memory for its work buffers (32 MiB per rank)"))
            << "rank " << rank << ": " << msg;
      });
  EXPECT_TRUE(r.ok()) << r.describe();
}

// The rendezvous port taken by another process: the error names the address,
// the cause and the variable that moves it.
TEST(Resources, PortInUseNamesTheFix) {
  launcher::LaunchOptions o;
  o.nranks = 1;
  o.make_comm = false;
  auto r = launcher::fork_ranks(o, [](braid_comm_t, int, int, const braid_unique_id_t&) {
    int holder = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    if (bind(holder, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || listen(holder, 1) != 0 ||
        getsockname(holder, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
      return 2;
    const std::string port = std::to_string(ntohs(addr.sin_port));
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", "1", 1);
    setenv("BRAID_ROOT_PORT", port.c_str(), 1);
    setenv("WORLD_SIZE", "1", 1);
    setenv("RANK", "0", 1);
    braid_comm_t comm = nullptr;
    const braid_result_t res = braid_comm_init_env(&comm);
    const std::string msg = braid_get_last_error();
    for (const std::string& needle :
         {"cannot listen on 127.0.0.1:" + port, std::string("port in use"), std::string("BRAID_ROOT_PORT")}) {
      if (res != BRAID_ERR_SYSTEM || msg.find(needle) == std::string::npos) {
        std::fprintf(stderr, "got %d, lacking '%s': %s\n", res, needle.c_str(), msg.c_str());
        return 1;
      }
    }
    return 0;
  });
  ASSERT_TRUE(r.ok()) << r.describe();
}

TEST(Bootstrap, StrangersAtTheRootDoNotStopTheJob) {
  braid::launcher::LaunchOptions o;
  o.nranks = 3;
  o.make_comm = false;
  o.env = {{"BRAID_DEBUG", "NONE"}};
  auto r = braid::launcher::fork_ranks(o, [](braid_comm_t, int rank, int n, const braid_unique_id_t& id) {
    if (rank == 0) {
      UniqueId u;
      if (!UniqueId::decode(id.internal, &u)) return 3;
      // Garbage, a wrong token, and a connection that never speaks.
      int fds[3];
      for (int& fd : fds)
        if (!connect_to(u.root, Deadline::after_seconds(5), &fd)) return 4;
      const char junk[] = "GET / HTTP/1.0\r\n\r\n and then some more bytes to fill a hello frame";
      send(fds[0], junk, sizeof(junk), MSG_NOSIGNAL);
      UniqueId wrong = u;
      wrong.token[0] ^= 0xff;
      std::vector<char> hello(52, 0);
      uint32_t magic = 0x31445242, kind = 1, zero = 0, two = 2;
      std::memcpy(hello.data(), &magic, 4);
      std::memcpy(hello.data() + 4, &kind, 4);
      std::memcpy(hello.data() + 8, wrong.token.data(), 16);
      std::memcpy(hello.data() + 24, &zero, 4);
      std::memcpy(hello.data() + 28, &two, 4);
      send(fds[1], hello.data(), hello.size(), MSG_NOSIGNAL);
      (void)fds[2];
    }
    braid_comm_t comm = nullptr;
    if (braid_comm_init_rank(&comm, n, id, rank) != BRAID_SUCCESS) return 5;
    int32_t x = rank, sum = 0;
    if (braid_all_reduce(&x, &sum, 1, BRAID_INT32, BRAID_SUM, comm, nullptr) != BRAID_SUCCESS || sum != 3)
      return 6;
    return braid_comm_destroy(comm) == BRAID_SUCCESS ? 0 : 7;
  });
  ASSERT_TRUE(r.ok()) << r.describe();
}

// A rank the rendezvous root refuses learns why at once, not at its
// deadline: a rank count other than the first rank's, a rank that joined
// already. Rank 1 tries both once rank 0 (whose process runs the root) has
// sent its own hello, then joins as it should.
TEST(Bootstrap, ARefusedRankIsToldWhy) {
  auto* joining = static_cast<std::atomic<int>*>(
      mmap(nullptr, sizeof(std::atomic<int>), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(static_cast<void*>(joining), MAP_FAILED);
  new (joining) std::atomic<int>(0);
  braid::launcher::LaunchOptions o;
  o.nranks = 2;
  o.make_comm = false;
  o.env = {{"BRAID_DEBUG", "NONE"}, {"BRAID_TIMEOUT", "30"}};
  auto r =
      braid::launcher::fork_ranks(o, [joining](braid_comm_t, int rank, int n, const braid_unique_id_t& id) {
        braid_comm_t comm = nullptr;
        if (rank == 0) {
          joining->store(1);
        } else {
          while (joining->load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
          std::this_thread::sleep_for(std::chrono::seconds(1));  // its hello is in
          const auto start = std::chrono::steady_clock::now();
          const struct {
            int nranks, rank;
            const char* named;
          } refused[] = {{3, 1, "refused rank 1: rank 1 says the job has 3 ranks, others said 2"},
                         {2, 0, "refused rank 0: rank 0 joined twice"},
                         // A second rank 0 with another count is refused
                         // alone; the one that joined keeps the job (before,
                         // it and every rank with it were refused).
                         {3, 0, "refused rank 0: rank 0 says the job has 3 ranks, others said 2"}};
          for (const auto& c : refused) {
            if (braid_comm_init_rank(&comm, c.nranks, id, c.rank) != BRAID_ERR_INVALID_ARGUMENT) return 10;
            if (std::string(braid_get_last_error()).find(c.named) == std::string::npos) {
              std::fprintf(stderr, "rank 1 got: %s\n", braid_get_last_error());
              return 11;
            }
          }
          if (std::chrono::steady_clock::now() - start > std::chrono::seconds(5))
            return 12;  // not a deadline
        }
        if (braid_comm_init_rank(&comm, n, id, rank) != BRAID_SUCCESS) return 5;
        int32_t x = rank, sum = 0;
        if (braid_all_reduce(&x, &sum, 1, BRAID_INT32, BRAID_SUM, comm, nullptr) != BRAID_SUCCESS || sum != 1)
          return 6;
        return braid_comm_destroy(comm) == BRAID_SUCCESS ? 0 : 7;
      });
  munmap(joining, sizeof(std::atomic<int>));
  ASSERT_TRUE(r.ok()) << r.describe();
}

// A process whose getrandom is refused for good (a kernel before 3.17, a
// seccomp profile without it) still makes ids and tokens, each its own:
// before, the token's loop retried getrandom forever at full speed.
TEST(Bootstrap, IdsAreMadeWhereGetrandomIsRefused) {
#if defined(__x86_64__)
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    alarm(10);  // a token that spins is killed, not left to hang the suite
    sock_filter filter[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_getrandom, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    sock_fprog prog{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0)
      _exit(2);
    char probe;
    if (getrandom(&probe, 1, 0) != -1 || errno != ENOSYS) _exit(3);  // the filter is in place
    const JobToken a = random_token(), b = random_token();
    if (a == b) _exit(4);
    braid_unique_id_t id1, id2;
    if (braid_get_unique_id(&id1) != BRAID_SUCCESS || braid_get_unique_id(&id2) != BRAID_SUCCESS) _exit(5);
    _exit(std::memcmp(&id1, &id2, sizeof(id1)) != 0 ? 0 : 6);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child was killed by signal " << WTERMSIG(status)
                                 << " (SIGALRM: making a token spun)";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "2: no seccomp filter; 3: getrandom not refused; 4: equal tokens; "
                                       "5: braid_get_unique_id failed; 6: equal ids";
#else
  GTEST_SKIP() << "the seccomp filter here is written for x86-64";
#endif
}

// Where the job never forms because a rank was refused (it said the job has
// 3 ranks, rank 0 said 2), the ranks that joined learn that too when the
// root gives up, not only that a rank is missing. Rank 0's count is the
// job's whichever rank reaches the root first: `late_rank` starts 300 ms
// after the other.
void expect_the_rank_with_another_count_refused(int late_rank) {
  braid::launcher::LaunchOptions o;
  o.nranks = 2;
  o.make_comm = false;
  o.env = {{"BRAID_DEBUG", "NONE"}, {"BRAID_TIMEOUT", "3"}};
  auto r =
      braid::launcher::fork_ranks(o, [late_rank](braid_comm_t, int rank, int n, const braid_unique_id_t& id) {
        if (rank == late_rank) std::this_thread::sleep_for(std::chrono::milliseconds(300));
        braid_comm_t comm = nullptr;
        const braid_result_t res = braid_comm_init_rank(&comm, rank == 1 ? 3 : n, id, rank);
        const std::string msg = braid_get_last_error();
        const char* expected =
            rank == 1 ? "refused rank 1: rank 1 says the job has 3 ranks, others said 2"
                      : "rank 1 of 2 did not join the rendezvous within 3 s (BRAID_TIMEOUT); are "
                        "they started, with the same id and nranks? Refused meanwhile: rank 1 "
                        "says the job has 3 ranks, others said 2";
        if (res == BRAID_SUCCESS || msg.find(expected) == std::string::npos) {
          std::fprintf(stderr, "rank %d got %d: %s\n", rank, res, msg.c_str());
          return 1;
        }
        return 0;
      });
  EXPECT_TRUE(r.ok()) << r.describe();
}

TEST(Bootstrap, RanksThatJoinedLearnWhyAnotherWasRefused) {
  expect_the_rank_with_another_count_refused(1);
}

// Rank 1 first took the root's count from its own 3 and refused rank 0
// (seen 1 run in about 35 under a loaded machine).
TEST(Bootstrap, RankZerosCountDecidesWhenAnotherRankJoinsFirst) {
  expect_the_rank_with_another_count_refused(0);
}

// A second connection for a (rank, tag) that already waits is closed at
// once: keeping the later one lost the first's descriptor until exit.
TEST(Bootstrap, ADuplicateConnectionIsClosedNotLeaked) {
  auto open_fds = [] {
    int n = 0;
    for (int fd = 0; fd < 4096; ++fd) n += fcntl(fd, F_GETFD) != -1;
    return n;
  };
  const int before = open_fds();
  {
    SockAddr any;
    ASSERT_TRUE(SockAddr::parse("127.0.0.1", 0, &any));
    int listen_fd[2];
    std::vector<SockAddr> table(2);
    for (int r = 0; r < 2; ++r) ASSERT_TRUE(listen_on(any, 16, &listen_fd[r], &table[r]));
    JobToken token{};
    token[0] = 7;
    const Deadline deadline = Deadline::after_seconds(20);
    std::unique_ptr<Bootstrap> b[2];
    Status st[2];
    {
      std::thread t([&] {
        st[1] = Bootstrap::from_table(1, token, listen_fd[1], table[1], table, deadline, nullptr, &b[1]);
      });
      st[0] = Bootstrap::from_table(0, token, listen_fd[0], table[0], table, deadline, nullptr, &b[0]);
      t.join();
    }
    ASSERT_TRUE(st[0]) << st[0].message();
    ASSERT_TRUE(st[1]) << st[1].message();
    // Rank 1 connects twice for tag 500, then once for 501; rank 0 takes 500
    // and 501, and parks the duplicate while it waits for 501.
    int first = -1, dup = -1, other = -1;
    ASSERT_TRUE(b[1]->connect_to_peer(0, 500, deadline, &first));
    ASSERT_TRUE(b[1]->connect_to_peer(0, 500, deadline, &dup));
    ASSERT_TRUE(b[1]->connect_to_peer(0, 501, deadline, &other));
    int got500 = -1, got501 = -1;
    ASSERT_TRUE(b[0]->accept_from_peer(1, 501, deadline, &got501));
    ASSERT_TRUE(b[0]->accept_from_peer(1, 500, deadline, &got500));
    // The connection rank 0 took for 500 is the first: a byte sent on it arrives.
    const char ping = 'x';
    ASSERT_EQ(send(first, &ping, 1, MSG_NOSIGNAL), 1);
    pollfd p{got500, POLLIN, 0};
    ASSERT_EQ(poll(&p, 1, 5000), 1);
    char got = 0;
    ASSERT_EQ(recv(got500, &got, 1, 0), 1);
    EXPECT_EQ(got, 'x');
    // The duplicate was closed: its peer end reads the end of the stream.
    pollfd q{dup, POLLIN, 0};
    ASSERT_EQ(poll(&q, 1, 5000), 1) << "rank 0 still holds the duplicate connection open";
    EXPECT_EQ(recv(dup, &got, 1, 0), 0);
    for (int fd : {first, dup, other, got500, got501}) close(fd);
  }
  EXPECT_EQ(open_fds(), before) << "descriptors leaked";
}

// A split's child connecting its bootstrap ring to a peer whose SYNs go
// unanswered (another host gone silent; here a listener whose accept queue
// is full, which drops them) is cut short by an abort of the split: the
// connect waited for the deadline before.
TEST(Bootstrap, AnAbortEndsAConnectThatGetsNoAnswer) {
  SockAddr any;
  ASSERT_TRUE(SockAddr::parse("127.0.0.1", 0, &any));
  int listen_fd[2];
  std::vector<SockAddr> table(2);
  ASSERT_TRUE(listen_on(any, 16, &listen_fd[0], &table[0]));
  ASSERT_TRUE(listen_on(any, 0, &listen_fd[1], &table[1]));  // rank 1 never accepts
  int queued = -1;                                           // fills rank 1's accept queue of one
  ASSERT_TRUE(connect_to(table[1], Deadline::after_seconds(5), &queued));
  JobToken token{};
  SetupCancel cancel;
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    cancel.cancel(Status::aborted("rank 0: communicator aborted by braid_comm_abort"));
  });
  std::unique_ptr<Bootstrap> b;
  // At its deadline the connect fails and the abort's status is given too:
  // what shows the abort ended it is that the deadline has not passed.
  const Deadline deadline = Deadline::after_seconds(60);
  const Status st = Bootstrap::from_table(0, token, listen_fd[0], table[0], table, deadline, &cancel, &b);
  EXPECT_FALSE(deadline.expired()) << "the connect waited for its deadline, not for the abort";
  aborter.join();
  EXPECT_EQ(st.code(), BRAID_ERR_ABORTED) << st.message();
  EXPECT_EQ(st.message(), "rank 0: communicator aborted by braid_comm_abort");
  close(queued);
  close(listen_fd[1]);
}

// Bootstraps of `n` ranks in this process, each listening on loopback.
struct LocalTable {
  explicit LocalTable(int n) : listen_fd(n, -1), table(n) {
    SockAddr any;
    EXPECT_TRUE(SockAddr::parse("127.0.0.1", 0, &any));
    for (int r = 0; r < n; ++r) EXPECT_TRUE(listen_on(any, 16, &listen_fd[r], &table[r]));
    token[0] = 9;
  }
  // from_table on each rank in `ranks` at once, each on its own thread.
  std::vector<Status> join(const std::vector<int>& ranks, double seconds,
                           std::vector<std::unique_ptr<Bootstrap>>* out) {
    out->resize(table.size());
    std::vector<Status> st(table.size());
    const Deadline deadline = Deadline::after_seconds(seconds);
    std::vector<std::thread> threads;
    for (int r : ranks)
      threads.emplace_back([&, r] {
        st[r] = Bootstrap::from_table(r, token, listen_fd[r], table[r], table, deadline, nullptr, &(*out)[r]);
      });
    for (auto& t : threads) t.join();
    return st;
  }
  std::vector<int> listen_fd;
  std::vector<SockAddr> table;
  JobToken token{};
};

// Connections that never send a hello wait side by side with the ranks'
// own: three silent strangers at rank 1's port cost its peers nothing (each
// held rank 1's accept for the 5 s handshake time, one after another).
TEST(Bootstrap, SilentStrangersAtARankDoNotHoldUpItsPeers) {
  LocalTable t(3);
  std::vector<int> strangers;
  for (int k = 0; k < 3; ++k) {
    int fd = -1;
    ASSERT_TRUE(connect_to(t.table[1], Deadline::after_seconds(5), &fd));
    strangers.push_back(fd);
  }
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::unique_ptr<Bootstrap>> b;
  const std::vector<Status> st = t.join({0, 1, 2}, 30, &b);
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(st[r]) << "rank " << r << ": " << st[r].message();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4));
  std::vector<uint8_t> all;
  std::vector<std::thread> threads;
  std::vector<Status> gathered(3);
  for (int r = 0; r < 3; ++r)
    threads.emplace_back([&, r] {
      std::vector<uint8_t> out;
      const uint8_t mine = static_cast<uint8_t>(10 + r);
      gathered[r] = b[r]->all_gather(&mine, 1, &out, Deadline::after_seconds(20));
      if (gathered[r] && out != std::vector<uint8_t>{10, 11, 12})
        gathered[r] = Status::internal("wrong bytes");
    });
  for (auto& th : threads) th.join();
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(gathered[r]) << gathered[r].message();
  for (int fd : strangers) close(fd);
}

// A rank in the table that is gone (its listener closed, as when it died
// after the root answered) fails its peers at once, naming it, instead of
// at the deadline: a connect it refuses is final, and a rank waiting for it
// to connect finds its listener refusing a probe.
TEST(Bootstrap, ARankGoneAfterTheTableFailsItsPeersAtOnce) {
  LocalTable t(3);
  close(t.listen_fd[2]);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::unique_ptr<Bootstrap>> b;
  const std::vector<Status> st = t.join({0, 1}, 60, &b);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  // Rank 1 connects to rank 2, which refuses; rank 0 sees rank 1 give up
  // (while waiting for rank 2 to connect, or, when rank 1 gave up first,
  // while handshaking with it) or rank 2's listener refuse.
  EXPECT_EQ(st[1].code(), BRAID_ERR_REMOTE) << st[1].message();
  EXPECT_TRUE(contains(st[1].message().c_str(), "rank 1 connecting to rank 2")) << st[1].message();
  EXPECT_TRUE(contains(st[1].message().c_str(), "Connection refused")) << st[1].message();
  EXPECT_EQ(st[0].code(), BRAID_ERR_REMOTE) << st[0].message();
  EXPECT_TRUE(contains(st[0].message().c_str(), "waiting for rank 2 to connect: ") ||
              (contains(st[0].message().c_str(), "handshake with rank 1 at 127.0.0.1:") &&
               contains(st[0].message().c_str(), "it exited or gave up")))
      << st[0].message();

  // Rank 0 waits for rank 2, not a ring neighbour of it, which then goes:
  // the probe of its listener tells.
  LocalTable four(4);
  std::vector<std::unique_ptr<Bootstrap>> b4;
  const std::vector<Status> st4 = four.join({0, 1, 2, 3}, 30, &b4);
  for (int r = 0; r < 4; ++r) ASSERT_TRUE(st4[r]) << "rank " << r << ": " << st4[r].message();
  b4[2].reset();
  int fd = -1;
  const auto waited_from = std::chrono::steady_clock::now();
  const Status waited = b4[0]->accept_from_peer(2, 600, Deadline::after_seconds(60), &fd);
  EXPECT_LT(std::chrono::steady_clock::now() - waited_from, std::chrono::seconds(10));
  EXPECT_EQ(waited.code(), BRAID_ERR_REMOTE) << waited.message();
  EXPECT_TRUE(contains(waited.message().c_str(), "waiting for rank 2 to connect: its listener at 127.0.0.1:"))
      << waited.message();
  EXPECT_TRUE(contains(waited.message().c_str(), "refuses connections")) << waited.message();
}

// A rank waiting for a peer's connection learns of a failure elsewhere in
// the job from its ring neighbours: one that gives up closes its ring
// connections, and the waiter fails naming it, though the peer it waits
// for is alive.
TEST(Bootstrap, ARingNeighbourThatGivesUpFailsAWaitingRank) {
  LocalTable t(3);
  std::vector<std::unique_ptr<Bootstrap>> b;
  const std::vector<Status> st = t.join({0, 1, 2}, 30, &b);
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(st[r]) << "rank " << r << ": " << st[r].message();
  const auto start = std::chrono::steady_clock::now();
  Status waited;
  std::thread waiter([&] {
    int fd = -1;
    waited = b[0]->accept_from_peer(2, 600, Deadline::after_seconds(60), &fd);
    if (waited) close(fd);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  b[1].reset();  // rank 1 gives up
  waiter.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(waited.code(), BRAID_ERR_REMOTE) << waited.message();
  EXPECT_TRUE(contains(waited.message().c_str(), "rank 1, a bootstrap ring neighbour, closed its connection"))
      << waited.message();
}

// The rendezvous root out of descriptors while silent strangers hold them
// (a flood of connections that send no hello) stops accepting until their
// handshake time drops them, and the job still forms; it gave up at once
// before, failing every rank.
TEST(Bootstrap, ARootOutOfDescriptorsWaitsForStrangersToGo) {
  struct Shared {
    std::atomic<int> ready;
    uint8_t addr[SockAddr::kWireBytes];
  };
  auto* shared = static_cast<Shared*>(
      mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(static_cast<void*>(shared), MAP_FAILED);
  new (shared) Shared{};
  const JobToken token = random_token();
  const pid_t root = fork();
  if (root == 0) {
    // The root's process: room for 8 more descriptors.
    SockAddr any, bound;
    if (!SockAddr::parse("127.0.0.1", 0, &any) || !start_rendezvous_root(any, token, 30, &bound)) _exit(1);
    const int lowest_free = dup(0);
    close(lowest_free);
    rlimit lim{};
    getrlimit(RLIMIT_NOFILE, &lim);
    lim.rlim_cur = static_cast<rlim_t>(lowest_free + 8);
    if (setrlimit(RLIMIT_NOFILE, &lim) != 0) _exit(2);
    bound.to_wire(shared->addr);
    shared->ready.store(1);
    sleep(30);
    _exit(0);
  }
  ASSERT_GT(root, 0);
  while (shared->ready.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  UniqueId id;
  ASSERT_TRUE(SockAddr::from_wire(shared->addr, &id.root));
  id.token = token;
  std::vector<int> strangers(10, -1);
  for (int& fd : strangers) ASSERT_TRUE(connect_to(id.root, Deadline::after_seconds(5), &fd));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto start = std::chrono::steady_clock::now();
  std::unique_ptr<Bootstrap> b[2];
  Status st[2];
  std::thread other([&] { st[1] = Bootstrap::join(id, 1, 2, "", Deadline::after_seconds(30), &b[1]); });
  st[0] = Bootstrap::join(id, 0, 2, "", Deadline::after_seconds(30), &b[0]);
  other.join();
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(st[r]) << "rank " << r << ": " << st[r].message();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15));
  for (int fd : strangers) close(fd);
  kill(root, SIGKILL);
  waitpid(root, nullptr, 0);
  munmap(shared, sizeof(Shared));
}

// A bootstrap all_gather that failed part way (here rank 0 timed out while
// rank 1 was late) leaves bytes in flight; a later all_gather would read
// them as its own, so it fails, naming the first failure.
TEST(Bootstrap, AnAllGatherAfterAFailedOneFails) {
  LocalTable t(2);
  std::vector<std::unique_ptr<Bootstrap>> b;
  const std::vector<Status> st = t.join({0, 1}, 30, &b);
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(st[r]) << "rank " << r << ": " << st[r].message();
  std::vector<uint8_t> out;
  const uint8_t mine = 1;
  const Status late = b[0]->all_gather(&mine, 1, &out, Deadline::after_seconds(0.05));
  ASSERT_EQ(late.code(), BRAID_ERR_TIMEOUT) << late.message();
  std::thread peer([&] { (void)b[1]->all_gather(&mine, 1, &out, Deadline::after_seconds(5)); });
  std::vector<uint8_t> again;
  const Status next = b[0]->all_gather(&mine, 1, &again, Deadline::after_seconds(5));
  b[0].reset();  // rank 1's exchange ends: its peer is gone
  peer.join();
  EXPECT_EQ(next.code(), BRAID_ERR_TIMEOUT) << next.message();
  EXPECT_TRUE(contains(next.message().c_str(), "the bootstrap ring failed earlier: ")) << next.message();
}

// The parsers behind the listeners (also fuzzed: tests/fuzz) accept this
// job's hellos and say what is wrong with anything else.
// The address a rank listens on without BRAID_SOCKET_IFNAME: a running,
// non-bridge IPv4 interface before docker0 (up on many hosts, reaching no
// other), loopback last; with it, IPv4 first and link-local IPv6 last.
TEST(Bootstrap, LocalAddressSkipsBridgesAndLinkLocal) {
  auto iface = [](const char* name, const char* ip, bool running, bool loopback = false) {
    InterfaceAddress a;
    a.name = name;
    EXPECT_TRUE(SockAddr::parse(ip, 0, &a.addr)) << ip;
    a.up = true;
    a.running = running;
    a.loopback = loopback;
    return a;
  };
  SockAddr out;
  std::vector<InterfaceAddress> addrs = {iface("lo", "127.0.0.1", true, true),
                                         iface("docker0", "172.17.0.1", false),
                                         iface("eth0", "10.1.2.3", true)};
  ASSERT_TRUE(pick_local_address(addrs, "", &out));
  EXPECT_EQ(out.str(), "10.1.2.3:0");
  addrs[2].running = false;  // no carrier on either: the real one still wins
  ASSERT_TRUE(pick_local_address(addrs, "", &out));
  EXPECT_EQ(out.str(), "10.1.2.3:0");
  addrs.pop_back();
  ASSERT_TRUE(pick_local_address(addrs, "", &out));
  EXPECT_EQ(out.str(), "172.17.0.1:0");
  addrs.pop_back();
  ASSERT_TRUE(pick_local_address(addrs, "", &out));
  EXPECT_EQ(out.str(), "127.0.0.1:0");
  addrs = {iface("ib0", "fe80::1", true), iface("ib0", "2001:db8::5", true), iface("eth0", "10.1.2.3", true)};
  ASSERT_TRUE(pick_local_address(addrs, "ib", &out));
  EXPECT_EQ(out.str(), "[2001:db8::5]:0");
  addrs.push_back(iface("ib0", "192.168.7.7", true));
  ASSERT_TRUE(pick_local_address(addrs, "ib0", &out));
  EXPECT_EQ(out.str(), "192.168.7.7:0");
  EXPECT_TRUE(contains(pick_local_address(addrs, "wlan", &out).message().c_str(),
                       "BRAID_SOCKET_IFNAME='wlan' matches no interface that is up"));
}

TEST(Bootstrap, HandshakeParsersNameWhatIsWrong) {
  JobToken token{};
  for (size_t i = 0; i < token.size(); ++i) token[i] = static_cast<uint8_t>(i + 1);
  std::vector<uint8_t> hello(kRootHelloBytes, 0);
  const uint32_t magic = 0x31445242, kind = 1, rank = 2, nranks = 4;
  std::memcpy(hello.data(), &magic, 4);
  std::memcpy(hello.data() + 4, &kind, 4);
  std::memcpy(hello.data() + 8, token.data(), 16);
  std::memcpy(hello.data() + 24, &rank, 4);
  std::memcpy(hello.data() + 28, &nranks, 4);
  SockAddr addr;
  ASSERT_TRUE(SockAddr::parse("127.0.0.1", 4000, &addr));
  addr.to_wire(hello.data() + 32);
  RootHelloFields f;
  ASSERT_TRUE(parse_root_hello(hello.data(), hello.size(), token, &f));
  EXPECT_EQ(f.rank, 2);
  EXPECT_EQ(f.nranks, 4);
  EXPECT_EQ(f.addr.str(), "127.0.0.1:4000");

  EXPECT_TRUE(
      contains(parse_root_hello(hello.data(), 51, token, &f).message().c_str(), "a hello of 51 bytes"));
  JobToken other = token;
  other[5] ^= 1;
  EXPECT_TRUE(
      contains(parse_root_hello(hello.data(), hello.size(), other, &f).message().c_str(), "wrong job token"));
  std::vector<uint8_t> bad = hello;
  std::memcpy(bad.data() + 24, &nranks, 4);  // rank 4 of 4
  EXPECT_TRUE(contains(parse_root_hello(bad.data(), bad.size(), token, &f).message().c_str(),
                       "rank 4 of 4 is out of range"));
  bad = hello;
  bad[0] ^= 0xff;
  EXPECT_TRUE(
      contains(parse_root_hello(bad.data(), bad.size(), token, &f).message().c_str(), "not a braid hello"));

  // The root's answer: header, then the table.
  std::vector<uint8_t> reply(root_reply_bytes(2));
  const uint32_t hdr[2] = {magic, 2};
  std::memcpy(reply.data(), hdr, 8);
  addr.to_wire(reply.data() + 8);
  addr.to_wire(reply.data() + 8 + SockAddr::kWireBytes);
  std::vector<SockAddr> table;
  ASSERT_TRUE(parse_root_reply(reply.data(), reply.size(), 2, &table));
  EXPECT_EQ(table.size(), 2u);
  EXPECT_TRUE(contains(parse_root_reply(reply.data(), reply.size(), 3, &table).message().c_str(),
                       "bad header (another job on that port?)"));
  EXPECT_TRUE(contains(parse_root_reply(reply.data(), reply.size() - 1, 2, &table).message().c_str(),
                       "wrong length"));

  // A normal reply is not a refusal.
  bool refused = true;
  size_t reason_bytes = 1;
  ASSERT_TRUE(parse_refusal_header(reply.data(), reply.size(), &refused, &reason_bytes));
  EXPECT_FALSE(refused);
  // The root's refusal: what it encodes is what the refused rank reads,
  // cut at 512 bytes, unprintable bytes shown as '?'.
  std::vector<uint8_t> refusal = encode_refusal("rank 1 says the job has 3 ranks\n\x01");
  ASSERT_TRUE(parse_refusal_header(refusal.data(), refusal.size(), &refused, &reason_bytes));
  EXPECT_TRUE(refused);
  ASSERT_EQ(reason_bytes, refusal.size() - 8);
  EXPECT_EQ(refusal_reason(refusal.data() + 8, reason_bytes), "rank 1 says the job has 3 ranks??");
  refusal = encode_refusal(std::string(2000, 'x'));
  ASSERT_TRUE(parse_refusal_header(refusal.data(), refusal.size(), &refused, &reason_bytes));
  EXPECT_EQ(reason_bytes, 512u);
  EXPECT_EQ(refusal.size(), 520u);
  EXPECT_TRUE(contains(parse_refusal_header(refusal.data(), 7, &refused, &reason_bytes).message().c_str(),
                       "truncated"));
  const uint32_t garbled[2] = {refusal[0] | refusal[1] << 8 | refusal[2] << 16 | uint32_t{refusal[3]} << 24,
                               513};
  std::memcpy(refusal.data(), garbled, 8);
  EXPECT_TRUE(contains(
      parse_refusal_header(refusal.data(), refusal.size(), &refused, &reason_bytes).message().c_str(),
      "announces 513 bytes of reason"));
  EXPECT_FALSE(refused);
}

}  // namespace
}  // namespace braid::test
