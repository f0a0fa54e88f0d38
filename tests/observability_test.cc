// What braid shows about itself: log lines that parse, subsystem filters,
// the INFO summary at init, the pending-operation dump (braid_comm_dump and
// SIGUSR1) naming the peer that is held back, and per-rank traces that merge.
#include <braid/braid.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/rank_test.h"

namespace {

using braid::test::Env;

// A fresh directory per test for log and trace files; kept when the test
// failed, for a look at what was written.
struct ScratchDir {
  std::string path;
  explicit ScratchDir(const std::string& name)
      : path("/tmp/braid-observability-" + std::to_string(getpid()) + "-" + name) {
    EXPECT_EQ(std::system(("rm -rf '" + path + "' && mkdir -p '" + path + "'").c_str()), 0);
  }
  ~ScratchDir() {
    if (!::testing::Test::HasFailure()) std::system(("rm -rf '" + path + "'").c_str());
  }
};

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') out.push_back(e->d_name);
    }
    closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct LogLine {
  std::string host, level, subsys, message;
  int pid, rank;
};

// "braid <host>:<pid> [rank] LEVEL SUBSYS message"; false if the line is not that.
bool parse_line(const std::string& line, LogLine* out) {
  std::istringstream in(line);
  std::string braid, host_pid, rank, rest;
  if (!(in >> braid >> host_pid >> rank >> out->level >> out->subsys) || braid != "braid") return false;
  const size_t colon = host_pid.rfind(':');
  if (colon == std::string::npos || colon == 0 || rank.size() < 3 || rank.front() != '[' ||
      rank.back() != ']')
    return false;
  out->host = host_pid.substr(0, colon);
  char* end = nullptr;
  out->pid = static_cast<int>(std::strtol(host_pid.c_str() + colon + 1, &end, 10));
  if (*end != '\0' || out->pid <= 0) return false;
  out->rank = static_cast<int>(std::strtol(rank.c_str() + 1, &end, 10));
  if (*end != ']') return false;
  static const std::set<std::string> kLevels = {"WARN", "INFO", "TRACE"};
  static const std::set<std::string> kSubsystems = {"INIT", "BOOTSTRAP", "TOPO", "TUNE",  "SHM",
                                                    "TCP",  "COLL",      "P2P",  "TRACE", "DUMP"};
  if (!kLevels.count(out->level) || !kSubsystems.count(out->subsys)) return false;
  std::getline(in, rest);
  if (rest.size() < 2 || rest[0] != ' ') return false;
  out->message = rest.substr(1);
  return true;
}

// Every line of every file must parse; returns them all.
std::vector<LogLine> parse_logs(const std::string& dir) {
  std::vector<LogLine> lines;
  for (const std::string& name : files_in(dir)) {
    std::istringstream in(read_file(dir + "/" + name));
    std::string line;
    while (std::getline(in, line)) {
      LogLine parsed;
      if (!parse_line(line, &parsed)) {
        ADD_FAILURE() << name << ": line does not parse: '" << line << "'";
        continue;
      }
      lines.push_back(parsed);
    }
  }
  return lines;
}

bool any_line(const std::vector<LogLine>& lines, int rank, const std::string& subsys,
              const std::string& needle) {
  for (const LogLine& l : lines) {
    if (l.rank == rank && l.subsys == subsys && l.message.find(needle) != std::string::npos) return true;
  }
  return false;
}

