// braid-topo: what braid sees of this host (src/topo/topology.h).
//
//   braid-topo                      tree, GPU/NIC matrix, NICs
//   braid-topo --json               the same as one JSON object
//   braid-topo --hosts 2 --ranks-per-host 4
//                                   also the path class of every rank pair for
//                                   a simulated job (ranks dealt round-robin
//                                   over the NUMA nodes of each host)
//
// BRAID_TOPO_FILE=<hwloc XML> or =synthetic:<description> shows another host.
//
// Each part of the report is one section function taking the Report; a new
// one (transport per pair, rings and trees, tuner picks) is a function and a
// line in print_text / print_json.
#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "src/algo/collectives.h"
#include "src/algo/tuner.h"
#include "src/core/config.h"
#include "src/topo/topology.h"

namespace {

// 64-bit values go to JSON as hex strings: JSON readers that hold numbers
// as doubles (jq, JavaScript) round them.
std::string hex64(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%016" PRIx64, v);
  return buf;
}

namespace topo = braid::topo;

constexpr long kMaxSimulatedRanks = 1024;

struct Options {
  bool json = false;
  int hosts = 0;           // 0: not asked for
  int ranks_per_host = 0;  // 0: default (one per GPU, else one per core)
};

// Everything the sections print, computed once.
struct Report {
  Options options;
  topo::HostTopology topology;
  // A simulated job, when --hosts or --ranks-per-host is given: host h holds
  // ranks [h * ranks_per_host, (h + 1) * ranks_per_host).
  int hosts = 0;
  int ranks_per_host = 0;
  std::vector<topo::RankPlacement> ranks;
  // What a communicator of those ranks would build (src/algo): rings and
  // trees in host order, and the tuner's choices, with this environment's
  // BRAID_ALGO and thresholds.
  std::vector<int> order;
  braid::Tuner tuner;
  // This environment's BRAID_* settings (BRAID_CUDA_P2P_LEVEL: which GPU
  // pairs device collectives read each other's memory across).
  braid::Config config;
  // BRAID_TRANSPORT=tcp: ranks of one host talk over tcp, no hierarchical schedule.
  bool tcp_only() const { return config.transport == braid::TransportChoice::kTcp; }
};

void usage(FILE* f) {
  std::fprintf(
      f,
      "usage: braid-topo [--json] [--hosts H] [--ranks-per-host N]\n"
      "  --json               print one JSON object instead of text\n"
      "  --hosts H            simulate H hosts like this one (default 1 when --ranks-per-host is given)\n"
      "  --ranks-per-host N   ranks per simulated host (default: one per GPU, else one per core)\n"
      "  -h, --help           this text\n"
      "environment: BRAID_TOPO_FILE=<hwloc XML file> or synthetic:<hwloc synthetic description>\n"
      "             BRAID_TOPO_NUMA=<NUMA index> the process's NUMA node for a loaded topology\n");
}

[[noreturn]] void bad_usage(const std::string& message) {
  std::fprintf(stderr, "braid-topo: %s\n", message.c_str());
  usage(stderr);
  std::exit(2);
}

int positive_int(const char* flag, const char* value) {
  if (value == nullptr) bad_usage(std::string(flag) + " needs a value");
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(value, &end, 10);
  if (errno != 0 || end == value || *end != '\0' || v < 1 || v > 4096)
    bad_usage(std::string(flag) + " needs an integer in [1, 4096], got '" + value + "'");
  return static_cast<int>(v);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    // "--flag=value" and "--flag value" both work.
    std::string flag = arg;
    const char* value = nullptr;
    if (size_t eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      flag = arg.substr(0, eq);
      value = argv[i] + eq + 1;
    }
    auto take_value = [&]() -> const char* {
      if (value != nullptr) return value;
      return i + 1 < argc ? argv[++i] : nullptr;
    };
    if (flag == "-h" || flag == "--help") {
      usage(stdout);
      std::exit(0);
    } else if (flag == "--json" && value == nullptr) {
      o.json = true;
    } else if (flag == "--hosts") {
      o.hosts = positive_int("--hosts", take_value());
    } else if (flag == "--ranks-per-host") {
      o.ranks_per_host = positive_int("--ranks-per-host", take_value());
    } else {
      bad_usage("unknown flag '" + arg + "'");
    }
  }
  return o;
}

