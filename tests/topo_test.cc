// src/topo: discovery of this host, of a saved topology and of synthetic
// ones; path classes; the JSON and the braid-topo tool.
//
// tests/data/dgx_2s_8gpu_4nic.xml is a hand-written hwloc v2 topology of a
// 2-socket host (one NUMA node and 8 cores per socket). Each socket has two
// PCIe host bridges, each leading to one PCIe switch holding 2 NVIDIA GPUs
// and 1 Mellanox InfiniBand NIC:
//   socket 0: GPU0 GPU1 mlx5_0 | GPU2 GPU3 mlx5_1
//   socket 1: GPU4 GPU5 mlx5_2 | GPU6 GPU7 mlx5_3
// Its NVLinkBandwidth matrix joins GPUs 0-3 pairwise and 4-7 pairwise by 2
// links (50 GB/s), GPU i and i+4 by 1 link, and leaves the other pairs
// without NVLink.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <ostream>
#include <string>

#include <gtest/gtest.h>

#include "src/algo/collectives.h"
#include "src/topo/topology.h"

namespace braid::topo {

// Readable gtest failures.
void PrintTo(PathClass p, std::ostream* os) {
  *os << path_name(p);
}
void PrintTo(PciPath p, std::ostream* os) {
  *os << pci_path_name(p);
}

namespace {

const std::string kDgxXml = std::string(BRAID_SOURCE_DIR) + "/tests/data/dgx_2s_8gpu_4nic.xml";

// Sets an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (had_)
      setenv(name_, old_.c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

std::string temp_path(const char* name) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/braid_topo_test_" + std::to_string(getpid()) + "_" +
         name;
}

// The topology BRAID_TOPO_FILE=source describes (a saved XML or hwloc's
// "synthetic:" description).
HostTopology load(const std::string& source) {
  ScopedEnv file("BRAID_TOPO_FILE", source.c_str());
  HostTopology t;
  Status st = discover(&t);
  EXPECT_TRUE(st.is_ok()) << source << ": " << st.message();
  return t;
}

HostTopology load_dgx() {
  return load(kDgxXml);
}

TEST(Discover, ThisHost) {
  unsetenv("BRAID_TOPO_FILE");
  HostTopology t;
  Status st = discover(&t);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(t.source, "this host");
  EXPECT_GE(t.cores.size(), 1u);
  EXPECT_GE(t.numa_nodes.size(), 1u);
  EXPECT_GE(t.pus, static_cast<int>(t.cores.size()));
  // The live host knows where this process runs.
  EXPECT_GE(t.process_numa, 0);
  EXPECT_GE(t.process_core, 0);
  EXPECT_LT(t.process_core, static_cast<int>(t.cores.size()));
  EXPECT_FALSE(describe_tree(t).empty());
}

TEST(Discover, SavedDgxTopology) {
  HostTopology t = load_dgx();
  EXPECT_EQ(t.source, kDgxXml);
  EXPECT_EQ(t.hostname, "dgx-test");
  ASSERT_EQ(t.packages.size(), 2u);
  ASSERT_EQ(t.numa_nodes.size(), 2u);
  EXPECT_EQ(t.cores.size(), 16u);
  EXPECT_EQ(t.pus, 16);
  EXPECT_EQ(t.packages[1].cores, 8);
  EXPECT_EQ(t.packages[0].cpu_model, "Test CPU 8-Core");
  EXPECT_EQ(t.numa_nodes[1].package, 1);
  EXPECT_EQ(t.numa_nodes[1].memory_bytes, 256ull << 30);
  EXPECT_EQ(t.numa_nodes[1].cores, 8);
  ASSERT_EQ(t.l3_caches.size(), 2u);
  EXPECT_EQ(t.l3_caches[1].size_bytes, 32u << 20);
  EXPECT_EQ(t.l3_caches[1].numa, 1);
  EXPECT_EQ(t.cores[9].numa, 1);
  EXPECT_EQ(t.cores[9].package, 1);
  // A loaded file says nothing about this process.
  EXPECT_EQ(t.process_numa, -1);
  EXPECT_EQ(t.process_core, -1);

  ASSERT_EQ(t.gpus.size(), 8u);
  for (int i = 0; i < 8; ++i) {
    const GpuInfo& g = t.gpus[i];
    EXPECT_EQ(g.cuda_index, i);
    EXPECT_EQ(g.os_device, "cuda" + std::to_string(i));
    EXPECT_EQ(g.vendor_id, 0x10de);
    EXPECT_EQ(g.name, "NVIDIA A100-SXM4-40GB");
    EXPECT_EQ(g.location.numa, i / 4) << "GPU " << i;
    EXPECT_EQ(g.location.package, i / 4) << "GPU " << i;
    EXPECT_EQ(g.location.pci_bridges.size(), 3u);  // host bridge, switch up port, down port
  }
  EXPECT_EQ(t.gpus[0].location.pci_bus_id, "0000:03:00.0");
  EXPECT_EQ(t.gpus[7].location.pci_bus_id, "0000:94:00.0");

  ASSERT_EQ(t.nics.size(), 4u);
  for (int k = 0; k < 4; ++k) {
    const NicInfo& n = t.nics[k];
    EXPECT_EQ(n.name, "mlx5_" + std::to_string(k));
    EXPECT_EQ(n.netdev, "ib" + std::to_string(k));
    EXPECT_EQ(n.kind, "ib");
    EXPECT_EQ(n.location.numa, k / 2) << n.name;
    EXPECT_EQ(n.location.package, k / 2) << n.name;
    EXPECT_EQ(n.port_gbit_s, 0);  // not the live host: no sysfs
  }

  ASSERT_EQ(t.nvlink_mbyte_s.size(), 8u);
  EXPECT_EQ(t.nvlink_mbyte_s[0][1], 50000u);
  EXPECT_EQ(t.nvlink_mbyte_s[0][4], 25000u);
  EXPECT_EQ(t.nvlink_mbyte_s[0][5], 0u);
  EXPECT_EQ(t.nvlink_mbyte_s[3][3], 0u);
}

// A GPU whose PCI class says "processing accelerator" (0x12), as some
// data-centre GPUs do, is a GPU where CUDA attached a co-processor to it
// (it was dropped before: 7 GPUs).
TEST(Discover, AcceleratorClassGpuWithACoprocessorCounts) {
  std::ifstream in(kDgxXml);
  std::string xml((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string display = "pci_busid=\"0000:03:00.0\" pci_type=\"0302 ";
  const size_t at = xml.find(display);
  ASSERT_NE(at, std::string::npos);
  xml.replace(at + display.size() - 5, 4, "1200");
  const std::string path = temp_path("accelerator.xml");
  std::ofstream(path) << xml;
  HostTopology t = load(path);
  std::remove(path.c_str());
  ASSERT_EQ(t.gpus.size(), 8u);
  EXPECT_EQ(t.gpus[0].location.pci_bus_id, "0000:03:00.0");
  EXPECT_EQ(t.gpus[0].os_device, "cuda0");
}

TEST(Discover, DgxPciPaths) {
  HostTopology t = load_dgx();
  ASSERT_EQ(t.gpus.size(), 8u);
  auto pci = [&](int a, int b) { return pci_path_between(t.gpus[a].location, t.gpus[b].location); };
  EXPECT_EQ(pci(0, 1), PciPath::kPix);   // one switch
  EXPECT_EQ(pci(0, 2), PciPath::kNode);  // same socket, other host bridge
  EXPECT_EQ(pci(0, 4), PciPath::kSys);   // other socket
  EXPECT_EQ(pci(6, 7), PciPath::kPix);

  auto m = gpu_matrix(t);
  ASSERT_EQ(m.size(), 8u);
  EXPECT_EQ(m[0][0], "X");
  EXPECT_EQ(m[0][1], "NV2");
  EXPECT_EQ(m[1][0], "NV2");
  EXPECT_EQ(m[0][4], "NV1");
  EXPECT_EQ(m[0][5], "SYS");  // no NVLink: the PCI path
  EXPECT_EQ(m[5][0], "SYS");

  auto n = gpu_nic_matrix(t);
  ASSERT_EQ(n.size(), 8u);
  ASSERT_EQ(n[0].size(), 4u);
  EXPECT_EQ(n[0][0], "PIX");
  EXPECT_EQ(n[0][1], "NODE");
  EXPECT_EQ(n[0][2], "SYS");
  EXPECT_EQ(n[7][3], "PIX");

  std::string tree = describe_tree(t);
  EXPECT_NE(tree.find("NIC mlx5_3"), std::string::npos) << tree;
  EXPECT_NE(tree.find("GPU 7"), std::string::npos) << tree;
}

// Which pairs of the DGX's GPUs may read each other's memory (CUDA IPC):
// by default everything but the pairs with no NVLink across the sockets;
// BRAID_CUDA_P2P_LEVEL bounds the path; bus ids match in CUDA's spelling.
TEST(P2p, PairsFollowTheirPathAndTheLevel) {
  const HostTopology t = load_dgx();
  auto allowed = [&](const char* a, const char* b, const P2pLevel* level, std::string* path) {
    std::string why;
    const bool ok = p2p_allowed(t, level, a, b, path, &why);
    EXPECT_EQ(ok, why.empty()) << why;
    return ok;
  };
  std::string path;
  EXPECT_TRUE(allowed("0000:03:00.0", "0000:04:00.0", nullptr, &path));
  EXPECT_EQ(path, "NV2");
  EXPECT_TRUE(allowed("0000:03:00.0", "0000:83:00.0", nullptr, &path));
  EXPECT_EQ(path, "NV1");
  EXPECT_FALSE(allowed("0000:03:00.0", "0000:84:00.0", nullptr, &path));
  EXPECT_EQ(path, "SYS");
  std::string why;
  ASSERT_FALSE(p2p_allowed(t, nullptr, "0000:03:00.0", "0000:84:00.0", &path, &why));
  EXPECT_NE(why.find("0000:84:00.0"), std::string::npos) << why;
  EXPECT_NE(why.find("BRAID_CUDA_P2P_LEVEL=SYS"), std::string::npos) << why;
  // CUDA's spelling: upper case, a domain of 8 digits.
  EXPECT_EQ(gpu_by_bus_id(t, "00000000:94:00.0"), 7);
  EXPECT_EQ(gpu_by_bus_id(t, "0000:93:00.0"), 6);
  EXPECT_EQ(gpu_by_bus_id(t, "0000:05:00.0"), -1);  // a NIC
  EXPECT_EQ(gpu_by_bus_id(t, "not a bus id"), -1);
  // A GPU the topology does not hold: the driver decides by default.
  EXPECT_TRUE(allowed("0000:03:00.0", "0000:aa:00.0", nullptr, &path));
  EXPECT_EQ(path, "unknown");

  const P2pLevel sys = P2pLevel::kSys, nvl = P2pLevel::kNvl, node = P2pLevel::kNode, loc = P2pLevel::kLoc;
  EXPECT_TRUE(allowed("0000:03:00.0", "0000:84:00.0", &sys, &path));
  EXPECT_FALSE(allowed("0000:03:00.0", "0000:84:00.0", &node, &path));
  EXPECT_TRUE(allowed("0000:03:00.0", "0000:83:00.0", &nvl, &path));
  EXPECT_FALSE(allowed("0000:03:00.0", "0000:04:00.0", &loc, &path));
  // With a level, a GPU the topology does not hold is as far as SYS.
  EXPECT_FALSE(allowed("0000:03:00.0", "0000:aa:00.0", &node, &path));
  EXPECT_TRUE(allowed("0000:03:00.0", "0000:aa:00.0", &sys, &path));
  ASSERT_FALSE(p2p_allowed(t, &node, "0000:03:00.0", "0000:84:00.0", &path, &why));
  EXPECT_NE(why.find("farther apart than BRAID_CUDA_P2P_LEVEL=NODE"), std::string::npos) << why;

  // Without hwloc's NVLink matrix a missing NVLink is unseen, not known:
  // the SYS pair is left to the driver, unless a level says otherwise.
  HostTopology no_nvml = t;
  no_nvml.nvlink_mbyte_s.clear();
  std::string w;
  EXPECT_TRUE(p2p_allowed(no_nvml, nullptr, "0000:03:00.0", "0000:84:00.0", &path, &w)) << w;
  EXPECT_EQ(path, "SYS");
  EXPECT_FALSE(p2p_allowed(no_nvml, &nvl, "0000:03:00.0", "0000:04:00.0", &path, &w));
  EXPECT_EQ(path, "PIX");
  // A matrix with no link between GPUs is as good as none.
  HostTopology empty_matrix = t;
  for (auto& row : empty_matrix.nvlink_mbyte_s) std::fill(row.begin(), row.end(), 0);
  EXPECT_TRUE(p2p_allowed(empty_matrix, nullptr, "0000:03:00.0", "0000:84:00.0", &path, &w)) << w;
  // SYS where a GPU's package is unknown (or NUMA nodes of one package):
  // not known to cross the sockets, so the driver decides.
  HostTopology unplaced = t;
  unplaced.gpus[5].location.package = -1;
  unplaced.gpus[5].location.numa = -1;
  EXPECT_TRUE(p2p_allowed(unplaced, nullptr, "0000:03:00.0", "0000:84:00.0", &path, &w)) << w;
  EXPECT_EQ(path, "SYS");
}

TEST(P2p, LevelNames) {
  P2pLevel level = P2pLevel::kSys;
  for (const char* name : {"LOC", "NVL", "PIX", "PXB", "PHB", "NODE", "SYS"}) {
    ASSERT_TRUE(parse_p2p_level(name, &level).is_ok()) << name;
    EXPECT_STREQ(p2p_level_name(level), name);
  }
  ASSERT_TRUE(parse_p2p_level("nvl", &level).is_ok());
  EXPECT_EQ(level, P2pLevel::kNvl);
  Status st = parse_p2p_level("NV2", &level);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("'NV2' is not a path level (valid: LOC, NVL, PIX, PXB, PHB, NODE, SYS)"),
            std::string::npos)
      << st.message();
}

TEST(Discover, NumaOverride) {
  ScopedEnv numa("BRAID_TOPO_NUMA", "1");
  HostTopology t = load_dgx();
  EXPECT_EQ(t.process_numa, 1);
  EXPECT_EQ(t.process_package, 1);
  RankPlacement p = placement_of(t, "hostA");
  EXPECT_EQ(p.numa, 1);
  EXPECT_EQ(p.num_gpus, 8);
  EXPECT_EQ(p.num_nics, 4);
  EXPECT_EQ(p.num_numa_nodes, 2);
  EXPECT_EQ(p.host_hash, host_hash("hostA"));
}

TEST(Discover, NumaOverrideOutOfRange) {
  for (const char* bad : {"2", "-1", "x"}) {
    ScopedEnv numa("BRAID_TOPO_NUMA", bad);
    ScopedEnv file("BRAID_TOPO_FILE", kDgxXml);
    HostTopology t;
    Status st = discover(&t);
    EXPECT_FALSE(st.is_ok()) << bad;
    EXPECT_NE(st.message().find("BRAID_TOPO_NUMA"), std::string::npos) << st.message();
  }
}

TEST(Discover, Synthetic) {
  const HostTopology t = load("synthetic:pack:2 numa:1 core:4 pu:2");
  ASSERT_EQ(t.packages.size(), 2u);
  EXPECT_EQ(t.numa_nodes.size(), 2u);
  EXPECT_EQ(t.cores.size(), 8u);
  EXPECT_EQ(t.pus, 16);
  EXPECT_EQ(t.cores[5].numa, 1);
  EXPECT_TRUE(t.gpus.empty());
  EXPECT_TRUE(t.nvlink_mbyte_s.empty());
  EXPECT_TRUE(gpu_matrix(t).empty());
}

// A memory-only node (HBM, CXL) beside each package's DRAM node shares the
// package's locality but owns none of its CPUs: its cores are counted once,
// in the DRAM node, and the tree shows it without CPUs, under its package.
TEST(Discover, MemoryOnlyNodesHaveNoCores) {
  const HostTopology t = load("synthetic:pack:2 [numa(memory=1GB)] [numa(memory=2GB)] core:2 pu:1");
  ASSERT_EQ(t.numa_nodes.size(), 4u);
  int cores = 0, memory_only = 0;
  for (const NumaNodeInfo& n : t.numa_nodes) {
    cores += n.cores;
    if (n.cores == 0) {
      ++memory_only;
      EXPECT_EQ(n.pus, 0);
      EXPECT_EQ(n.memory_bytes, 2000000000u);  // "2GB" in hwloc's synthetic syntax
    }
    EXPECT_GE(n.package, 0);
  }
  EXPECT_EQ(cores, 4);
  EXPECT_EQ(memory_only, 2);
  for (const CoreInfo& c : t.cores) EXPECT_EQ(t.numa_nodes[c.numa].package, c.package);
  const std::string tree = describe_tree(t);
  EXPECT_NE(tree.find("no CPUs (memory only)"), std::string::npos) << tree;
  EXPECT_EQ(tree.find("Not local to one package"), std::string::npos) << tree;
}

// A machine with two packages and no NUMA nodes of its own (hwloc makes one
// for the whole machine, which spans both): each package's L3s still show
// in the tree, under their package.
TEST(Discover, CachesUnderANodeSpanningPackagesAreShown) {
  const HostTopology t = load("synthetic:pack:2 l3:1 core:4 pu:1");
  ASSERT_EQ(t.l3_caches.size(), 2u);
  const std::string tree = describe_tree(t);
  size_t l3_lines = 0;
  for (size_t at = tree.find("L3 "); at != std::string::npos; at = tree.find("L3 ", at + 1)) ++l3_lines;
  EXPECT_EQ(l3_lines, 2u) << tree;
}

TEST(Discover, BadSourcesNameTheVariable) {
  for (const std::string& bad :
       {std::string("/nonexistent/topology.xml"), std::string("synthetic:garbage:x"),
        std::string("synthetic:"), std::string(BRAID_SOURCE_DIR) + "/tests/topo_test.cc"}) {
    ScopedEnv file("BRAID_TOPO_FILE", bad);
    HostTopology t;
    Status st = discover(&t);
    ASSERT_FALSE(st.is_ok()) << bad;
    EXPECT_EQ(st.code(), BRAID_ERR_INVALID_ARGUMENT);
    EXPECT_NE(st.message().find("BRAID_TOPO_FILE"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find(bad), std::string::npos) << st.message();
  }
}

RankPlacement at(const char* host, int numa, int package, int core) {
  RankPlacement p;
  p.host_hash = host_hash(host);
  p.numa = numa;
  p.package = package;
  p.core = core;
  return p;
}

TEST(Paths, EachClass) {
  RankPlacement a = at("h0", 0, 0, 0);
  EXPECT_EQ(path_between(a, a), PathClass::kSelf);
  EXPECT_EQ(path_between(a, at("h0", 0, 0, 1)), PathClass::kSameNuma);
  EXPECT_EQ(path_between(a, at("h0", 1, 0, 2)), PathClass::kSameHost);     // other NUMA node, same package
  EXPECT_EQ(path_between(a, at("h0", -1, 0, 2)), PathClass::kSameHost);    // NUMA unknown
  EXPECT_EQ(path_between(a, at("h0", -1, -1, -1)), PathClass::kSameHost);  // nothing known
  EXPECT_EQ(path_between(a, at("h0", 1, 1, 8)), PathClass::kCrossSocket);
  // One NUMA node spanning both sockets (interleaving): still across sockets.
  EXPECT_EQ(path_between(a, at("h0", 0, 1, 8)), PathClass::kCrossSocket);
  EXPECT_EQ(path_between(a, at("h1", 0, 0, 0)), PathClass::kOtherHost);
  // Unknown cores never count as the same core.
  EXPECT_EQ(path_between(at("h0", 0, 0, -1), at("h0", 0, 0, -1)), PathClass::kSameNuma);

  EXPECT_STREQ(path_name(PathClass::kSelf), "X");
  EXPECT_STREQ(path_name(PathClass::kSameNuma), "NUMA");
  EXPECT_STREQ(path_name(PathClass::kSameHost), "HOST");
  EXPECT_STREQ(path_name(PathClass::kCrossSocket), "SYS");
  EXPECT_STREQ(path_name(PathClass::kOtherHost), "NET");

  auto m = path_matrix({a, at("h0", 0, 0, -1), at("h1", 0, 0, 0)});
  ASSERT_EQ(m.size(), 3u);
  EXPECT_EQ(m[1][1], PathClass::kSelf);
  EXPECT_EQ(m[0][1], PathClass::kSameNuma);
  EXPECT_EQ(m[2][0], PathClass::kOtherHost);
}

// The buffers of a host's ranks sit in the L3s of the packages they run on.
TEST(Paths, L3OfTheHostsRanks) {
  HostTopology t = load_dgx();  // two packages, one 32 MiB L3 each
  ASSERT_EQ(t.l3_caches.size(), 2u);
  const uint64_t one = t.l3_caches[0].size_bytes;
  const uint64_t both = t.l3_caches[0].size_bytes + t.l3_caches[1].size_bytes;
  // Two ranks on package 0 (and one on another host, on package 1).
  std::vector<RankPlacement> ranks = {at("h0", 0, 0, 0), at("h0", 0, 0, 1), at("h1", 1, 1, 8)};
  EXPECT_EQ(l3_bytes_of_host_ranks(t, ranks, 0), one);
  EXPECT_EQ(l3_bytes_of_host_ranks(t, ranks, 2), t.l3_caches[1].size_bytes);
  ranks.push_back(at("h0", 1, 1, 9));  // a rank of the host on package 1
  EXPECT_EQ(l3_bytes_of_host_ranks(t, ranks, 0), both);
  ranks[3] = at("h0", -1, -1, -1);  // one whose package is unknown
  EXPECT_EQ(l3_bytes_of_host_ranks(t, ranks, 1), both);
  EXPECT_EQ(l3_bytes_of_host_ranks(HostTopology(), ranks, 0), 0u);
}

TEST(Paths, PciClassesFromBridges) {
  DeviceLocation a{"0000:03:00.0", {1, 2, 3}, 0, 0};
  auto with = [](std::vector<uint64_t> bridges, int numa, int package) {
    return DeviceLocation{"x", std::move(bridges), numa, package};
  };
  EXPECT_EQ(pci_path_between(a, with({1, 2, 4}, 0, 0)), PciPath::kPix);        // switch's other port
  EXPECT_EQ(pci_path_between(a, with({1, 2, 3}, 0, 0)), PciPath::kPix);        // same port
  EXPECT_EQ(pci_path_between(a, with({1, 2, 4, 5, 6}, 0, 0)), PciPath::kPxb);  // a switch below a switch
  EXPECT_EQ(pci_path_between(a, with({1, 7, 8}, 0, 0)), PciPath::kPhb);        // same host bridge
  EXPECT_EQ(pci_path_between(a, with({9, 7, 8}, 0, 0)), PciPath::kNode);
  EXPECT_EQ(pci_path_between(a, with({9}, -1, 0)), PciPath::kNode);  // NUMA unknown, same package
  EXPECT_EQ(pci_path_between(a, with({9}, 1, 0)), PciPath::kSys);    // other NUMA node of the package
  EXPECT_EQ(pci_path_between(a, with({9}, 1, 1)), PciPath::kSys);
  EXPECT_EQ(pci_path_between(a, with({9}, 0, 1)), PciPath::kSys);  // one NUMA node over both sockets
  EXPECT_EQ(pci_path_between(a, with({}, -1, -1)), PciPath::kSys);

  EXPECT_EQ(nvlink_count(0), 0);
  EXPECT_EQ(nvlink_count(450000), 18);  // H100 through NVSwitch
  EXPECT_EQ(nvlink_count(80000), 4);    // NVLink 1
}

TEST(Paths, SimulatedPlacements) {
  ScopedEnv file("BRAID_TOPO_FILE", "synthetic:pack:2 numa:1 core:4 pu:1");
  HostTopology t;
  ASSERT_TRUE(discover(&t).is_ok());
  auto ranks = simulated_placements(t, 2, 4);
  ASSERT_EQ(ranks.size(), 8u);
  // Round-robin over the two NUMA nodes, then over their cores.
  EXPECT_EQ(ranks[0].numa, 0);
  EXPECT_EQ(ranks[1].numa, 1);
  EXPECT_EQ(ranks[2].numa, 0);
  EXPECT_EQ(ranks[0].core, 0);
  EXPECT_EQ(ranks[2].core, 1);
  EXPECT_EQ(ranks[1].core, 4);
  EXPECT_EQ(ranks[1].package, 1);
  auto m = path_matrix(ranks);
  EXPECT_EQ(m[0][2], PathClass::kSameNuma);
  EXPECT_EQ(m[0][1], PathClass::kCrossSocket);
  EXPECT_EQ(m[0][4], PathClass::kOtherHost);
  EXPECT_EQ(m[5][7], PathClass::kSameNuma);
  EXPECT_EQ(m[5][6], PathClass::kCrossSocket);
  EXPECT_EQ(m[5][5], PathClass::kSelf);
}

// One NUMA node over both sockets (BIOS node interleaving), ranks bound to
// the sockets in turn (mpirun --map-by socket): the ring keeps each socket's
// ranks together, crossing between sockets twice, not on all 8 hops.
TEST(Paths, RingsCrossBetweenSocketsTwiceWhenANumaNodeSpansThem) {
  const int n = 8;
  std::vector<RankPlacement> p(n);
  std::vector<std::string> host(n, "h0");
  for (int r = 0; r < n; ++r) {
    p[r].host_hash = host_hash("h0");
    p[r].numa = 0;
    p[r].package = r % 2;
    p[r].core = r;
  }
  const auto groups = braid::host_groups(host, p);
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0], (std::vector<int>{0, 2, 4, 6, 1, 3, 5, 7}));
  int crossings = 0;
  for (int i = 0; i < n; ++i)
    crossings += path_between(p[groups[0][i]], p[groups[0][(i + 1) % n]]) == PathClass::kCrossSocket;
  EXPECT_EQ(crossings, 2);
}

// Python's json module is the judge when it is installed.
bool python_accepts_json(const std::string& path, bool* have_python) {
  *have_python = std::system("python3 -c 'import json' >/dev/null 2>&1") == 0;
  if (!*have_python) return false;
  std::string cmd = "python3 -c 'import json,sys; json.load(open(sys.argv[1]))' " + path;
  return std::system(cmd.c_str()) == 0;
}

TEST(Json, WellFormed) {
  HostTopology t = load_dgx();
  // Escapes, and bytes that are not UTF-8 (a host name read from a file).
  t.hostname = "quote\" backslash\\ newline\n tab\t bell\a bad\xff cut\xe2\x82";
  std::string json = to_json(t);
  for (const char* key : {"\"packages\"", "\"numa_nodes\"", "\"gpus\"", "\"nics\"", "\"nvlink_mbyte_s\"",
                          "\"gpu_matrix\"", "\"gpu_nic_matrix\"", "\"process\"", "\"mlx5_2\""})
    EXPECT_NE(json.find(key), std::string::npos) << key;
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < json.size(); ++i) {
    char c = json[i];
    if (in_string) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        in_string = false;
      EXPECT_GE(static_cast<unsigned char>(c), 0x20) << "raw control character at " << i;
      continue;
    }
    if (c == '"') in_string = true;
    if (c == '{' || c == '[') ++depth;
    if (c == '}' || c == ']') --depth;
    ASSERT_GE(depth, 0) << i;
  }
  EXPECT_EQ(depth, 0);
  EXPECT_FALSE(in_string);