// 2 ranks of one host logging `subsys` at INFO into files in `dir`, with
// `env` added; each sums `count` ones with all_reduce and checks the 2s.
braid::launcher::LaunchResult two_ranks_logging(const std::string& dir, const char* subsys, const Env& env,
                                                size_t count) {
  braid::launcher::LaunchOptions o;
  o.nranks = 2;
  o.env = {
      {"BRAID_DEBUG", "INFO"}, {"BRAID_DEBUG_SUBSYS", subsys}, {"BRAID_DEBUG_FILE", dir + "/log-%p.txt"}};
  o.env.insert(o.env.end(), env.begin(), env.end());
  return braid::launcher::fork_ranks(o, [count](braid_comm_t comm, int, int, const braid_unique_id_t&) {
    std::vector<float> x(count, 1.0f);
    if (braid_all_reduce(x.data(), x.data(), x.size(), BRAID_FLOAT32, BRAID_SUM, comm, nullptr) !=
        BRAID_SUCCESS)
      return 1;
    for (float v : x)
      if (v != 2.0f) return 1;
    return 0;
  });
}

// Ranks 0-1 on simulated host "hostA", 2-3 on "hostB".
void two_hosts(int rank) {
  setenv("BRAID_HOST_ID", rank < 2 ? "hostA" : "hostB", 1);
}

TEST(Observability, InfoLogAtInitParsesAndSummarises) {
  const ScratchDir scratch("info");
  const std::string& dir = scratch.path;
  braid::launcher::LaunchOptions o;
  o.nranks = 4;
  o.env = {{"BRAID_DEBUG", "INFO"}, {"BRAID_DEBUG_FILE", dir + "/log-%h-%p.txt"}};
  o.per_rank_setup = two_hosts;
  auto result = braid::launcher::fork_ranks(o, [](braid_comm_t comm, int, int, const braid_unique_id_t&) {
    float x = 1;
    return braid_all_reduce(&x, &x, 1, BRAID_FLOAT32, BRAID_SUM, comm, nullptr) == BRAID_SUCCESS && x == 4
               ? 0
               : 1;
  });
  ASSERT_TRUE(result.ok()) << result.describe();
  const auto files = files_in(dir);
  ASSERT_EQ(files.size(), 4u) << "one log file per process";
  const auto lines = parse_logs(dir);
  for (const LogLine& l : lines) {
    EXPECT_EQ(l.host, l.rank < 2 ? "hostA" : "hostB") << l.message;
  }
  // %h and %p in the file name are the host and pid of the lines inside.
  for (const std::string& name : files) {
    const std::string text = read_file(dir + "/" + name);
    EXPECT_NE(text.find("braid " + name.substr(4, 5) + ":" + name.substr(10, name.size() - 14) + " ["),
              std::string::npos)
        << name;
  }
  for (int r = 0; r < 4; ++r) {
    EXPECT_TRUE(any_line(lines, r, "INIT", "braid 0.1.0: rank " + std::to_string(r) + " of 4")) << r;
    EXPECT_TRUE(any_line(lines, r, "TOPO", "2 host(s): hostA ranks 0-1, hostB ranks 2-3")) << r;
    // 2 hosts x 2 ranks: the hierarchical schedule for large all_reduces.
    EXPECT_TRUE(any_line(lines, r, "TUNE", "all_reduce: ")) << r;
    EXPECT_TRUE(any_line(lines, r, "TUNE", "<= hier")) << r;
    EXPECT_TRUE(any_line(lines, r, "TOPO", "paths: ")) << r;
  }
  EXPECT_TRUE(any_line(lines, 0, "INIT", "transports: shm to ranks 1; tcp to ranks 2-3"));
  EXPECT_TRUE(any_line(lines, 3, "INIT", "transports: tcp to ranks 0-1; shm to ranks 2"));
}

