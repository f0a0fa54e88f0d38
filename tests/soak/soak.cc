// braid-soak: a long random run, not part of the default suite.
//
//   braid-soak [--ranks 4] [--ops 20000] [--seed 1] [--max-count 262144]
//              [--transport shm|tcp] [--hosts H]
//
// --hosts H simulates H hosts (BRAID_HOST_ID), rank r on host r % H: hosts
// interleaved, so every ring and chain is reordered by host and each hop
// between hosts goes over tcp, the rest over shm.
// Forks the ranks on this host; every rank draws the same sequence of
// operations from the seed (collective, element count, dtype, reduction,
// root, in-place or not, blocking or `i`-form) and runs each through
// braid-check's harness, which compares every output element with a locally
// computed reference, bit for bit, and checks the bytes around the output.
// Every 1000 operations each rank samples its resident memory and open file
// descriptors; after the first 1000 (warm-up: buffers, slots, threads) they
// must not grow: RSS by at most --rss-slack-mb (the harness's buffers come
// and go with the drawn sizes), the bytes malloc has handed out by at most
// --heap-slack-mb, descriptors not at all.
// Prints one line per 1000 operations from rank 0 and a summary per rank.
#include <dirent.h>
#include <malloc.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tools/check/collective_check.h"
#include "tools/launcher/fork_ranks.h"

