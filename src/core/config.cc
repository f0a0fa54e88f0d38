#include "src/core/config.h"

#include <unistd.h>  // environ

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>

#include "kernels/cpu/reduce_kernels.h"
#include "src/core/logging.h"

namespace braid {
namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

Status bad(const char* name, const char* value, const std::string& expected) {
  return Status::invalid_argument(std::string("environment variable ") + name + "='" + value +
                                  "' is invalid: expected " + expected);
}

}  // namespace

Status env_int(const char* name, long min, long max, long* value, bool* present) {
  *present = false;
  const char* v = env(name);
  if (v == nullptr) return Status::ok();
  char* end = nullptr;
  errno = 0;
  long x = std::strtol(v, &end, 10);
  if (errno != 0 || end == v || *end != '\0' || x < min || x > max)
    return bad(name, v, "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]");
  *value = x;
  *present = true;
  return Status::ok();
}

Status env_double(const char* name, double min, double max, double* value, bool* present) {
  *present = false;
  const char* v = env(name);
  if (v == nullptr) return Status::ok();
  char* end = nullptr;
  errno = 0;
  double x = std::strtod(v, &end);
  if (errno != 0 || end == v || *end != '\0' || !(x >= min && x <= max))
    return bad(name, v, "a number in [" + std::to_string(min) + ", " + std::to_string(max) + "]");
  *value = x;
  *present = true;
  return Status::ok();
}

Status env_size(const char* name, size_t min, size_t max, size_t* value, bool* present) {
  *present = false;
  const char* v = env(name);
  if (v == nullptr) return Status::ok();
  char* end = nullptr;
  errno = 0;
  unsigned long long x = std::strtoull(v, &end, 10);
  unsigned long long mult = 1;
  if (end != v && *end != '\0' && end[1] == '\0') {
    switch (*end) {
      case 'K':
      case 'k':
        mult = 1ull << 10;
        ++end;
        break;
      case 'M':
      case 'm':
        mult = 1ull << 20;
        ++end;
        break;
      case 'G':
      case 'g':
        mult = 1ull << 30;
        ++end;
        break;
      default:
        break;
    }
  }
  if (errno != 0 || end == v || *end != '\0' || v[0] == '-' || x * mult / mult != x || x * mult < min ||
      x * mult > max)
    return bad(name, v,
               "a number in [" + std::to_string(min) + ", " + std::to_string(max) + "] (K/M/G allowed)");
  *value = static_cast<size_t>(x * mult);
  *present = true;
  return Status::ok();
}

std::string machine_id() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::string id = host;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  if (boot >> boot_id) id += ":" + boot_id;
  return id;
}

std::string default_host_id() {
  // Processes in different PID namespaces (containers of one pod, sharing
  // /dev/shm and the hostname) cannot see each other's pids, which shm's
  // liveness checks and peer reads rely on: they count as different hosts.
  char ns[64] = {0};
  const ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
  return n > 0 ? machine_id() + ":" + std::string(ns, static_cast<size_t>(n)) : machine_id();
}

const std::vector<std::string>& known_variables() {
  static const std::vector<std::string> names = {
      "BRAID_ALGO",
      "BRAID_CHECK_CALLS",
      "BRAID_CPU_ISA",
      "BRAID_CUDA_CHUNK_BYTES",
      "BRAID_CUDA_IPC",
      "BRAID_CUDA_KERNELS",
      "BRAID_CUDA_P2P_LEVEL",
      "BRAID_DEBUG",
      "BRAID_DEBUG_FILE",
      "BRAID_DEBUG_SUBSYS",
      "BRAID_DIRECT_MAX_BYTES",
      "BRAID_DUMP_SIGNAL",
      "BRAID_HOST_ID",
      "BRAID_JOB_TOKEN",
      "BRAID_PEER_READ_MIN_BYTES",
      "BRAID_ROOT_PORT",
      "BRAID_SHM_PEER_READS",
      "BRAID_SHM_SLOTS",
      "BRAID_SHM_SLOT_BYTES",
      "BRAID_SHM_STREAM_MAX_BYTES",
      "BRAID_SHM_STREAM_MIN_BYTES",
      "BRAID_SOCKET_IFNAME",
      "BRAID_SPIN_US",
      "BRAID_TCP_BUFFER_BYTES",
      "BRAID_TCP_READ_AHEAD",
      "BRAID_TCP_SLOTS",
      "BRAID_TCP_SLOT_BYTES",
      "BRAID_TCP_SOCKETS",
      "BRAID_TIMEOUT",
      "BRAID_TOPO_FILE",
      "BRAID_TOPO_NUMA",
      "BRAID_TRACE_FILE",
      "BRAID_TRACE_MAX_EVENTS",
      "BRAID_TRACE_MIN_WAIT_US",
      "BRAID_TRANSPORT",
      "BRAID_TUNE_PROBE",
      "BRAID_WINDOW_MIN_BYTES",
  };
  return names;
}