// A misspelt setting set after the first communicator is warned about at
// the next one's init (a benchmark's --env-compare variant was silent), and
// each name once per process.
TEST(Observability, AMisspeltSettingSetLaterIsWarnedAboutOnce) {
  const ScratchDir scratch("misspelt");
  braid::launcher::LaunchOptions o;
  o.nranks = 1;
  o.env = {{"BRAID_DEBUG_FILE", scratch.path + "/log.txt"}, {"BRAID_TIMOUT", "5"}};
  auto result = braid::launcher::fork_ranks(o, [](braid_comm_t, int, int, const braid_unique_id_t&) {
    setenv("BRAID_SPIN_UZ", "1", 1);
    for (int i = 0; i < 2; ++i) {
      braid_unique_id_t id;
      braid_comm_t comm = nullptr;
      if (braid_get_unique_id(&id) != BRAID_SUCCESS || braid_comm_init_rank(&comm, 1, id, 0) != BRAID_SUCCESS)
        return 1;
      braid_comm_destroy(comm);
    }
    return 0;
  });
  ASSERT_TRUE(result.ok()) << result.describe();
  const std::string text = read_file(scratch.path + "/log.txt");
  auto count = [&](const std::string& what) {
    size_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count("BRAID_TIMOUT is not a braid setting (did you mean BRAID_TIMEOUT?)"), 1u) << text;
  EXPECT_EQ(count("BRAID_SPIN_UZ is not a braid setting (did you mean BRAID_SPIN_US?)"), 1u) << text;
}

// Under BRAID_TRANSPORT=tcp the ranks of one host talk over tcp too: the
// tuner prices every link as tcp, so the hierarchical schedules (whose gain
// is shared memory inside a host) are not picked.
TEST(Observability, UnderTcpTheTunerPricesEveryLinkAsTcp) {
  const ScratchDir scratch("tcp");
  braid::launcher::LaunchOptions o;
  o.nranks = 4;
  o.env = {{"BRAID_DEBUG", "INFO"},
           {"BRAID_DEBUG_SUBSYS", "TUNE,INIT"},
           {"BRAID_DEBUG_FILE", scratch.path + "/log-%p.txt"},
           {"BRAID_TRANSPORT", "tcp"}};
  o.per_rank_setup = two_hosts;
  auto result =
      braid::launcher::fork_ranks(o, [](braid_comm_t, int, int, const braid_unique_id_t&) { return 0; });
  ASSERT_TRUE(result.ok()) << result.describe();
  const auto lines = parse_logs(scratch.path);
  for (int r = 0; r < 4; ++r) {
    EXPECT_TRUE(any_line(lines, r, "TUNE", "all_reduce: ")) << r;
    EXPECT_FALSE(any_line(lines, r, "TUNE", "hier")) << r;
  }
  EXPECT_TRUE(any_line(lines, 0, "INIT", "transports: tcp to ranks 1-3"));
}

// Streaming or plain stores for mid-size shm slot copies: the first two
// ranks of a host time both at init and every rank of the host logs the
// same choice with the times, which the choice must follow.
TEST(Observability, ShmSlotCopiesFollowTheirMeasurement) {
  for (bool set : {false, true}) {
    const ScratchDir scratch("stream");
    const std::string& dir = scratch.path;
    // 64 KiB: inside the band.
    auto result =
        two_ranks_logging(dir, "SHM", set ? Env{{"BRAID_SHM_STREAM_MAX_BYTES", "128K"}} : Env{}, 1 << 14);
    ASSERT_TRUE(result.ok()) << result.describe();
    std::vector<std::string> said(2);
    for (const LogLine& l : parse_logs(dir))
      if (l.subsys == "SHM" && l.message.find("slot copies") != std::string::npos)
        said.at(l.rank) = l.message;
    ASSERT_FALSE(said[0].empty());
    EXPECT_EQ(said[0], said[1]) << "both ranks of the host apply one choice";
    const std::string& m = said[0];
    if (sysconf(_SC_NPROCESSORS_ONLN) < 2) {
      EXPECT_NE(m.find("plain stores: ranks share cores"), std::string::npos) << m;
      continue;
    }
    double plain = 0, streaming = 0;
    const size_t at = m.find("a 64 KiB copy between ranks 0 and 1 took ");
    ASSERT_NE(at, std::string::npos) << m;
    ASSERT_EQ(
        std::sscanf(m.c_str() + at, "a 64 KiB copy between ranks 0 and 1 took %lf us plain, %lf us streaming",
                    &plain, &streaming),
        2)
        << m;
    EXPECT_GT(plain, 0);
    EXPECT_GT(streaming, 0);
    if (set)
      EXPECT_NE(
          m.find("slot copies of 16 KiB up to 128 KiB use streaming stores, as BRAID_SHM_STREAM_*_BYTES say"),
          std::string::npos)
          << m;
    else if (streaming < 0.85 * plain)
      EXPECT_NE(m.find("slot copies of 16 KiB up to 256 KiB use streaming stores;"), std::string::npos) << m;
    else
      EXPECT_NE(m.find("slot copies use plain stores;"), std::string::npos) << m;
  }
}

