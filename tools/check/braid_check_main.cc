// braid-check: runs the collective correctness matrix (tools/check/collective_check.h).
//
// Three ways to start it:
//
//   braid-check -n 4 [options]
//       Forks 4 ranks on this host (braid::launcher::fork_ranks) joined by one
//       communicator. BRAID_SOCKET_IFNAME defaults to "lo" here.
//
//   mpirun -np 4 braid-check [--id-file PATH] [options]
//   srun -n 4 braid-check [--id-file PATH] [options]
//       Rank and size come from the launcher's environment (Open MPI:
//       OMPI_COMM_WORLD_RANK/SIZE; MPICH/Hydra: PMI_RANK/PMI_SIZE; Slurm srun:
//       SLURM_PROCID/SLURM_STEP_NUM_TASKS). MPI is not linked: rank 0 creates
//       the unique id and publishes it in a file, the other ranks poll for it.
//       The file is written to PATH.tmp.<pid> and renamed to PATH (readers
//       never see half a file); it carries a key of the job so that a stale
//       file from an earlier job is ignored, and rank 0 removes it at the end.
//       Default PATH: /tmp/braid-check-<hash of the job key>.id, where the
//       job key is the first of PMIX_NAMESPACE, OMPI_MCA_orte_hnp_uri,
//       OMPI_MCA_ess_base_jobid, SLURM_JOB_ID.SLURM_STEP_ID found in the
//       environment, else the parent pid (the per-host launcher daemon).
//       /tmp is per host: across hosts pass --id-file on a shared filesystem.
//
//   torchrun --nproc-per-node 4 braid-check [options]
//       MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE: braid_comm_init_env.
//
// Exit status: 0 only if every check passed on every rank.
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "bench/flags.h"
#include "tools/check/collective_check.h"
#include "tools/launcher/fork_ranks.h"

namespace {

constexpr size_t kMaxCount = size_t{1} << 30;  // --sizes: elements per buffer

using braid::check::CheckOptions;
using braid::check::CheckReport;

void usage(FILE* f) {
  std::fprintf(
      f,
      "usage: braid-check [-n N] [options]\n"
      "  -n N                  fork N ranks on this host (otherwise: started by mpirun/srun/torchrun)\n"
      "  --transport shm|tcp   sets BRAID_TRANSPORT\n"
      "  --hosts H             -n mode: simulate H hosts (BRAID_HOST_ID), ranks split in blocks\n"
      "  --quick               counts 0,1,7,1000,70000 (default 0,1,2,7,31,1027,65553,1048577)\n"
      "  --sizes a,b,c         element counts (suffixes K, M, G multiply by 1024^k)\n"
      "  --collectives a,b     all_reduce,broadcast,reduce,all_gather,reduce_scatter,gather,\n"
      "                        scatter,all_to_all,barrier,send_recv,isend_irecv (default all)\n"
      "  --dtypes a,b          int8,uint8,int32,uint32,int64,uint64,float16,bfloat16,float32,float64\n"
      "  --ops a,b             sum,prod,min,max,avg,band,bor,bxor (default every op valid for the dtype)\n"
      "  --roots a,b           roots of rooted collectives (default every rank)\n"
      "  --seed S              input seed (default 1)\n"
      "  --no-in-place --no-out-of-place --no-blocking --no-nonblocking --no-random\n"
      "                        leave out a dimension of the matrix\n"
      "  --max-bytes B         skip checks whose largest buffer exceeds B bytes (default 1G; 0: no limit)\n"
      "  --register B          cut every buffer from a B-byte arena per rank, allocated with\n"
      "                        braid_mem_alloc and registered on the communicator\n"
      "  --timeout S           per-operation deadline (braid_comm_set_timeout)\n"
      "  --launch-timeout S    -n mode: kill every rank after S seconds (default 7200)\n"
      "  --id-file PATH        mpirun/srun mode: where rank 0 publishes the unique id\n"
      "  --init-timeout S      mpirun/srun mode: how long ranks wait for the id file (default 300)\n"
      "  --max-lines N         failure lines printed per rank (default 20)\n"
      "  -v, -vv               a line per (collective, dtype, count) group / also per check\n");
}

std::vector<std::string> split(std::string_view s) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i <= s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string_view::npos) j = s.size();
    if (j > i) out.emplace_back(s.substr(i, j - i));
    i = j + 1;
  }
  return out;
}