void simulate(Report* r) {
  const Options& o = r->options;
  if (o.hosts == 0 && o.ranks_per_host == 0) return;
  const topo::HostTopology& t = r->topology;
  r->hosts = o.hosts > 0 ? o.hosts : 1;
  r->ranks_per_host = o.ranks_per_host;
  if (r->ranks_per_host == 0)
    r->ranks_per_host = static_cast<int>(!t.gpus.empty() ? t.gpus.size() : t.cores.size());
  r->ranks_per_host = std::max(1, r->ranks_per_host);
  // The matrix grows with the square of the ranks.
  if (static_cast<long>(r->hosts) * r->ranks_per_host > kMaxSimulatedRanks)
    bad_usage("--hosts x --ranks-per-host is " +
              std::to_string(static_cast<long>(r->hosts) * r->ranks_per_host) + " ranks; at most " +
              std::to_string(kMaxSimulatedRanks) + " are shown");
  r->ranks = topo::simulated_placements(t, r->hosts, r->ranks_per_host);

  const braid::Config& config = r->config;
  const int n = r->hosts * r->ranks_per_host;
  std::vector<std::string> host(n);
  for (int i = 0; i < n; ++i) host[i] = "host" + std::to_string(i / r->ranks_per_host);
  for (const auto& g : braid::host_groups(host, r->ranks))
    r->order.insert(r->order.end(), g.begin(), g.end());
  braid::JobShape shape;
  shape.nranks = n;
  shape.nhosts = r->hosts;
  shape.ranks_per_host = r->ranks_per_host;
  // Peer reads need ptrace permission, which only a real job can probe, and
  // shared memory (not BRAID_TRANSPORT=tcp).
  const bool reads = config.shm_peer_reads && !r->tcp_only();
  shape.peer_reads = r->hosts == 1 && n > 1 && reads;
  shape.host_peer_reads = r->ranks_per_host > 1 && reads;
  // Per logical CPU, as a job counts them (sysconf's online CPUs).
  shape.ranks_per_core = static_cast<double>(r->ranks_per_host) / std::max(1, t.pus);
  shape.oversubscribed = shape.ranks_per_core > 1;
  shape.piece_bytes = std::min(config.shm_slot_bytes, config.tcp_slot_bytes);
  shape.direct_max_bytes = config.direct_max_bytes;
  shape.peer_read_min_bytes = config.peer_read_min_bytes;
  shape.copy_peer_read_min_bytes = config.copy_peer_read_min_bytes;
  if (r->tcp_only()) shape.without_shared_memory();
  r->tuner = braid::Tuner(shape, config.algo);
}

// Rows of cells, left-aligned in columns as wide as their widest entry (the
// layout of `nvidia-smi topo -m`).
void print_columns(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    if (width.size() < row.size()) width.resize(row.size(), 0);
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c)
      line += c + 1 < row.size() ? row[c] + std::string(width[c] + 2 - row[c].size(), ' ') : row[c];
    std::printf("%s\n", line.c_str());
  }
}

std::string index_or_dash(int i) {
  return i >= 0 ? std::to_string(i) : "-";
}

// ---- text sections ----

void print_tree_section(const Report& r) {
  std::printf("%s", topo::describe_tree(r.topology).c_str());
}