// On one host each collective that may read peers' buffers is timed both
// ways at init: every rank logs the same times, and the tuner's line
// follows them. A collective BRAID_ALGO forces is not timed, and without
// peer reads nothing is. With a short timeout the probe may not fit its
// budget, and BRAID_TUNE_PROBE=0 turns it off: then every rank says so and
// keeps the fixed rates.
TEST(Observability, PeerReadsAreTimedAtInitAndDecide) {
  enum class Skip { kNever, kMay, kMust };
  struct Case {
    Env env;
    std::vector<std::string> timed;
    Skip skip = Skip::kNever;
  };
  const std::vector<std::string> all = {"all_reduce", "broadcast", "all_gather", "reduce_scatter"};
  const Case cases[] = {
      {{}, all},
      {{{"BRAID_ALGO", "all_reduce:ring"}}, {"broadcast", "all_gather", "reduce_scatter"}},
      {{{"BRAID_SHM_PEER_READS", "0"}}, {}},
      {{{"BRAID_TIMEOUT", "0.3"}}, all, Skip::kMay},  // the probe may not fit a tenth of it
      {{{"BRAID_TUNE_PROBE", "0"}}, {}, Skip::kMust},
  };
  for (const Case& c : cases) {
    const ScratchDir scratch("probe");
    const std::string& dir = scratch.path;
    // The sanitizer builds export BRAID_TUNE_PROBE=0; these cases set it.
    Env env = {{"BRAID_TUNE_PROBE", "1"}};
    env.insert(env.end(), c.env.begin(), c.env.end());
    auto result = two_ranks_logging(dir, "TUNE", env, 1 << 18);  // 1 MiB, where the timed choice applies
    ASSERT_TRUE(result.ok()) << result.describe();
    std::map<std::string, std::string> timed[2], picks[2];
    bool skipped[2] = {false, false};
    for (const LogLine& l : parse_logs(dir)) {
      const size_t colon = l.message.find(':');
      const std::string head = l.message.substr(0, l.message.find(' '));
      if (l.message.find(" of 1 MiB: ") != std::string::npos)
        timed[l.rank][head] = l.message;
      else if (l.message.find("peer reads not timed: ") != std::string::npos)
        skipped[l.rank] = true;
      else if (colon != std::string::npos && colon == head.size() - 1)
        picks[l.rank][head.substr(0, colon)] = l.message;
    }
    EXPECT_EQ(timed[0], timed[1]) << "both ranks decide from the same times";
    EXPECT_EQ(picks[0], picks[1]);
    EXPECT_EQ(skipped[0], skipped[1]);
    if (c.skip != Skip::kMay) {
      EXPECT_EQ(skipped[0], c.skip == Skip::kMust);
    }
    if (skipped[0]) {
      // Untimed, 2 ranks read peers for all_reduce at the fixed rates.
      EXPECT_TRUE(timed[0].empty());
      EXPECT_NE(picks[0]["all_reduce"].find("<= peer_read"), std::string::npos) << picks[0]["all_reduce"];
      continue;
    }
    std::set<std::string> names;
    for (const auto& [name, line] : timed[0]) names.insert(name);
    EXPECT_EQ(names, std::set<std::string>(c.timed.begin(), c.timed.end()));
    for (const auto& [name, line] : timed[0]) {
      double reads = 0, ring = 0;
      ASSERT_EQ(std::sscanf(line.c_str() + name.size(), " of 1 MiB: %lf us reading peers, %lf us on the",
                            &reads, &ring),
                2)
          << line;
      EXPECT_NE(line.find(name == "broadcast" ? "on the chain" : "on the ring"), std::string::npos) << line;
      EXPECT_GT(reads, 0) << line;
      EXPECT_GT(ring, 0) << line;
      // At 1 MiB on 2 ranks the ring (chain) is the model's best choice that
      // does not read peers.
      const bool reads_picked = picks[0][name].find("<= peer_read") != std::string::npos;
      if (reads < 0.98 * ring) {
        EXPECT_TRUE(reads_picked) << line << "; " << picks[0][name];
      }
      if (reads > ring) {
        EXPECT_FALSE(reads_picked) << line << "; " << picks[0][name];
      }
    }
  }
}

