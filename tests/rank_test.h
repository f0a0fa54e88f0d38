// Helpers for tests that run on several forked ranks: gtest assertions work
// inside each rank, and a rank with a failure exits non-zero.
#pragma once

#include <braid/braid.h>
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "tools/launcher/fork_ranks.h"

namespace braid::test {

using Env = std::vector<std::pair<std::string, std::string>>;
using Body = std::function<void(braid_comm_t comm, int rank, int nranks)>;

inline launcher::LaunchResult launch(int nranks, const Env& env, const Body& body, double timeout_s = 120,
                                     bool make_comm = true,
                                     std::function<void(int)> per_rank_setup = nullptr) {
  launcher::LaunchOptions o;
  o.nranks = nranks;
  o.env = env;
  o.timeout_s = timeout_s;
  o.make_comm = make_comm;
  o.per_rank_setup = std::move(per_rank_setup);
  return launcher::fork_ranks(o, [&](braid_comm_t comm, int rank, int n, const braid_unique_id_t&) {
    body(comm, rank, n);
    return ::testing::Test::HasFailure() ? 1 : 0;
  });
}

// Runs body on nranks ranks and fails the test unless every rank succeeded.
inline void run_ranks(int nranks, const Env& env, const Body& body, double timeout_s = 120) {
  auto result = launch(nranks, env, body, timeout_s);
  ASSERT_TRUE(result.ok()) << result.describe();
}

inline Env transport_env(const std::string& transport) {
  return {{"BRAID_TRANSPORT", transport}};
}

#define BRAID_EXPECT_OK(call) EXPECT_EQ((call), BRAID_SUCCESS) << braid_get_last_error()
#define BRAID_ASSERT_OK(call) ASSERT_EQ((call), BRAID_SUCCESS) << braid_get_last_error()

}  // namespace braid::test