// GPUs and NICs against each other, as `nvidia-smi topo -m` shows them.
void print_device_matrix_section(const Report& r) {
  const topo::HostTopology& t = r.topology;
  if (t.gpus.empty()) return;
  size_t ngpus = t.gpus.size();
  std::vector<std::vector<std::string>> rows(1 + ngpus + t.nics.size());
  rows[0].push_back("");
  for (const auto& g : t.gpus) rows[0].push_back("GPU" + std::to_string(g.cuda_index));
  for (size_t k = 0; k < t.nics.size(); ++k) rows[0].push_back("NIC" + std::to_string(k));
  rows[0].push_back("NUMA");
  auto gg = topo::gpu_matrix(t);
  auto gn = topo::gpu_nic_matrix(t);
  for (size_t i = 0; i < ngpus; ++i) {
    auto& row = rows[1 + i];
    row.push_back(rows[0][1 + i]);
    row.insert(row.end(), gg[i].begin(), gg[i].end());
    row.insert(row.end(), gn[i].begin(), gn[i].end());
    row.push_back(index_or_dash(t.gpus[i].location.numa));
  }
  for (size_t k = 0; k < t.nics.size(); ++k) {
    auto& row = rows[1 + ngpus + k];
    row.push_back(rows[0][1 + ngpus + k]);
    for (size_t i = 0; i < ngpus; ++i) row.push_back(gn[i][k]);
    for (size_t m = 0; m < t.nics.size(); ++m)
      row.push_back(
          m == k ? "X" : topo::pci_path_name(topo::pci_path_between(t.nics[k].location, t.nics[m].location)));
    row.push_back(index_or_dash(t.nics[k].location.numa));
  }
  std::printf("\nGPU and NIC paths:\n");
  print_columns(rows);
  std::printf("\nLegend:\n%s", topo::device_matrix_legend());
  if (!t.nics.empty()) {
    std::printf("\nNIC legend:\n");
    for (size_t k = 0; k < t.nics.size(); ++k) std::printf("  NIC%zu: %s\n", k, t.nics[k].name.c_str());
  }
}

// [i][j]: whether ranks on GPUs i and j would read each other's memory
// (CUDA IPC) by the topology and BRAID_CUDA_P2P_LEVEL; the driver's peer
// access has the last word at run time.
std::vector<std::vector<bool>> gpu_ipc_matrix(const Report& r) {
  const auto& gpus = r.topology.gpus;
  std::vector<std::vector<bool>> m(gpus.size(), std::vector<bool>(gpus.size(), true));
  for (size_t i = 0; i < gpus.size(); ++i) {
    for (size_t j = 0; j < gpus.size(); ++j) {
      std::string path, why;
      if (i != j)
        m[i][j] = topo::p2p_allowed(r.topology, r.config.cuda_p2p_level ? &*r.config.cuda_p2p_level : nullptr,
                                    gpus[i].location.pci_bus_id, gpus[j].location.pci_bus_id, &path, &why);
    }
  }
  return m;
}

std::string p2p_level_text(const Report& r) {
  return r.config.cuda_p2p_level ? topo::p2p_level_name(*r.config.cuda_p2p_level) : "unset";
}

void print_gpu_ipc_section(const Report& r) {
  const auto& gpus = r.topology.gpus;
  if (gpus.size() < 2) return;
  std::vector<std::vector<std::string>> rows(1 + gpus.size());
  rows[0].push_back("");
  for (const auto& g : gpus) rows[0].push_back("GPU" + std::to_string(g.cuda_index));
  const auto m = gpu_ipc_matrix(r);
  for (size_t i = 0; i < gpus.size(); ++i) {
    rows[1 + i].push_back(rows[0][1 + i]);
    for (size_t j = 0; j < gpus.size(); ++j) rows[1 + i].push_back(i == j ? "X" : m[i][j] ? "ipc" : "host");
  }
  std::printf("\nDevice collectives between GPUs (BRAID_CUDA_P2P_LEVEL=%s):\n", p2p_level_text(r).c_str());
  print_columns(rows);
  std::printf(
      "  ipc  = ranks read each other's memory (CUDA IPC) where the driver grants peer access\n"
      "  host = through pinned host memory; a communicator takes CUDA IPC only if every pair of its GPUs "
      "allows it\n");
}

void print_nic_section(const Report& r) {
  const auto& nics = r.topology.nics;
  if (nics.empty()) return;
  std::printf("\nNICs:\n");
  for (size_t k = 0; k < nics.size(); ++k) {
    const auto& n = nics[k];
    std::printf("  NIC%zu  %-10s kind %-5s NUMA %-3s package %-3s PCI %s", k, n.name.c_str(),
                n.kind.empty() ? "?" : n.kind.c_str(), index_or_dash(n.location.numa).c_str(),
                index_or_dash(n.location.package).c_str(),
                n.location.pci_bus_id.empty() ? "-" : n.location.pci_bus_id.c_str());
    if (!n.netdev.empty() && n.netdev != n.name) std::printf("  netdev %s", n.netdev.c_str());
    if (n.port_gbit_s > 0) std::printf("  %g Gb/s", n.port_gbit_s);
    std::printf("\n");
  }
}