// The probe's times are kept per process by shape: a later communicator of
// the same shape uses them where every one of its ranks holds the same
// times, and times afresh (all its ranks) where any lacks them or holds
// times another communicator took.
TEST(Observability, ProbeTimesAreKeptForLaterCommunicatorsOfTheSameShape) {
  const ScratchDir scratch("probe-kept");
  const std::string& dir = scratch.path;
  braid::test::run_ranks(
      3,
      {{"BRAID_TUNE_PROBE", "1"},
       {"BRAID_TIMEOUT", "600"},  // a budget the probe fits in any build
       // Whether slot copies stream is part of the shape and otherwise timed
       // per communicator: a close call under a sanitizer flipped it
       // between two {0, 1} communicators, whose probe times were then not
       // kept. Set, it is the same for all.
       {"BRAID_SHM_STREAM_MAX_BYTES", "256K"},
       {"BRAID_DEBUG", "INFO"},
       {"BRAID_DEBUG_SUBSYS", "INIT,TUNE"},
       {"BRAID_DEBUG_FILE", dir + "/log-%p.txt"}},
      [](braid_comm_t comm, int rank, int) {
        for (auto [a, b] : {std::pair{0, 1}, {0, 1}, {1, 2}, {0, 2}}) {
          const bool in = rank == a || rank == b;
          braid_comm_t pair = nullptr;
          BRAID_ASSERT_OK(braid_comm_split(comm, in ? 0 : BRAID_SPLIT_NOCOLOR, rank, &pair));
          ASSERT_EQ(pair != nullptr, in);
          if (pair == nullptr) continue;
          float x = 1.0f;
          BRAID_ASSERT_OK(braid_all_reduce(&x, &x, 1, BRAID_FLOAT32, BRAID_SUM, pair, nullptr));
          EXPECT_EQ(x, 2.0f);
          BRAID_ASSERT_OK(braid_comm_destroy(pair));
        }
      });
  // Per process, in order: each communicator's all_reduce line, "timed" or
  // "kept", and its numbers. The process's rank is its 3-rank line's.
  std::map<int, std::vector<std::string>> seen, numbers;  // by rank in the 3-rank communicator
  for (const std::string& name : files_in(dir)) {
    std::istringstream in(read_file(dir + "/" + name));
    std::string line;
    int world = -1;
    std::vector<std::string> seq, nums;
    while (std::getline(in, line)) {
      LogLine l;
      ASSERT_TRUE(parse_line(line, &l)) << line;
      if (l.subsys == "INIT" && l.message.find(" of 3, host ") != std::string::npos) world = l.rank;
      if (l.message.rfind("all_reduce of 1 MiB: ", 0) != 0) continue;
      const bool kept = l.message.find("timed by an earlier communicator of this shape") != std::string::npos;
      seq.push_back(kept ? "kept" : "timed");
      nums.push_back(l.message.substr(0, l.message.find(" (")));
    }
    ASSERT_GE(world, 0) << name;
    seen[world] = seq;
    numbers[world] = nums;
  }
  using V = std::vector<std::string>;
  // The 3-rank communicator first, then the pairs each process is in.
  EXPECT_EQ(seen[0], (V{"timed", "timed", "kept", "timed"}))
      << "ranks 0 and 2 held different times for {0, 2}";
  EXPECT_EQ(seen[1], (V{"timed", "timed", "kept", "timed"})) << "rank 2 had no times for {1, 2}";
  EXPECT_EQ(seen[2], (V{"timed", "timed", "timed"}));
  ASSERT_EQ(numbers[0].size(), 4u);
  ASSERT_EQ(numbers[1].size(), 4u);
  ASSERT_EQ(numbers[2].size(), 3u);
  // Each pair decides from the same numbers on both its ranks; the kept ones
  // are those {0, 1} measured.
  EXPECT_EQ(numbers[1][1], numbers[0][1]);
  EXPECT_EQ(numbers[0][2], numbers[0][1]);
  EXPECT_EQ(numbers[1][2], numbers[0][1]);
  EXPECT_EQ(numbers[1][3], numbers[2][1]);
  EXPECT_EQ(numbers[0][3], numbers[2][2]);
}