bool parse_double(const char* s, double* out) {
  char* end = nullptr;
  double v = std::strtod(s, &end);
  if (end == s || *end != '\0' || !(v >= 0)) return false;
  *out = v;
  return true;
}

bool parse_int(const char* s, long* out) {
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0') return false;
  *out = v;
  return true;
}

const char* env_or_null(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

uint64_t fnv1a(std::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return h;
}

// Rank and size from the environment of mpirun / srun.
bool launcher_rank(int* rank, int* size, std::string* launcher) {
  struct Pair {
    const char* rank;
    const char* size;
    const char* name;
  };
  static const Pair kPairs[] = {{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "Open MPI"},
                                {"PMI_RANK", "PMI_SIZE", "PMI"},
                                {"SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "Slurm"}};
  for (const Pair& p : kPairs) {
    const char* r = env_or_null(p.rank);
    const char* s = env_or_null(p.size);
    long rv = 0, sv = 0;
    if (r && s && parse_int(r, &rv) && parse_int(s, &sv) && sv >= 1 && rv >= 0 && rv < sv) {
      *rank = static_cast<int>(rv);
      *size = static_cast<int>(sv);
      *launcher = p.name;
      return true;
    }
  }
  return false;
}

// Same on every rank of one job, different between jobs. Empty when only the
// parent pid is available (which differs between hosts, so it is not checked).
std::string job_key(std::string* fallback) {
  for (const char* name : {"PMIX_NAMESPACE", "OMPI_MCA_orte_hnp_uri", "OMPI_MCA_ess_base_jobid"}) {
    if (const char* v = env_or_null(name)) return std::string(name) + "=" + v;
  }
  const char* job = env_or_null("SLURM_JOB_ID");
  const char* step = env_or_null("SLURM_STEP_ID");
  if (job && step) return std::string("slurm=") + job + "." + step;
  *fallback = "ppid=" + std::to_string(getppid());
  return "";
}

std::string to_hex(const void* p, size_t n) {
  static const char kHex[] = "0123456789abcdef";
  std::string s;
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) {
    s += kHex[b[i] >> 4];
    s += kHex[b[i] & 15];
  }
  return s;
}

bool from_hex(std::string_view s, void* p, size_t n) {
  if (s.size() != 2 * n) return false;
  auto* b = static_cast<unsigned char*>(p);
  auto nib = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < n; ++i) {
    int hi = nib(s[2 * i]), lo = nib(s[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    b[i] = static_cast<unsigned char>(hi << 4 | lo);
  }
  return true;
}

bool write_id_file(const std::string& path, const std::string& key, const braid_unique_id_t& id) {
  std::string tmp = path + ".tmp." + std::to_string(getpid());
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (!f) return false;
  char kh[32];
  std::snprintf(kh, sizeof kh, "%016" PRIx64, fnv1a(key));
  bool ok = std::fprintf(f, "braid-check-id 1 %s\n%s\n", key.empty() ? "-" : kh,
                         to_hex(id.internal, BRAID_UNIQUE_ID_BYTES).c_str()) > 0;
  ok = std::fflush(f) == 0 && ok;
  ok = fsync(fileno(f)) == 0 && ok;
  ok = std::fclose(f) == 0 && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return false;
  }
  return true;
}

// Polls until the file exists, is fresh and carries this job's key.
bool read_id_file(const std::string& path, const std::string& key, double timeout_s, time_t started,
                  braid_unique_id_t* id) {
  char kh[32];
  std::snprintf(kh, sizeof kh, "%016" PRIx64, fnv1a(key));
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < deadline) {
    struct stat st;
    if (stat(path.c_str(), &st) == 0 && st.st_mtime + 600 >= started) {
      if (FILE* f = std::fopen(path.c_str(), "r")) {
        char line1[128] = {0}, line2[2 * BRAID_UNIQUE_ID_BYTES + 8] = {0};
        bool got = std::fgets(line1, sizeof line1, f) && std::fgets(line2, sizeof line2, f);
        std::fclose(f);
        if (got) {
          std::string_view l1(line1), l2(line2);
          while (!l2.empty() && (l2.back() == '\n' || l2.back() == '\r')) l2.remove_suffix(1);
          std::string want = "braid-check-id 1 ";
          bool key_ok = l1.substr(0, want.size()) == want;
          std::string_view fk = l1.substr(std::min(want.size(), l1.size()));
          while (!fk.empty() && fk.back() == '\n') fk.remove_suffix(1);
          if (!key.empty() && fk != kh) key_ok = false;  // an earlier job's file
          if (key_ok && from_hex(l2, id->internal, BRAID_UNIQUE_ID_BYTES)) return true;
        }
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

std::string transport_name() {
  const char* t = env_or_null("BRAID_TRANSPORT");
  return t ? t : "auto";
}

void print_summary(const CheckReport& rep, int nranks) {
  std::printf("braid-check: %d ranks, transport %s: %s (%.1f s)\n", nranks, transport_name().c_str(),
              rep.summary().c_str(), rep.seconds);
  std::printf("braid-check: %" PRId64 " passed, %" PRId64 " failed%s\n", rep.total_checks - rep.total_failed,
              rep.total_failed, rep.ok() ? "" : "  -- FAILED");
  std::fflush(stdout);
}

void print_header(const CheckOptions& o, int nranks) {
  std::string counts;
  for (size_t c : o.counts.empty() ? braid::check::default_counts() : o.counts)
    counts += (counts.empty() ? "" : ",") + std::to_string(c);
  std::printf("braid-check: %d ranks, transport %s, counts %s, seed %" PRIu64 "\n", nranks,
              transport_name().c_str(), counts.c_str(), o.seed);
  std::fflush(stdout);
}

// Runs the matrix on one rank; prints the summary on rank 0.
int run_rank(braid_comm_t comm, int rank, int nranks, const CheckOptions& opts) {
  for (int root : opts.roots) {
    if (root < nranks) continue;
    // Every rank sees the same: none runs a check.
    if (rank == 0)
      std::printf("braid-check: --roots names rank %d, but there are %d ranks -- FAILED\n", root, nranks);
    return 1;
  }
  if (rank == 0) print_header(opts, nranks);
  CheckReport rep = braid::check::run_check_matrix(comm, opts);
  if (rank == 0) print_summary(rep, nranks);
  if (rep.ok() && rep.total_checks == 0) {
    // A selection that matches nothing (a typo in CI, say) must not pass.
    if (rank == 0)
      std::printf(
          "braid-check: no check matches the selection (avg needs a floating dtype, band/bor/bxor an "
          "integer one, roots must be below the number of ranks) -- FAILED\n");
    return 1;
  }
  return rep.ok() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CheckOptions opts;
  opts.log = stdout;  // failure and progress lines in order with the summary
  int nranks = 0, hosts = 1;
  std::string transport, id_file;
  double launch_timeout = 7200, init_timeout = 300;
  bool quick = false;

  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const char* name) -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "braid-check: %s needs a value\n", name);
        std::exit(2);
      }
      return argv[++i];
    };
    auto bad = [&](const std::string& what) {
      std::fprintf(stderr, "braid-check: bad %s\n", what.c_str());
      usage(stderr);
      std::exit(2);
    };
    if (a == "-h" || a == "--help") {
      usage(stdout);
      return 0;
    } else if (a == "-n" || a == "--nranks") {
      long v = 0;
      if (!parse_int(value("-n"), &v) || v < 1 || v > 4096) bad("-n");
      nranks = static_cast<int>(v);
    } else if (a == "--transport") {
      transport = value("--transport");
      if (transport != "shm" && transport != "tcp") bad("--transport (shm or tcp)");
    } else if (a == "--hosts") {
      long v = 0;
      if (!parse_int(value("--hosts"), &v) || v < 1 || v > 4096) bad("--hosts");
      hosts = static_cast<int>(v);
    } else if (a == "--quick") {
      quick = true;
    } else if (a == "--sizes") {
      opts.counts.clear();
      for (const auto& s : split(value("--sizes"))) {
        size_t c = 0;
        // Elements; the bound keeps count x element size x ranks within size_t.
        if (!braid_bench::parse_size(s.c_str(), &c) || c > kMaxCount)
          bad("--sizes entry '" + s + "' (element counts up to 1G, with K, M, G suffixes)");
        opts.counts.push_back(c);
      }
      if (opts.counts.empty()) bad("--sizes");
    } else if (a == "--collectives") {
      for (const auto& s : split(value("--collectives"))) {
        braid::check::Collective c;
        if (!braid::check::parse_collective(s, &c)) bad("--collectives entry '" + s + "'");
        opts.collectives.push_back(c);
      }
    } else if (a == "--dtypes") {
      for (const auto& s : split(value("--dtypes"))) {
        braid_dtype_t d;
        if (!braid::check::parse_dtype(s, &d)) bad("--dtypes entry '" + s + "'");
        opts.dtypes.push_back(d);
      }
    } else if (a == "--ops") {
      for (const auto& s : split(value("--ops"))) {
        braid_redop_t op;
        if (!braid::check::parse_redop(s, &op)) bad("--ops entry '" + s + "'");
        opts.ops.push_back(op);
      }
    } else if (a == "--roots") {
      for (const auto& s : split(value("--roots"))) {
        long r = 0;
        if (!parse_int(s.c_str(), &r) || r < 0 || r > INT_MAX) bad("--roots entry '" + s + "'");
        opts.roots.push_back(static_cast<int>(r));
      }
    } else if (a == "--seed") {
      size_t s = 0;
      if (!braid_bench::parse_size(value("--seed"), &s)) bad("--seed");
      opts.seed = s;
    } else if (a == "--no-in-place") {
      opts.in_place = false;
    } else if (a == "--no-out-of-place") {
      opts.out_of_place = false;
    } else if (a == "--no-blocking") {
      opts.blocking = false;
    } else if (a == "--no-nonblocking") {
      opts.nonblocking = false;
    } else if (a == "--no-random") {
      opts.random_floats = false;
    } else if (a == "--max-bytes") {
      size_t b = 0;
      if (!braid_bench::parse_size(value("--max-bytes"), &b)) bad("--max-bytes");
      opts.max_buffer_bytes = b;
    } else if (a == "--register") {
      size_t b = 0;
      if (!braid_bench::parse_size(value("--register"), &b) || b == 0) bad("--register");
      opts.registered_arena_bytes = b;
    } else if (a == "--timeout") {
      if (!parse_double(value("--timeout"), &opts.op_timeout_s)) bad("--timeout");
    } else if (a == "--launch-timeout") {
      if (!parse_double(value("--launch-timeout"), &launch_timeout) || launch_timeout <= 0)
        bad("--launch-timeout");
    } else if (a == "--init-timeout") {
      if (!parse_double(value("--init-timeout"), &init_timeout)) bad("--init-timeout");
    } else if (a == "--id-file") {
      id_file = value("--id-file");
    } else if (a == "--max-lines") {
      long v = 0;
      if (!parse_int(value("--max-lines"), &v) || v < 0 || v > INT_MAX) bad("--max-lines");
      opts.max_failure_lines = static_cast<int>(v);
    } else if (a == "-v" || a == "-vv" || a == "--verbose") {
      opts.verbose += a == "-vv" ? 2 : 1;
    } else {
      std::fprintf(stderr, "braid-check: unknown argument '%s'\n", a.c_str());
      usage(stderr);
      return 2;
    }
  }
  if (quick && opts.counts.empty()) opts.counts = braid::check::quick_counts();
  if (!transport.empty()) setenv("BRAID_TRANSPORT", transport.c_str(), 1);

  // ---- -n N: fork the ranks here ----
  if (nranks > 0) {
    if (std::getenv("BRAID_SOCKET_IFNAME") == nullptr) setenv("BRAID_SOCKET_IFNAME", "lo", 1);
    braid::launcher::LaunchOptions lo;
    lo.nranks = nranks;
    lo.timeout_s = launch_timeout;
    if (hosts > 1) {
      if (hosts > nranks) {
        std::fprintf(stderr, "braid-check: --hosts %d is more hosts than the %d ranks of -n\n", hosts,
                     nranks);
        return 2;
      }
      lo.per_rank_setup = [hosts, nranks](int rank) {
        setenv("BRAID_HOST_ID", ("sim-host-" + std::to_string(rank * hosts / nranks)).c_str(), 1);
      };
    }
    auto result = braid::launcher::fork_ranks(
        lo, [&opts](braid_comm_t comm, int rank, int n, const braid_unique_id_t&) {
          return run_rank(comm, rank, n, opts);
        });
    if (result.ok()) return 0;
    // Exit code 1 means failed checks, already summarised by rank 0; anything
    // else (a crash, a timeout, a failed init) is reported here.
    bool only_check_failures = !result.ranks.empty();
    for (const auto& r : result.ranks)
      if (r.timed_out || r.signal != 0 || (r.exit_code != 0 && r.exit_code != 1)) only_check_failures = false;
    if (!only_check_failures) std::printf("braid-check: FAILED:\n%s", result.describe().c_str());
    return 1;
  }

  // ---- mpirun / srun: rank and size from the environment, id through a file ----
  int rank = 0, size = 0;
  std::string launcher;
  braid_comm_t comm = nullptr;
  if (launcher_rank(&rank, &size, &launcher)) {
    std::string fallback;
    std::string key = job_key(&fallback);
    if (id_file.empty()) {
      char name[64];
      std::snprintf(name, sizeof name, "/tmp/braid-check-%016" PRIx64 ".id",
                    fnv1a(key.empty() ? fallback : key));
      id_file = name;
    }
    braid_unique_id_t id;
    std::memset(&id, 0, sizeof id);
    time_t started = time(nullptr);
    if (rank == 0) {
      if (braid_get_unique_id(&id) != BRAID_SUCCESS) {
        std::fprintf(stderr, "braid-check: rank 0: braid_get_unique_id failed: %s\n", braid_get_last_error());
        return 1;
      }
      if (!write_id_file(id_file, key, id)) {
        std::fprintf(stderr, "braid-check: rank 0: cannot write the id file %s: %s\n", id_file.c_str(),
                     std::strerror(errno));
        return 1;
      }
    } else if (!read_id_file(id_file, key, init_timeout, started, &id)) {
      std::fprintf(
          stderr,
          "braid-check: rank %d: no id file %s from rank 0 after %.0f s (%s launch; across hosts pass "
          "--id-file on a shared filesystem)\n",
          rank, id_file.c_str(), init_timeout, launcher.c_str());
      return 1;
    }
    braid_result_t r = braid_comm_init_rank(&comm, size, id, rank);
    if (rank == 0) std::remove(id_file.c_str());
    if (r != BRAID_SUCCESS) {
      std::fprintf(stderr, "braid-check: rank %d: braid_comm_init_rank failed: %s\n", rank,
                   braid_get_last_error());
      return 1;
    }
  } else if (env_or_null("MASTER_ADDR") && env_or_null("RANK") && env_or_null("WORLD_SIZE")) {
    // ---- torchrun / TorchDistributor environment ----
    if (braid_comm_init_env(&comm) != BRAID_SUCCESS) {
      std::fprintf(stderr, "braid-check: braid_comm_init_env failed: %s\n", braid_get_last_error());
      return 1;
    }
    if (braid_comm_rank(comm, &rank) != BRAID_SUCCESS || braid_comm_size(comm, &size) != BRAID_SUCCESS) {
      std::fprintf(stderr, "braid-check: cannot query the communicator: %s\n", braid_get_last_error());
      return 1;
    }
  } else {
    std::fprintf(stderr, "braid-check: pass -n N, or start it with mpirun, srun or torchrun\n");
    usage(stderr);
    return 2;
  }
  int code = run_rank(comm, rank, size, opts);
  if (braid_comm_destroy(comm) != BRAID_SUCCESS) {
    std::fprintf(stderr, "braid-check: rank %d: braid_comm_destroy failed: %s\n", rank,
                 braid_get_last_error());
    code = code == 0 ? 1 : code;
  }
  return code;
}