namespace {

struct Options {
  int ranks = 4;
  long ops = 20000;
  uint64_t seed = 1;
  size_t max_count = 262144;
  std::string transport;  // empty: braid's choice
  int hosts = 1;
  double rss_slack_mb = 8;
  double heap_slack_mb = 1;  // caches that reach their size late (hash tables, deques)
};

long resident_kib() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  long pages = 0, resident = 0;
  if (f != nullptr) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

// Bytes malloc has handed out and not had back (heap and mapped chunks):
// what a leak grows, whatever the allocator keeps resident.
long heap_kib() {
  struct mallinfo2 m = mallinfo2();
  return static_cast<long>((m.uordblks + m.hblkhd) / 1024);
}

int open_fds() {
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  int n = 0;
  while (readdir(d) != nullptr) ++n;
  closedir(d);
  return n - 3;  // ".", ".." and the directory's own descriptor
}

// Element counts spread over the sizes that take different paths (eager
// single pieces, pipelined pieces, several slots), log-uniform.
size_t draw_count(std::mt19937_64& rng, size_t max_count) {
  std::uniform_real_distribution<double> u(0.0, std::log2(static_cast<double>(max_count) + 1));
  return static_cast<size_t>(std::exp2(u(rng))) - 1;
}

int run_rank(braid_comm_t comm, int rank, int nranks, const Options& o) {
  using namespace braid::check;
  std::mt19937_64 rng(o.seed);  // the same draws on every rank
  const std::vector<Collective> colls = all_collectives();
  const std::vector<braid_dtype_t> dtypes = all_dtypes();
  const braid_redop_t ops[] = {BRAID_SUM, BRAID_PROD, BRAID_MIN, BRAID_MAX, BRAID_AVG};
  long checks = 0, failed = 0, api_errors = 0, base_kib = 0, max_growth_kib = 0, base_heap = 0,
       max_heap_growth = 0;
  int base_fds = -1, max_fd_growth = 0;
  FILE* sink = std::fopen("/dev/null", "w");
  // A fixed mmap threshold: the harness's large buffers are mapped and
  // returned on free, so resident memory follows what is live rather than
  // the allocator's high-water mark (glibc raises the threshold otherwise).
  mallopt(M_MMAP_THRESHOLD, 256 * 1024);
  mallopt(M_TRIM_THRESHOLD, 1024 * 1024);
  for (long i = 0; i < o.ops; ++i) {
    CheckOptions c;
    c.collectives = {colls[rng() % colls.size()]};
    c.dtypes = {dtypes[rng() % dtypes.size()]};
    c.ops = {ops[rng() % 5]};
    c.counts = {draw_count(rng, o.max_count)};
    c.roots = {static_cast<int>(rng() % static_cast<uint64_t>(nranks))};
    const bool in_place = rng() % 2 == 0;
    c.in_place = in_place;
    c.out_of_place = !in_place;
    const bool blocking = rng() % 2 == 0;
    c.blocking = blocking;
    c.nonblocking = !blocking;
    c.random_floats = false;
    c.seed = rng();
    c.max_failure_lines = 3;
    c.log = rank == 0 ? stderr : sink;
    CheckReport r = run_check_matrix(comm, c);
    checks += r.checks;
    if (!r.ok()) {
      failed += r.failed;
      api_errors += r.api_errors;
      std::fprintf(stderr, "rank %d: operation %ld (%s, %zu x %s, %s, root %d, %s, %s) failed: %s\n", rank, i,
                   collective_name(c.collectives[0]), c.counts[0], dtype_label(c.dtypes[0]),
                   redop_label(c.ops[0]), c.roots[0], in_place ? "in place" : "out of place",
                   blocking ? "blocking" : "i-form", r.summary().c_str());
      if (r.stopped_early) break;
    }
    if ((i + 1) % 1000 == 0) {
      const long kib = resident_kib(), heap = heap_kib();
      const int fds = open_fds();
      if (i + 1 == 1000) {
        base_kib = kib;
        base_heap = heap;
        base_fds = fds;
      } else {
        max_growth_kib = std::max(max_growth_kib, kib - base_kib);
        max_heap_growth = std::max(max_heap_growth, heap - base_heap);
        max_fd_growth = std::max(max_fd_growth, fds - base_fds);
      }
      if (rank == 0)
        std::printf("%6ld operations  %8ld checks  rss %6ld KiB  heap in use %6ld KiB  fds %d\n", i + 1,
                    checks, kib, heap, fds);
      std::fflush(stdout);
    }
  }
  std::fclose(sink);
  const bool memory_ok = max_growth_kib <= static_cast<long>(o.rss_slack_mb * 1024) &&
                         max_heap_growth <= static_cast<long>(o.heap_slack_mb * 1024) && max_fd_growth <= 0;
  std::printf(
      "rank %d: %ld operations, %ld checks, %ld failed, %ld api errors; growth after warm-up: rss %ld KiB, "
      "heap in use %ld KiB, fds %d: %s\n",
      rank, o.ops, checks, failed, api_errors, max_growth_kib, max_heap_growth, max_fd_growth,
      failed == 0 && api_errors == 0 && memory_ok ? "ok" : "FAILED");
  return failed == 0 && api_errors == 0 && memory_ok ? 0 : 1;
}

bool parse(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf(
          "usage: braid-soak [--ranks 4] [--ops 20000] [--seed 1] [--max-count 262144]\n"
          "                  [--transport shm|tcp] [--hosts 1] [--rss-slack-mb 8] [--heap-slack-mb 1]\n"
          "Random collectives checked bit for bit, with no growth in memory or descriptors after\n"
          "warm-up. --hosts H puts rank r on simulated host r %% H.\n");
      std::exit(0);
    }
    const char* v = i + 1 < argc ? argv[i + 1] : nullptr;
    if (v == nullptr) {
      std::fprintf(stderr, "braid-soak: %s needs a value\n", a.c_str());
      return false;
    }
    ++i;
    if (a == "--ranks")
      o->ranks = std::atoi(v);
    else if (a == "--ops")
      o->ops = std::atol(v);
    else if (a == "--seed")
      o->seed = std::strtoull(v, nullptr, 10);
    else if (a == "--max-count")
      o->max_count = std::strtoull(v, nullptr, 10);
    else if (a == "--transport")
      o->transport = v;
    else if (a == "--hosts")
      o->hosts = std::atoi(v);
    else if (a == "--rss-slack-mb")
      o->rss_slack_mb = std::atof(v);
    else if (a == "--heap-slack-mb")
      o->heap_slack_mb = std::atof(v);
    else {
      std::fprintf(stderr, "braid-soak: unknown option %s\n", a.c_str());
      return false;
    }
  }
  if (o->ranks < 1 || o->ops < 1 || o->max_count < 1 || o->hosts < 1) {
    std::fprintf(stderr, "braid-soak: --ranks, --ops, --max-count and --hosts must be positive\n");
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, &o)) return 2;
  braid::launcher::LaunchOptions lo;
  lo.nranks = o.ranks;
  lo.timeout_s = 3600;
  if (!o.transport.empty()) lo.env.push_back({"BRAID_TRANSPORT", o.transport});
  if (o.hosts > 1)
    lo.per_rank_setup = [&o](int rank) {
      setenv("BRAID_HOST_ID", ("soak-host-" + std::to_string(rank % o.hosts)).c_str(), 1);
    };
  auto result = braid::launcher::fork_ranks(
      lo, [&o](braid_comm_t comm, int rank, int nranks, const braid_unique_id_t&) {
        return run_rank(comm, rank, nranks, o);
      });
  if (!result.ok()) std::fprintf(stderr, "braid-soak: %s\n", result.describe().c_str());
  return result.ok() ? 0 : 1;
}