TEST(Observability, SubsystemsCanBeSelectedOrExcluded) {
  // "TUNS": a typo keeps the default (everything); "^ALL": nothing.
  for (const std::string filter : {"TUNE", "^INIT,TOPO", "TUNS", "^ALL"}) {
    const ScratchDir scratch("subsys");
    const std::string& dir = scratch.path;
    braid::test::run_ranks(
        2,
        {{"BRAID_DEBUG", "INFO"}, {"BRAID_DEBUG_SUBSYS", filter}, {"BRAID_DEBUG_FILE", dir + "/log-%p.txt"}},
        [](braid_comm_t, int, int) {});
    const auto lines = parse_logs(dir);
    if (filter == "^ALL") {
      EXPECT_TRUE(lines.empty()) << lines.front().message;
      continue;
    }
    ASSERT_FALSE(lines.empty()) << filter;
    if (filter == "TUNS") {
      std::set<std::string> seen;
      for (const LogLine& l : lines) seen.insert(l.subsys);
      EXPECT_TRUE(seen.count("INIT") && seen.count("TUNE")) << lines.size() << " lines";
      continue;
    }
    for (const LogLine& l : lines) {
      if (filter == "TUNE") {
        EXPECT_EQ(l.subsys, "TUNE") << l.message;
      } else {
        EXPECT_NE(l.subsys, "INIT") << l.message;
        EXPECT_NE(l.subsys, "TOPO") << l.message;
      }
    }
  }
}

// Ranks 0 and 1 start an all_reduce; rank 2 is held back. Rank 0 asks for a
// dump with braid_comm_dump, rank 1 with SIGUSR1: both must name rank 2.
TEST(Observability, DumpNamesThePeerHeldBack) {
  const ScratchDir scratch("dump");
  const std::string& dir = scratch.path;
  braid::test::run_ranks(
      // Direct: every rank waits on rank 2 itself (the dump names it).
      3, {{"BRAID_DEBUG_FILE", dir + "/log-%p.txt"}, {"BRAID_ALGO", "all_reduce:direct"}},
      [](braid_comm_t comm, int rank, int) {
        std::vector<float> x(1024, 1.0f);
        if (rank == 2) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
        braid_request_t req = nullptr;
        BRAID_ASSERT_OK(
            braid_iall_reduce(x.data(), x.data(), x.size(), BRAID_FLOAT32, BRAID_SUM, comm, nullptr, &req));
        if (rank == 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(400));
          BRAID_EXPECT_OK(braid_comm_dump(comm));
        } else if (rank == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(400));
          kill(getpid(), SIGUSR1);
          std::this_thread::sleep_for(
              std::chrono::milliseconds(200));  // the driver wakes at least every 20 ms
        }
        BRAID_EXPECT_OK(braid_wait(&req));
        EXPECT_EQ(x[0], 3.0f);
      });
  const auto lines = parse_logs(dir);
  EXPECT_TRUE(any_line(lines, 0, "DUMP", "braid_comm_dump: 1 operation(s) in flight"));
  EXPECT_TRUE(any_line(lines, 0, "DUMP", "all_reduce #0 (direct, 4096 bytes): step"));
  EXPECT_TRUE(any_line(lines, 0, "DUMP", "waiting for a message from rank 2"));
  EXPECT_TRUE(any_line(lines, 1, "DUMP", "SIGUSR1: 1 operation(s) in flight"));
  EXPECT_TRUE(any_line(lines, 1, "DUMP", "waiting for a message from rank 2"));
  EXPECT_FALSE(any_line(lines, 2, "DUMP", "")) << "rank 2 was not asked";
}