  std::string path = temp_path("topo.json");
  std::ofstream(path) << json;
  bool have_python = false;
  bool ok = python_accepts_json(path, &have_python);
  std::remove(path.c_str());
  if (!have_python) GTEST_SKIP() << "python3 not found; JSON checked for balance only";
  EXPECT_TRUE(ok) << json;
}

// JSON is UTF-8: well-formed sequences pass, anything else becomes U+FFFD
// (a host name with byte 0xff made the whole document unreadable).
TEST(Json, QuotedTextIsUtf8) {
  EXPECT_EQ(json_quote("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x99\x82"),
            "\"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x99\x82\"");
  EXPECT_EQ(json_quote("a\xff"
                       "b"),
            "\"a\\ufffdb\"");
  EXPECT_EQ(json_quote("\xe2\x82"), "\"\\ufffd\\ufffd\"");             // cut short
  EXPECT_EQ(json_quote("\xc0\xaf"), "\"\\ufffd\\ufffd\"");             // overlong '/'
  EXPECT_EQ(json_quote("\xed\xa0\x80"), "\"\\ufffd\\ufffd\\ufffd\"");  // a surrogate
}

#ifdef BRAID_TOPO_BINARY
int run(const std::string& command) {
  int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(Tool, JsonOnSavedTopology) {
  std::string out = temp_path("tool.json");
  std::string cmd = "BRAID_TOPO_FILE='" + kDgxXml +
                    "' '" BRAID_TOPO_BINARY "' --json --hosts 2 --ranks-per-host 4 > " + out;
  EXPECT_EQ(run(cmd), 0) << cmd;
  bool have_python = false;
  bool ok = python_accepts_json(out, &have_python);
  std::remove(out.c_str());
  if (have_python) {
    EXPECT_TRUE(ok);
  }
}

// The tool's tuner counts logical CPUs, as a job does: 3 ranks on 2 cores
// of 2 hyperthreads each are not more ranks than cores; 5 are.
TEST(Tool, TunerCountsLogicalCpus) {
  const std::string out = temp_path("cpus.txt");
  for (int ranks : {3, 5}) {
    const std::string cmd = "BRAID_TOPO_FILE='synthetic:pack:1 core:2 pu:2' '" BRAID_TOPO_BINARY
                            "' --ranks-per-host " +
                            std::to_string(ranks) + " > " + out;
    ASSERT_EQ(run(cmd), 0) << cmd;
    std::ifstream in(out);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(text.find("more ranks than cores") != std::string::npos, ranks == 5) << text;
  }
  std::remove(out.c_str());
}

TEST(Tool, TextAndBadFlags) {
  EXPECT_EQ(run("BRAID_TOPO_FILE='" + kDgxXml + "' '" BRAID_TOPO_BINARY "' --ranks-per-host 3 > /dev/null"),
            0);
  EXPECT_EQ(run("'" BRAID_TOPO_BINARY "' > /dev/null"), 0);
  EXPECT_EQ(run("'" BRAID_TOPO_BINARY "' --frobnicate 2> /dev/null"), 2);
  EXPECT_EQ(run("'" BRAID_TOPO_BINARY "' --hosts 0 2> /dev/null"), 2);
  EXPECT_EQ(run("BRAID_TOPO_FILE=/nonexistent '" BRAID_TOPO_BINARY "' 2> /dev/null"), 1);
  EXPECT_EQ(run("BRAID_CUDA_P2P_LEVEL=NV2 '" BRAID_TOPO_BINARY "' 2> /dev/null"), 1);
}

// Under BRAID_TRANSPORT=tcp every pair shows tcp, no hierarchical schedule
// is built, and the tuner prices every link as tcp (it never picks hier).
TEST(Tool, TcpOnlyShowsTcpEverywhere) {
  const std::string out = temp_path("tcp.txt");
  for (const char* transport : {"auto", "tcp"}) {
    const std::string cmd = std::string("BRAID_TRANSPORT=") + transport +
                            " '" BRAID_TOPO_BINARY "' --hosts 2 --ranks-per-host 2 > " + out;
    ASSERT_EQ(run(cmd), 0) << cmd;
    std::ifstream in(out);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const bool tcp = transport[1] == 'c';
    EXPECT_EQ(text.find("R0  self  shm   tcp   tcp") != std::string::npos, !tcp) << text;
    EXPECT_EQ(text.find("R0  self  tcp   tcp   tcp") != std::string::npos, tcp) << text;
    EXPECT_EQ(text.find("hierarchical: inside each host") != std::string::npos, !tcp) << text;
    EXPECT_EQ(text.find("<= hier") != std::string::npos, !tcp) << text;
  }
  std::remove(out.c_str());
}

// The GPU pairs whose ranks would read each other's memory: GPU 0's row of
// the DGX (NVLink to GPUs 1-4, none to 5-7 across the sockets), by default
// and under BRAID_CUDA_P2P_LEVEL=LOC.
TEST(Tool, GpuIpcMatrix) {
  const std::string out = temp_path("ipc.txt");
  for (const char* level : {"", "LOC"}) {
    std::string cmd = "BRAID_TOPO_FILE='" + kDgxXml + "' BRAID_CUDA_P2P_LEVEL='" + level + "' '" +
                      BRAID_TOPO_BINARY "' | grep -A2 'Device collectives between GPUs' > " + out;
    ASSERT_EQ(run(cmd), 0) << cmd;
    std::ifstream in(out);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (*level == '\0') {
      EXPECT_NE(text.find("BRAID_CUDA_P2P_LEVEL=unset"), std::string::npos) << text;
      EXPECT_NE(text.find("GPU0  X     ipc   ipc   ipc   ipc   host  host  host"), std::string::npos) << text;
    } else {
      EXPECT_NE(text.find("BRAID_CUDA_P2P_LEVEL=LOC"), std::string::npos) << text;
      EXPECT_NE(text.find("GPU0  X     host  host  host  host  host  host  host"), std::string::npos) << text;
    }
  }
  std::remove(out.c_str());
}
#endif

}  // namespace
}  // namespace braid::topo