void print_rank_section(const Report& r) {
  if (r.ranks.empty()) return;
  size_t n = r.ranks.size();
  std::vector<std::vector<std::string>> rows(1 + n);
  rows[0].push_back("");
  for (size_t i = 0; i < n; ++i) rows[0].push_back("R" + std::to_string(i));
  rows[0].insert(rows[0].end(), {"Host", "NUMA", "Core"});
  auto m = topo::path_matrix(r.ranks);
  for (size_t i = 0; i < n; ++i) {
    auto& row = rows[1 + i];
    row.push_back(rows[0][1 + i]);
    for (topo::PathClass p : m[i]) row.push_back(topo::path_name(p));
    row.push_back(std::to_string(i / static_cast<size_t>(r.ranks_per_host)));
    row.push_back(index_or_dash(r.ranks[i].numa));
    row.push_back(index_or_dash(r.ranks[i].core));
  }
  std::printf("\nRank paths: %d host(s) x %d rank(s), dealt round-robin over NUMA nodes:\n", r.hosts,
              r.ranks_per_host);
  print_columns(rows);
  std::printf("\nLegend:\n");
  for (topo::PathClass p : {topo::PathClass::kSelf, topo::PathClass::kSameNuma, topo::PathClass::kSameHost,
                            topo::PathClass::kCrossSocket, topo::PathClass::kOtherHost})
    std::printf("  %-4s = %s\n", topo::path_name(p), topo::path_description(p));
}

void print_transport_section(const Report& r) {
  if (r.ranks.empty()) return;
  const bool tcp_only = r.tcp_only();
  const size_t n = r.ranks.size();
  std::vector<std::vector<std::string>> rows(1 + n);
  rows[0].push_back("");
  for (size_t i = 0; i < n; ++i) rows[0].push_back("R" + std::to_string(i));
  for (size_t i = 0; i < n; ++i) {
    rows[1 + i].push_back("R" + std::to_string(i));
    for (size_t j = 0; j < n; ++j)
      rows[1 + i].push_back(i == j                                                      ? "self"
                            : r.ranks[i].host_hash == r.ranks[j].host_hash && !tcp_only ? "shm"
                                                                                        : "tcp");
  }
  std::printf("\nTransport per pair (BRAID_TRANSPORT=%s):\n", tcp_only ? "tcp" : "auto or shm");
  print_columns(rows);
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int x : ranks) s += (s.empty() ? "" : " ") + std::to_string(x);
  return s;
}

void print_schedule_section(const Report& r) {
  if (r.ranks.empty()) return;
  const int n = static_cast<int>(r.order.size());
  std::printf("\nSchedules (ranks grouped by host, NUMA node within a host):\n");
  std::printf("  ring / chain order: %s -> back to %d\n", rank_list(r.order).c_str(), r.order[0]);
  std::printf("  binary tree (root %d):", r.order[0]);
  for (int i = 0; i < n; ++i) {
    const braid::BinaryTree t(i, n, 0);
    if (t.children == 0) continue;
    std::printf(" %d->{", r.order[i]);
    for (int k = 0; k < t.children; ++k) std::printf("%s%d", k ? "," : "", r.order[t.child[k]]);
    std::printf("}");
  }
  std::printf("\n");
  if (r.hosts > 1 && r.ranks_per_host > 1 && !r.tcp_only()) {
    std::printf("  hierarchical: inside each host");
    for (int h = 0; h < r.hosts; ++h) {
      std::vector<int> g(r.order.begin() + h * r.ranks_per_host,
                         r.order.begin() + (h + 1) * r.ranks_per_host);
      std::printf(" {%s}", rank_list(g).c_str());
    }
    std::printf(", across hosts");
    for (int k = 0; k < r.ranks_per_host; ++k) {
      std::vector<int> g;
      for (int h = 0; h < r.hosts; ++h) g.push_back(r.order[h * r.ranks_per_host + k]);
      std::printf(" {%s}", rank_list(g).c_str());
    }
    std::printf("\n");
  }
}

