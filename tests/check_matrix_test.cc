// The braid-check correctness matrix (tools/check/collective_check.h) on
// forked ranks over real shm and TCP transports, with the quick counts.
// A child exits non-zero when any check failed on any rank.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <tuple>

#include "tools/check/collective_check.h"
#include "tools/launcher/fork_ranks.h"

namespace {

using braid::check::CheckOptions;
using braid::check::CheckReport;
using braid::check::Collective;
using braid::launcher::LaunchOptions;

LaunchOptions launch_options(int nranks, const std::string& transport) {
  LaunchOptions lo;
  lo.nranks = nranks;
  lo.env = {{"BRAID_TRANSPORT", transport}, {"BRAID_SOCKET_IFNAME", "lo"}};
  lo.timeout_s = 300;  // a hang fails this case with a per-rank report, well inside ctest's limit
  return lo;
}

// The quick matrix, trimmed as the rank count grows: the test machine has two
// cores, so 5 and 8 ranks oversubscribe it.
CheckOptions options_for(int nranks) {
  CheckOptions o = braid::check::quick_options();
  o.op_timeout_s = 120;
  if (nranks >= 5) {
    o.dtypes = {BRAID_INT8, BRAID_UINT32, BRAID_INT64, BRAID_FLOAT16, BRAID_BFLOAT16, BRAID_FLOAT32};
  }
  if (nranks >= 8) {
    o.dtypes = {BRAID_INT32, BRAID_FLOAT16, BRAID_BFLOAT16, BRAID_FLOAT64};
    o.roots = {0, 3, nranks - 1};
  }
  return o;
}

int run_and_report(braid_comm_t comm, int rank, const CheckOptions& opts, const char* what) {
  CheckReport rep = braid::check::run_check_matrix(comm, opts);
  if (rank == 0) {
    std::fprintf(stderr, "check_matrix_test %s: %d ranks: %s (%.1f s)\n", what, rep.nranks,
                 rep.summary().c_str(), rep.seconds);
  }
  return rep.ok() ? 0 : 1;
}

class CheckMatrixTest : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

TEST_P(CheckMatrixTest, QuickMatrixPasses) {
  const auto& [nranks, transport] = GetParam();
  CheckOptions opts = options_for(nranks);
  auto result = braid::launcher::fork_ranks(launch_options(nranks, transport),
                                            [&](braid_comm_t comm, int rank, int, const braid_unique_id_t&) {
                                              return run_and_report(comm, rank, opts, transport.c_str());
                                            });
  ASSERT_TRUE(result.ok()) << nranks << " ranks over " << transport << ":\n" << result.describe();
}

INSTANTIATE_TEST_SUITE_P(Ranks, CheckMatrixTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 5, 8),
                                            ::testing::Values("shm", "tcp")),
                         [](const ::testing::TestParamInfo<CheckMatrixTest::ParamType>& info) {
                           return std::get<1>(info.param) + "_" + std::to_string(std::get<0>(info.param)) +
                                  "ranks";
                         });

// The harness must not be vacuous: corrupt the result of every 7th check on
// one rank and require exactly those checks to be reported, on every rank,
// with failure lines that name the check, the index, expected and got.
TEST(CheckMatrixHarness, DetectsInjectedFaults) {
  FILE* log = std::tmpfile();  // shared by the forked ranks
  ASSERT_NE(log, nullptr);
  CheckOptions opts;
  opts.counts = {0, 5, 1000};
  opts.dtypes = {BRAID_INT32, BRAID_FLOAT16, BRAID_FLOAT64};
  opts.inject_fault_every = 7;
  opts.max_failure_lines = 3;
  opts.op_timeout_s = 120;
  opts.log = log;
  auto result = braid::launcher::fork_ranks(
      launch_options(3, "shm"), [&](braid_comm_t comm, int rank, int, const braid_unique_id_t&) {
        CheckReport rep = braid::check::run_check_matrix(comm, opts);
        if (rank == 0) std::fprintf(stderr, "check_matrix_test injected: %s\n", rep.summary().c_str());
        bool as_expected = rep.total_injected > 0 && rep.total_failed == rep.total_injected &&
                           rep.failed == rep.injected && rep.total_api_errors == 0 && rep.agreement_ok &&
                           !rep.stopped_early && !rep.ok();
        return as_expected ? 0 : 1;
      });
  std::string text;
  std::fseek(log, 0, SEEK_SET);
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, log)) > 0;) text.append(buf, n);
  std::fclose(log);
  ASSERT_TRUE(result.ok()) << result.describe() << text;
  EXPECT_NE(text.find(": FAIL all_reduce int32 op="), std::string::npos) << text;
  EXPECT_NE(text.find(" elements wrong, first "), std::string::npos) << text;
  EXPECT_NE(text.find(": expected 0x"), std::string::npos) << text;
  EXPECT_NE(text.find(" got 0x"), std::string::npos) << text;
  EXPECT_NE(text.find("wrote outside the output"), std::string::npos) << text;
  EXPECT_NE(text.find("more failures; not printing them"), std::string::npos) << text;
}