TEST(Observability, TracesOfFourRanksMerge) {
  const ScratchDir scratch("trace");
  const std::string& dir = scratch.path;
  braid::launcher::LaunchOptions o;
  o.nranks = 4;
  o.env = {{"BRAID_TRACE_FILE", dir + "/trace-%r.json"},
           {"BRAID_TRACE_MIN_WAIT_US", "0"},
           {"BRAID_ALGO", "all_reduce:direct"}};  // where it fits one piece; the tuner's pick above
  o.per_rank_setup = two_hosts;
  auto result =
      braid::launcher::fork_ranks(o, [](braid_comm_t comm, int rank, int n, const braid_unique_id_t&) {
        std::vector<float> small(16, 1.0f), big(1 << 18, 1.0f);
        int bad = 0;
        // Ranks held back on purpose: every rank then has a wait long
        // enough to be recorded (ranks 0-2 here, rank 3 at the last
        // barrier). The first barrier lines the ranks up after init, whose
        // last steps end at different times on different ranks.
        bad |= braid_barrier(comm, nullptr);
        if (rank == 3) usleep(20000);
        bad |= braid_all_reduce(small.data(), small.data(), small.size(), BRAID_FLOAT32, BRAID_SUM, comm,
                                nullptr);
        bad |= braid_all_reduce(big.data(), big.data(), big.size(), BRAID_FLOAT32, BRAID_SUM, comm, nullptr);
        bad |= braid_broadcast(big.data(), big.data(), big.size(), BRAID_FLOAT32, 0, comm, nullptr);
        braid_request_t reqs[2];
        bad |= braid_isend(small.data(), 4, BRAID_FLOAT32, (rank + 1) % n, comm, nullptr, &reqs[0]);
        bad |= braid_irecv(small.data() + 8, 4, BRAID_FLOAT32, (rank + n - 1) % n, comm, nullptr, &reqs[1]);
        bad |= braid_wait_all(2, reqs);
        if (rank == 0) usleep(20000);
        bad |= braid_barrier(comm, nullptr);
        return bad;
      });
  ASSERT_TRUE(result.ok()) << result.describe();
  ASSERT_EQ(files_in(dir),
            (std::vector<std::string>{"trace-0.json", "trace-1.json", "trace-2.json", "trace-3.json"}));
  for (int r = 0; r < 4; ++r) {
    const std::string text = read_file(dir + "/trace-" + std::to_string(r) + ".json");
    for (const char* needle : {"\"name\":\"all_reduce\"", "\"algorithm\":\"direct\"",
                               "\"name\":\"broadcast\"", "\"name\":\"send\"", "\"name\":\"recv\"",
                               "\"name\":\"barrier\"", "\"name\":\"wait\"", "\"pid\":"}) {
      EXPECT_NE(text.find(needle), std::string::npos) << "rank " << r << " lacks " << needle;
    }
  }
  // The merge tool validates every file (JSON, one rank each, begin/end pairs per track).
  const std::string cmd = "python3 " BRAID_SOURCE_DIR "/tools/braid-trace-merge " + dir +
                          "/trace-*.json -o " + dir + "/merged.json > " + dir + "/merge.txt 2>&1";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << read_file(dir + "/merge.txt");
  EXPECT_NE(read_file(dir + "/merge.txt").find("4 ranks"), std::string::npos)
      << read_file(dir + "/merge.txt");
}