void print_tuner_section(const Report& r) {
  if (r.ranks.empty()) return;
  const braid::JobShape& sh = r.tuner.shape();
  std::printf("\nTuner (%d ranks, %d host(s)%s%s): where each algorithm takes over\n", sh.nranks, sh.nhosts,
              r.tcp_only() ? " as BRAID_TRANSPORT=tcp counts them" : "",
              sh.oversubscribed ? ", more ranks than cores" : "");
  for (const std::string& line : r.tuner.describe()) std::printf("  %s\n", line.c_str());
  if (sh.peer_reads)
    std::printf(
        "  (peer reads at the model's fixed rates: a job on one host times them against the ring\n"
        "   at init and may choose otherwise; BRAID_DEBUG=INFO logs the times and its choice)\n");
  std::vector<std::vector<std::string>> rows;
  rows.push_back({"all_reduce bytes"});
  const auto& algos = braid::algos_of(braid::Coll::kAllReduce);
  for (braid::Algo a : algos) rows[0].push_back(braid::algo_name(a));
  rows[0].push_back("pick");
  for (size_t bytes = 8; bytes <= (size_t{256} << 20); bytes *= 16) {
    std::vector<std::string> row{std::to_string(bytes)};
    for (braid::Algo a : algos) {
      const double us = r.tuner.predict_us(braid::Coll::kAllReduce, a, bytes);
      char cell[32];
      std::snprintf(cell, sizeof cell, "%.4g", us);
      row.push_back(us < 0 ? "-" : cell);
    }
    row.push_back(braid::algo_name(r.tuner.pick(braid::Coll::kAllReduce, bytes)));
    rows.push_back(row);
  }
  std::printf("  predicted microseconds (- where it cannot run):\n");
  print_columns(rows);
}

void print_text(const Report& r) {
  print_tree_section(r);
  print_device_matrix_section(r);
  print_gpu_ipc_section(r);
  print_nic_section(r);
  print_rank_section(r);
  print_transport_section(r);
  print_schedule_section(r);
  print_tuner_section(r);
}

// ---- JSON sections: each appends one member of the top-level object ----

std::string rank_json(const Report& r) {
  std::string s = "{\"paths\":[";
  auto m = topo::path_matrix(r.ranks);
  for (size_t i = 0; i < m.size(); ++i) {
    s += i == 0 ? "[" : ",[";
    for (size_t j = 0; j < m[i].size(); ++j)
      s += (j == 0 ? "" : ",") + topo::json_quote(topo::path_name(m[i][j]));
    s += "]";
  }
  s += "],\"ring_order\":[";
  for (size_t i = 0; i < r.order.size(); ++i) s += (i ? "," : "") + std::to_string(r.order[i]);
  s += "],\"tuner\":[";
  const auto lines = r.tuner.describe();
  for (size_t i = 0; i < lines.size(); ++i) s += (i ? "," : "") + topo::json_quote(lines[i]);
  s += "],\"placements\":[";
  for (size_t i = 0; i < r.ranks.size(); ++i) {
    const auto& p = r.ranks[i];
    s += (i == 0 ? "{" : ",{") + std::string("\"host_hash\":\"") + hex64(p.host_hash) + "\"" +
         ",\"numa\":" + std::to_string(p.numa) + ",\"package\":" + std::to_string(p.package) +
         ",\"core\":" + std::to_string(p.core) + "}";
  }
  return s + "]}";
}

void print_json(const Report& r) {
  std::string s = "{\"topology\":" + topo::to_json(r.topology);
  if (!r.ranks.empty()) s += ",\"ranks\":" + rank_json(r);
  s += ",\"cuda_p2p_level\":" + topo::json_quote(p2p_level_text(r)) + ",\"gpu_ipc\":[";
  const auto m = gpu_ipc_matrix(r);
  for (size_t i = 0; i < m.size(); ++i) {
    s += i == 0 ? "[" : ",[";
    for (size_t j = 0; j < m[i].size(); ++j)
      s += std::string(j == 0 ? "" : ",") + (m[i][j] ? "true" : "false");
    s += "]";
  }
  s += "]";
  std::printf("%s}\n", s.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  Report r;
  r.options = parse(argc, argv);
  braid::Status st = topo::discover(&r.topology);
  if (!st.is_ok()) {
    std::fprintf(stderr, "braid-topo: %s\n", st.message().c_str());
    return 1;
  }
  if (st = braid::Config::from_env(&r.config); !st.is_ok()) {
    std::fprintf(stderr, "braid-topo: %s\n", st.message().c_str());
    return 1;
  }
  simulate(&r);
  if (r.options.json)
    print_json(r);
  else
    print_text(r);
  return 0;
}
