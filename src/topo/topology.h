// Hardware topology of one host, discovered through hwloc: packages, NUMA
// nodes, cores, L3 caches, GPUs, NICs and the links between them, plus how
// two ranks or two devices are connected ("path classes").
//
// The structs hold plain data only; hwloc stays inside topology.cc. So a
// topology can be printed, compared, sent to other ranks and tested on a
// machine without the hardware it describes.
//
// Indexes of packages, NUMA nodes and cores are hwloc logical indexes
// (0..n-1 in topology order, the same on every run of one machine), not the
// kernel's numbers, which are kept as os_index. -1 means unknown.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "src/core/status.h"

namespace braid::topo {

struct PackageInfo {
  int os_index = -1;
  std::string cpu_model;  // hwloc's "CPUModel" info; empty when unknown
  int cores = 0;
  int pus = 0;
};

struct NumaNodeInfo {
  int os_index = -1;  // the kernel's node number (numactl, /sys/devices/system/node)
  int package = -1;   // -1 when it spans packages
  // Memory-only nodes (HBM, CXL beside a package's DRAM node) have no cores.
  uint64_t memory_bytes = 0;
  int cores = 0;
  int pus = 0;
};

struct CoreInfo {
  int os_index = -1;
  int package = -1;
  int numa = -1;
  int pus = 0;
};

struct CacheInfo {  // an L3 cache
  uint64_t size_bytes = 0;
  int package = -1;
  int numa = -1;  // -1 when shared by the cores of several NUMA nodes
  int cores = 0;
};

// Where an I/O device sits: its PCI address, the PCI bridges above it, and the
// NUMA node / package its host bridge is attached to.
struct DeviceLocation {
  std::string pci_bus_id;             // "0000:3b:00.0"; empty for a device not on PCI
  std::vector<uint64_t> pci_bridges;  // ids of the bridges above it, host bridge first
  int numa = -1;
  int package = -1;
};

struct GpuInfo {
  DeviceLocation location;
  uint16_t vendor_id = 0;
  uint16_t device_id = 0;
  std::string vendor;           // as hwloc gives it (GPUVendor, else PCIVendor); may be empty
  std::string name;             // GPUModel from the CUDA/NVML backends, else PCIDevice; may be empty
  std::string os_device;        // "cuda0", "nvml0", ...; empty when no GPU backend saw it
  int cuda_index = -1;          // N of "cudaN"/"nvmlN", else the next free index in PCI order
  double pci_link_gbyte_s = 0;  // PCIe link bandwidth, 0 when unknown
};

struct NicInfo {
  DeviceLocation location;
  std::string name;             // the verbs device ("mlx5_0") when there is one, else the interface ("eth0")
  std::string netdev;           // the network interface of the same device ("ib0", "ens1f0"); may be empty
  std::string kind;             // "ib", "roce", "eth", or empty when unknown
  double port_gbit_s = 0;       // link rate; 0 when unknown (read from sysfs on the live host only)
  double pci_link_gbyte_s = 0;  // PCIe link bandwidth, 0 when unknown
};

struct HostTopology {
  std::string source;    // "this host", the XML path, or "synthetic:<description>"
  std::string hostname;  // hwloc's HostName info; may be empty
  std::vector<PackageInfo> packages;
  std::vector<NumaNodeInfo> numa_nodes;
  std::vector<CoreInfo> cores;  // when hwloc reports no cores, one per PU
  int pus = 0;
  std::vector<CacheInfo> l3_caches;
  std::vector<GpuInfo> gpus;  // ordered by cuda_index
  std::vector<NicInfo> nics;  // in PCI order
  // NVLink bandwidth one way, in MB/s, between gpus[i] and gpus[j], from
  // hwloc's "NVLinkBandwidth" matrix (NVML backend); 0 for a pair without a
  // direct NVLink (or path through NVSwitches), 0 on the diagonal. Empty when
  // the topology has no such matrix.
  std::vector<std::vector<uint64_t>> nvlink_mbyte_s;
  // Where the calling process runs: its CPU binding when that fits in one
  // NUMA node / package / core, else the CPU it last ran on. -1 when unknown:
  // always for a topology loaded from a file, unless BRAID_TOPO_NUMA says.
  int process_numa = -1;
  int process_package = -1;
  int process_core = -1;
};

// Discovers this host through hwloc, I/O devices included. With
// BRAID_TOPO_FILE set, loads that hwloc XML file instead, or, for a value
// "synthetic:<description>", an hwloc synthetic topology ("synthetic:pack:2
// numa:1 core:4 pu:1"). BRAID_TOPO_NUMA=<logical NUMA index> overrides the
// process's NUMA node and package (a loaded topology knows neither).
Status discover(HostTopology* out);

// ---- rank placement: what each rank tells the others at init ----

// Fixed size and trivially copyable, so it can be all-gathered as bytes.
struct RankPlacement {
  uint64_t host_hash = 0;  // host_hash(host id): equal on ranks of one host
  int32_t numa = -1;
  int32_t package = -1;
  int32_t core = -1;
  int32_t num_gpus = 0;
  int32_t num_nics = 0;
  int32_t num_numa_nodes = 0;
};
static_assert(std::is_trivially_copyable_v<RankPlacement>);
static_assert(std::is_standard_layout_v<RankPlacement>);
static_assert(sizeof(RankPlacement) == 32);

uint64_t host_hash(const std::string& host_id);
RankPlacement placement_of(const HostTopology& topology, const std::string& host_id);

// Placements for `hosts` copies of `topology` ("host0", "host1", ...), with
// ranks_per_host ranks each, dealt round-robin over the NUMA nodes that have
// cores, then over the cores of each node. For tools and tests.
std::vector<RankPlacement> simulated_placements(const HostTopology& topology, int hosts, int ranks_per_host);

// How two ranks reach each other, nearest first.
enum class PathClass {
  kSelf,         // "X": the same core (the rank itself, or ranks sharing a core)
  kSameNuma,     // "NUMA": same NUMA node: memory and usually the L3 are local to both
  kSameHost,     // "HOST": same host and package but different NUMA nodes, or NUMA unknown
  kCrossSocket,  // "SYS": same host, different packages: crosses the inter-socket link
  kOtherHost,    // "NET": different hosts: crosses the network
};
const char* path_name(PathClass path);         // the short code above
const char* path_description(PathClass path);  // one line for legends
PathClass path_between(const RankPlacement& a, const RankPlacement& b);
// [i][j] = path_between(ranks[i], ranks[j]); kSelf on the diagonal.
std::vector<std::vector<PathClass>> path_matrix(const std::vector<RankPlacement>& ranks);

// The L3 bytes that hold the buffers of the ranks on the host of `ranks[me]`:
// the L3s of the packages those ranks run on, every L3 of the host when
// some rank's package (or a cache's) is unknown; 0 without L3 information.
uint64_t l3_bytes_of_host_ranks(const HostTopology& topology, const std::vector<RankPlacement>& ranks,
                                int me);

// ---- device paths on one host, as `nvidia-smi topo -m` names them ----

enum class PciPath {
  kPix,   // "PIX": at most one PCIe switch between them
  kPxb,   // "PXB": several PCIe switches, no host bridge
  kPhb,   // "PHB": through one PCIe host bridge (the CPU's root complex)
  kNode,  // "NODE": between host bridges within one NUMA node
  kSys,   // "SYS": across NUMA nodes / sockets (UPI, Infinity Fabric), or locality unknown
};
const char* pci_path_name(PciPath path);
// From the lowest PCI bridge the two devices share.
PciPath pci_path_between(const DeviceLocation& a, const DeviceLocation& b);

// NVLink count for a bandwidth from hwloc's matrix, which credits 25 GB/s per
// link (20 GB/s on NVLink 1); 0 when mbyte_s is 0.
int nvlink_count(uint64_t mbyte_s);

// [i][j] for gpus i and j: "X" on the diagonal, "NV<links>" when NVLink
// connects them, else the PCI path name.
std::vector<std::vector<std::string>> gpu_matrix(const HostTopology& topology);
// [i][k] for gpus[i] and nics[k]: the PCI path name.
std::vector<std::vector<std::string>> gpu_nic_matrix(const HostTopology& topology);
// Legend of the codes in the two matrices.
const char* device_matrix_legend();

// ---- CUDA peer access between two GPUs of one host ----

// The farthest path between two GPUs over which ranks read each other's
// memory directly (CUDA IPC), nearest first: BRAID_CUDA_P2P_LEVEL, with
// NCCL_P2P_LEVEL's names. LOC: never between two GPUs (ranks sharing one
// GPU still map each other's memory: that is the GPU's own memory).
enum class P2pLevel { kLoc, kNvl, kPix, kPxb, kPhb, kNode, kSys };
const char* p2p_level_name(P2pLevel level);
// "LOC", "NVL", "PIX", "PXB", "PHB", "NODE" or "SYS" (any case); an error
// naming the valid values otherwise.
Status parse_p2p_level(const std::string& text, P2pLevel* out);

// The index in topology.gpus of the GPU at this PCI bus id ("0000:3b:00.0",
// or CUDA's "0000:3B:00.0" / "00000000:3B:00.0"), or -1.
int gpu_by_bus_id(const HostTopology& topology, const std::string& bus_id);

// Whether ranks on the GPUs at these two bus ids may read each other's
// memory, by the path between them. `level` unset (BRAID_CUDA_P2P_LEVEL
// not given): refused only where the topology shows the pair is joined by
// no NVLink (hwloc's NVLink matrix holds links, so a missing one is known,
// not unseen) and sits under two different packages; everything else is
// left to the driver (cuDeviceCanAccessPeer). With a level, a
// pair farther than it is refused; a GPU the topology does not hold counts
// as SYS. *path is the pair's code ("NV2", "PIX", ..., "unknown"); *why
// says why a pair was refused.
bool p2p_allowed(const HostTopology& topology, const P2pLevel* level, const std::string& bus_a,
                 const std::string& bus_b, std::string* path, std::string* why);

// Indented text: packages > NUMA nodes (memory, cores, L3) > GPUs and NICs,
// then devices not local to one package, then the process location.
std::string describe_tree(const HostTopology& topology);

// The topology as one JSON object (including gpu_matrix / gpu_nic_matrix).
std::string to_json(const HostTopology& topology);
// A JSON string literal with quotes and escapes, for tools that build JSON
// around to_json().
std::string json_quote(const std::string& s);

}  // namespace braid::topo