namespace {

// Levenshtein distance, stopping early once it passes `limit`.
size_t edit_distance(const std::string& a, const std::string& b, size_t limit) {
  if (a.size() > b.size() + limit || b.size() > a.size() + limit) return limit + 1;
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0], best = ++row[0];
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
      best = std::min(best, row[j]);
    }
    if (best > limit) return limit + 1;
  }
  return row[b.size()];
}

}  // namespace

std::vector<std::string> misspelt_variables(const char* const* env) {
  std::vector<std::string> out;
  const auto& known = known_variables();
  for (; env != nullptr && *env != nullptr; ++env) {
    const std::string entry = *env;
    const std::string name = entry.substr(0, entry.find('='));
    if (name.rfind("BRAID_", 0) != 0 || std::find(known.begin(), known.end(), name) != known.end()) continue;
    for (const std::string& k : known) {
      if (edit_distance(name, k, 2) > 2) continue;
      out.push_back("environment variable " + name + " is not a braid setting (did you mean " + k +
                    "?); it is ignored");
      break;
    }
  }
  return out;
}

Status Config::from_env(Config* out) {
  {
    // Each once per process, but also for a name set after the first
    // communicator (a benchmark's --env-compare variant, a script that sets
    // one before its second group).
    static std::mutex mu;
    static auto* warned = new std::set<std::string>();
    std::lock_guard<std::mutex> lock(mu);
    for (const std::string& w : misspelt_variables(environ)) {
      if (warned->insert(w).second) BRAID_WARN("INIT", -1, "%s", w.c_str());
    }
  }
  Config c;
  bool present = false;
  BRAID_RETURN_IF_ERROR(env_double("BRAID_TIMEOUT", 1e-3, 1e9, &c.timeout_s, &present));
  if (const char* t = env("BRAID_TRANSPORT")) {
    if (!std::strcmp(t, "auto"))
      c.transport = TransportChoice::kAuto;
    else if (!std::strcmp(t, "shm"))
      c.transport = TransportChoice::kShm;
    else if (!std::strcmp(t, "tcp"))
      c.transport = TransportChoice::kTcp;
    else
      return bad("BRAID_TRANSPORT", t, "auto, shm or tcp");
  }
  if (const char* v = env("BRAID_CPU_ISA"); v && !kernels::valid_isa_cap(v))
    return bad("BRAID_CPU_ISA", v, "default, avx2, avx512 or avx512_bf16");
  if (const char* v = env("BRAID_SOCKET_IFNAME")) c.socket_ifname = v;
  if (const char* v = env("BRAID_HOST_ID")) {
    c.host_id = v;
    if (c.host_id.size() > kMaxHostIdBytes)
      return bad("BRAID_HOST_ID", v,
                 "at most " + std::to_string(kMaxHostIdBytes) + " bytes (it has " +
                     std::to_string(c.host_id.size()) + ")");
  } else
    c.host_id = default_host_id();
  BRAID_RETURN_IF_ERROR(env_size("BRAID_SHM_SLOT_BYTES", 4096, 64u << 20, &c.shm_slot_bytes, &present));
  long slots = c.shm_slots;
  BRAID_RETURN_IF_ERROR(env_int("BRAID_SHM_SLOTS", 2, 64, &slots, &present));
  c.shm_slots = static_cast<int>(slots);
  long reads = 1;
  BRAID_RETURN_IF_ERROR(env_int("BRAID_SHM_PEER_READS", 0, 1, &reads, &present));
  c.shm_peer_reads = reads != 0;
  BRAID_RETURN_IF_ERROR(
      env_size("BRAID_PEER_READ_MIN_BYTES", 0, size_t{1} << 40, &c.peer_read_min_bytes, &present));
  if (present) c.copy_peer_read_min_bytes = c.peer_read_min_bytes;
  c.peer_read_min_set = present;
  long probe = 1;
  BRAID_RETURN_IF_ERROR(env_int("BRAID_TUNE_PROBE", 0, 1, &probe, &present));
  c.tune_probe = probe != 0;
  BRAID_RETURN_IF_ERROR(
      env_size("BRAID_SHM_STREAM_MIN_BYTES", 0, size_t{1} << 40, &c.shm_stream_min_bytes, &present));
  c.shm_stream_set = present;
  BRAID_RETURN_IF_ERROR(
      env_size("BRAID_SHM_STREAM_MAX_BYTES", 0, size_t{1} << 40, &c.shm_stream_max_bytes, &present));
  c.shm_stream_set = c.shm_stream_set || present;
  // An empty band streams nothing: max 0 says that; a min at or above the
  // max is a band moved one way and not the other.
  if (c.shm_stream_set && c.shm_stream_max_bytes != 0 && c.shm_stream_min_bytes >= c.shm_stream_max_bytes)
    return Status::invalid_argument(
        "BRAID_SHM_STREAM_MIN_BYTES (" + std::to_string(c.shm_stream_min_bytes) +
        ") must be below BRAID_SHM_STREAM_MAX_BYTES (" + std::to_string(c.shm_stream_max_bytes) +
        (std::getenv("BRAID_SHM_STREAM_MAX_BYTES") == nullptr ? ", its default" : "") +
        "); BRAID_SHM_STREAM_MAX_BYTES=0 turns streaming stores off");
  BRAID_RETURN_IF_ERROR(env_size("BRAID_TCP_SLOT_BYTES", 4096, 64u << 20, &c.tcp_slot_bytes, &present));
  slots = c.tcp_slots;
  BRAID_RETURN_IF_ERROR(env_int("BRAID_TCP_SLOTS", 2, 64, &slots, &present));
  c.tcp_slots = static_cast<int>(slots);
  long sockets = c.tcp_sockets;
  BRAID_RETURN_IF_ERROR(env_int("BRAID_TCP_SOCKETS", 1, 16, &sockets, &present));
  c.tcp_sockets = static_cast<int>(sockets);
  BRAID_RETURN_IF_ERROR(env_size("BRAID_TCP_READ_AHEAD", 0, 1u << 20, &c.tcp_read_ahead, &present));
  BRAID_RETURN_IF_ERROR(env_size("BRAID_TCP_BUFFER_BYTES", 0, 1u << 30, &c.tcp_buffer_bytes, &present));
  BRAID_RETURN_IF_ERROR(env_double("BRAID_SPIN_US", 0, 1e6, &c.spin_us, &present));
  if (const char* a = env("BRAID_ALGO")) BRAID_RETURN_IF_ERROR(parse_algo_spec(a, &c.algo));
  BRAID_RETURN_IF_ERROR(env_size("BRAID_DIRECT_MAX_BYTES", 0, 1u << 30, &c.direct_max_bytes, &present));
  BRAID_RETURN_IF_ERROR(
      env_size("BRAID_WINDOW_MIN_BYTES", 0, size_t{1} << 40, &c.window_min_bytes, &present));
  if (const char* v = env("BRAID_TRACE_FILE")) c.trace_file = v;
  BRAID_RETURN_IF_ERROR(env_double("BRAID_TRACE_MIN_WAIT_US", 0, 1e9, &c.trace_min_wait_us, &present));
  BRAID_RETURN_IF_ERROR(
      env_size("BRAID_TRACE_MAX_EVENTS", 1, size_t{1} << 32, &c.trace_max_events, &present));
  long dump = 1;
  BRAID_RETURN_IF_ERROR(env_int("BRAID_DUMP_SIGNAL", 0, 1, &dump, &present));
  c.dump_on_signal = dump != 0;
  long check = 0;
  BRAID_RETURN_IF_ERROR(env_int("BRAID_CHECK_CALLS", 0, 1, &check, &present));
  c.check_calls = check != 0;
  long ipc = 1;
  BRAID_RETURN_IF_ERROR(env_int("BRAID_CUDA_IPC", 0, 1, &ipc, &present));
  c.cuda_ipc = ipc != 0;
  BRAID_RETURN_IF_ERROR(
      env_size("BRAID_CUDA_CHUNK_BYTES", 64u << 10, size_t{16} << 30, &c.cuda_chunk_bytes, &present));
  if (const char* v = env("BRAID_CUDA_P2P_LEVEL")) {
    topo::P2pLevel level;
    if (!topo::parse_p2p_level(v, &level))
      return bad("BRAID_CUDA_P2P_LEVEL", v, "LOC, NVL, PIX, PXB, PHB, NODE or SYS");
    c.cuda_p2p_level = level;
  }
  // Whole 256-byte lines: slices of a chunk stay aligned for the kernels.
  c.cuda_chunk_bytes = c.cuda_chunk_bytes / 256 * 256;
  *out = c;
  return Status::ok();
}

}  // namespace braid