// In a registered arena too small for every buffer: faults are still found
// exactly, windows carry the buffers that fit, and the rest (from the
// heap) are counted.
TEST(CheckMatrixHarness, RegisteredArenaFindsFaultsAndCountsWhatDidNotFit) {
  CheckOptions opts;
  opts.collectives = {Collective::kAllReduce, Collective::kAllGather};
  opts.counts = {5, 1000, 40000};
  opts.dtypes = {BRAID_INT32, BRAID_FLOAT32};
  opts.inject_fault_every = 5;
  opts.max_failure_lines = 0;
  opts.op_timeout_s = 120;
  opts.registered_arena_bytes = size_t{256} << 10;
  opts.log = std::tmpfile();
  ASSERT_NE(opts.log, nullptr);
  LaunchOptions lo = launch_options(3, "shm");
  lo.env.push_back({"BRAID_WINDOW_MIN_BYTES", "0"});
  auto result =
      braid::launcher::fork_ranks(lo, [&](braid_comm_t comm, int rank, int, const braid_unique_id_t&) {
        CheckReport rep = braid::check::run_check_matrix(comm, opts);
        if (rank == 0) std::fprintf(stderr, "check_matrix_test registered: %s\n", rep.summary().c_str());
        bool as_expected = rep.total_injected > 0 && rep.total_failed == rep.total_injected &&
                           rep.total_api_errors == 0 && rep.agreement_ok && !rep.stopped_early &&
                           rep.registered && rep.window_bytes > 0 && rep.heap_buffers > 0 &&
                           rep.summary().find(" bytes through registered windows") != std::string::npos;
        return as_expected ? 0 : 1;
      });
  std::fclose(opts.log);
  ASSERT_TRUE(result.ok()) << result.describe();
}

TEST(CheckMatrixHarness, ParsesNames) {
  for (Collective c : braid::check::all_collectives()) {
    Collective back;
    ASSERT_TRUE(braid::check::parse_collective(braid::check::collective_name(c), &back));
    EXPECT_EQ(back, c);
  }
  for (braid_dtype_t d : braid::check::all_dtypes()) {
    braid_dtype_t back;
    ASSERT_TRUE(braid::check::parse_dtype(braid::check::dtype_label(d), &back));
    EXPECT_EQ(back, d);
  }
  braid_dtype_t d;
  EXPECT_TRUE(braid::check::parse_dtype("bf16", &d));
  EXPECT_EQ(d, BRAID_BFLOAT16);
  EXPECT_FALSE(braid::check::parse_dtype("float8", &d));
  braid_redop_t op;
  EXPECT_TRUE(braid::check::parse_redop("avg", &op));
  EXPECT_EQ(op, BRAID_AVG);
  Collective c;
  EXPECT_FALSE(braid::check::parse_collective("allreduce2", &c));
  EXPECT_EQ(braid::check::quick_counts().size(), 5u);
  EXPECT_EQ(braid::check::default_counts().back(), (size_t{1} << 20) + 1);
}

}  // namespace