// A plain path (no %r) still gives each rank its own file; and an op that
// outlasts 2^32 clock ticks (under 2 s on a fast clock) keeps its length.
TEST(Observability, EachRankTracesToItsOwnFileAndLongOpsKeepTheirLength) {
  const ScratchDir scratch("trace-plain");
  const std::string& dir = scratch.path;
  braid::test::run_ranks(
      2, {{"BRAID_TRACE_FILE", dir + "/trace.json"}}, [](braid_comm_t comm, int rank, int) {
        float x = 1.0f;
        if (rank == 1) usleep(2500 * 1000);
        BRAID_ASSERT_OK(braid_all_reduce(&x, &x, 1, BRAID_FLOAT32, BRAID_SUM, comm, nullptr));
        EXPECT_EQ(x, 2.0f);
      });
  ASSERT_EQ(files_in(dir), (std::vector<std::string>{"trace-r0.json", "trace-r1.json"}));
  // Rank 0's all_reduce waited about 2.5 s for rank 1: its begin and end.
  const std::string text = read_file(dir + "/trace-r0.json");
  auto ts_after = [&text](const std::string& needle) {
    const size_t at = text.find(needle);
    if (at == std::string::npos) return -1.0;
    const size_t ts = text.find("\"ts\":", at);
    return std::atof(text.c_str() + ts + 5);
  };
  const double begin = ts_after("{\"ph\":\"B\",\"name\":\"all_reduce\"");
  const double end = ts_after("{\"ph\":\"E\",\"name\":\"all_reduce\"");
  ASSERT_GE(begin, 0.0) << text;
  ASSERT_GE(end, 0.0) << text;
  EXPECT_GT(end - begin, 2.2e6) << text;
  EXPECT_LT(end - begin, 60e6) << text;
}

TEST(Observability, BadSettingsNameTheVariable) {
  const ScratchDir scratch("bad");
  const std::string& dir = scratch.path;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"BRAID_TRACE_MIN_WAIT_US", "soon"}, {"BRAID_TRACE_MAX_EVENTS", "0"}, {"BRAID_DUMP_SIGNAL", "2"}};
  for (const auto& [name, value] : cases) {
    braid::launcher::LaunchOptions o;
    o.nranks = 1;
    o.make_comm = false;
    auto result = braid::launcher::fork_ranks(o, [&](braid_comm_t, int, int, const braid_unique_id_t&) {
      setenv(name.c_str(), value.c_str(), 1);
      braid_unique_id_t id;
      const braid_result_t r = braid_get_unique_id(&id);
      const std::string msg = braid_get_last_error();
      if (r != BRAID_ERR_INVALID_ARGUMENT || msg.find(name) == std::string::npos) {
        std::fprintf(stderr, "%s=%s: got %d '%s'\n", name.c_str(), value.c_str(), r, msg.c_str());
        return 1;
      }
      return 0;
    });
    EXPECT_TRUE(result.ok()) << name << ": " << result.describe();
  }
  // A trace file that cannot be written is reported, and the job goes on.
  braid::test::run_ranks(
      1, {{"BRAID_TRACE_FILE", dir + "/missing/dir/trace.json"}, {"BRAID_DEBUG_FILE", dir + "/log.txt"}},
      [](braid_comm_t, int, int) {});
  EXPECT_NE(read_file(dir + "/log.txt").find("BRAID_TRACE_FILE: cannot write the trace to"),
            std::string::npos)
      << read_file(dir + "/log.txt");
}

}  // namespace
