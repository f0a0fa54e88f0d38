#include "src/topo/topology.h"

#include <hwloc.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <set>

#include "src/core/config.h"

namespace braid::topo {
namespace {

constexpr const char* kSyntheticPrefix = "synthetic:";

// Owns an hwloc topology or bitmap for the length of one discovery.
struct TopologyHandle {
  TopologyHandle() = default;
  TopologyHandle(const TopologyHandle&) = delete;
  TopologyHandle& operator=(const TopologyHandle&) = delete;
  ~TopologyHandle() {
    if (t != nullptr) hwloc_topology_destroy(t);
  }
  hwloc_topology_t t = nullptr;
};
struct BitmapHandle {
  BitmapHandle() = default;
  BitmapHandle(const BitmapHandle&) = delete;
  BitmapHandle& operator=(const BitmapHandle&) = delete;
  ~BitmapHandle() { hwloc_bitmap_free(b); }
  hwloc_bitmap_t b = hwloc_bitmap_alloc();
};

std::string info(hwloc_obj_t obj, const char* name) {
  const char* v = hwloc_obj_get_info_by_name(obj, name);
  return v != nullptr ? v : "";
}

// The first object of `type` (logical order) whose CPUs include all of
// `cpuset`; -1 when none does (the set spans several, or is empty).
int index_containing(hwloc_topology_t t, hwloc_obj_type_t type, hwloc_const_cpuset_t cpuset) {
  if (cpuset == nullptr || hwloc_bitmap_iszero(cpuset)) return -1;
  hwloc_obj_t obj = nullptr;
  while ((obj = hwloc_get_next_obj_by_type(t, type, obj)) != nullptr) {
    if (obj->cpuset != nullptr && hwloc_bitmap_isincluded(cpuset, obj->cpuset))
      return static_cast<int>(obj->logical_index);
  }
  return -1;
}

int numa_containing(hwloc_topology_t t, hwloc_const_cpuset_t cpuset) {
  return index_containing(t, HWLOC_OBJ_NUMANODE, cpuset);
}
int package_containing(hwloc_topology_t t, hwloc_const_cpuset_t cpuset) {
  return index_containing(t, HWLOC_OBJ_PACKAGE, cpuset);
}

int count_inside(hwloc_topology_t t, hwloc_const_cpuset_t cpuset, hwloc_obj_type_t type) {
  if (cpuset == nullptr) return 0;
  return hwloc_get_nbobjs_inside_cpuset_by_type(t, cpuset, type);
}

// The PUs of a cpuset are its bits: counted without a walk over every PU
// of the host (per core, that walk made discovery take cores x PUs steps:
// 10 s for 1,600 cores of 10 PUs).
int pus_in(hwloc_const_cpuset_t cpuset) {
  return cpuset == nullptr ? 0 : std::max(0, hwloc_bitmap_weight(cpuset));
}

std::string bus_id(hwloc_obj_t pci) {
  char buf[32];
  const auto& a = pci->attr->pcidev;
  std::snprintf(buf, sizeof(buf), "%04x:%02x:%02x.%x", static_cast<unsigned>(a.domain), a.bus, a.dev, a.func);
  return buf;
}

// `obj` is a PCI device or an OS device; locality comes from the first
// non-I/O ancestor (the object the host bridge hangs from).
DeviceLocation location_of(hwloc_topology_t t, hwloc_obj_t obj) {
  DeviceLocation loc;
  if (obj->type == HWLOC_OBJ_PCI_DEVICE) {
    loc.pci_bus_id = bus_id(obj);
    for (hwloc_obj_t p = obj->parent; p != nullptr && p->type == HWLOC_OBJ_BRIDGE; p = p->parent)
      loc.pci_bridges.push_back(p->gp_index);
    std::reverse(loc.pci_bridges.begin(), loc.pci_bridges.end());
  }
  hwloc_obj_t anchor = hwloc_get_non_io_ancestor_obj(t, obj);
  if (anchor != nullptr) {
    loc.numa = numa_containing(t, anchor->cpuset);
    loc.package = package_containing(t, anchor->cpuset);
  }
  return loc;
}

hwloc_obj_t pci_ancestor(hwloc_obj_t obj) {
  while (obj != nullptr && obj->type != HWLOC_OBJ_PCI_DEVICE) obj = obj->parent;
  return obj;
}

// N from "<prefix>N", else -1.
int suffix_index(const char* name, const char* prefix) {
  size_t n = std::strlen(prefix);
  if (name == nullptr || std::strncmp(name, prefix, n) != 0 || name[n] == '\0') return -1;
  char* end = nullptr;
  long v = std::strtol(name + n, &end, 10);
  return (*end == '\0' && v >= 0 && v < INT_MAX) ? static_cast<int>(v) : -1;
}

bool read_first_line(const std::string& path, std::string* line) {
  std::ifstream f(path);
  return static_cast<bool>(std::getline(f, *line));
}

void discover_cpus(hwloc_topology_t t, HostTopology* out) {
  hwloc_obj_t obj = nullptr;
  while ((obj = hwloc_get_next_obj_by_type(t, HWLOC_OBJ_PACKAGE, obj)) != nullptr) {
    PackageInfo p;
    p.os_index = obj->os_index == HWLOC_UNKNOWN_INDEX ? -1 : static_cast<int>(obj->os_index);
    p.cpu_model = info(obj, "CPUModel");
    p.cores = count_inside(t, obj->cpuset, HWLOC_OBJ_CORE);
    p.pus = pus_in(obj->cpuset);
    out->packages.push_back(std::move(p));
  }
  while ((obj = hwloc_get_next_obj_by_type(t, HWLOC_OBJ_NUMANODE, obj)) != nullptr) {
    NumaNodeInfo n;
    n.os_index = obj->os_index == HWLOC_UNKNOWN_INDEX ? -1 : static_cast<int>(obj->os_index);
    n.package = package_containing(t, obj->cpuset);
    n.memory_bytes = obj->attr->numanode.local_memory;
    out->numa_nodes.push_back(n);  // cores and PUs counted below, from the cores' side
  }
  // Some platforms report no cores; a PU then stands for one.
  hwloc_obj_type_t core_type =
      hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_CORE) > 0 ? HWLOC_OBJ_CORE : HWLOC_OBJ_PU;
  while ((obj = hwloc_get_next_obj_by_type(t, core_type, obj)) != nullptr) {
    CoreInfo c;
    c.os_index = obj->os_index == HWLOC_UNKNOWN_INDEX ? -1 : static_cast<int>(obj->os_index);
    c.package = package_containing(t, obj->cpuset);
    c.numa = numa_containing(t, obj->cpuset);
    c.pus = pus_in(obj->cpuset);
    out->cores.push_back(c);
  }
  // A NUMA node's cpuset is its locality: a memory-only node (HBM, CXL)
  // beside a package's DRAM node has the package's CPUs there too. Each
  // core counts for the first node that covers it, so a memory-only node
  // has none (and stays under the package it is local to).
  for (const CoreInfo& c : out->cores) {
    if (c.numa < 0 || static_cast<size_t>(c.numa) >= out->numa_nodes.size()) continue;
    out->numa_nodes[static_cast<size_t>(c.numa)].cores += 1;
    out->numa_nodes[static_cast<size_t>(c.numa)].pus += c.pus;
  }
  out->pus = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_PU);
  while ((obj = hwloc_get_next_obj_by_type(t, HWLOC_OBJ_L3CACHE, obj)) != nullptr) {
    CacheInfo c;
    c.size_bytes = obj->attr->cache.size;
    c.package = package_containing(t, obj->cpuset);
    c.numa = numa_containing(t, obj->cpuset);
    c.cores = count_inside(t, obj->cpuset, HWLOC_OBJ_CORE);
    out->l3_caches.push_back(c);
  }
}

// A display-class (0x03) or processing-accelerator (0x12, as data-centre
// GPUs may say) PCI device from a GPU vendor, or one a GPU compute backend
// (CUDA, OpenCL, ...) attached a co-processor to. Not the BMC's VGA chip,
// nor other co-processors (a vector engine's class is 0x0b).
bool is_gpu(hwloc_obj_t pci) {
  const auto& a = pci->attr->pcidev;
  const unsigned cls = a.class_id >> 8;
  if (cls != 0x03 && cls != 0x12) return false;
  if (a.vendor_id == 0x10de || a.vendor_id == 0x1002 || a.vendor_id == 0x8086) return true;
  for (hwloc_obj_t c = pci->io_first_child; c != nullptr; c = c->next_sibling)
    if (c->type == HWLOC_OBJ_OS_DEVICE && c->attr->osdev.type == HWLOC_OBJ_OSDEV_COPROC) return true;
  return false;
}

void discover_gpus(hwloc_topology_t t, HostTopology* out) {
  std::set<int> taken;
  hwloc_obj_t pci = nullptr;
  while ((pci = hwloc_get_next_pcidev(t, pci)) != nullptr) {
    if (!is_gpu(pci)) continue;
    GpuInfo g;
    g.location = location_of(t, pci);
    g.vendor_id = pci->attr->pcidev.vendor_id;
    g.device_id = pci->attr->pcidev.device_id;
    g.pci_link_gbyte_s = pci->attr->pcidev.linkspeed;
    g.vendor = info(pci, "PCIVendor");
    g.name = info(pci, "PCIDevice");
    for (hwloc_obj_t c = pci->io_first_child; c != nullptr; c = c->next_sibling) {
      if (c->type != HWLOC_OBJ_OS_DEVICE || c->name == nullptr) continue;
      int cuda = suffix_index(c->name, "cuda");
      int nvml = suffix_index(c->name, "nvml");
      if (cuda < 0 && nvml < 0) continue;
      // CUDA's numbering wins over NVML's when both are present.
      if (g.cuda_index < 0 || cuda >= 0) {
        g.cuda_index = cuda >= 0 ? cuda : nvml;
        g.os_device = c->name;
      }
      if (std::string m = info(c, "GPUModel"); !m.empty()) g.name = m;
      if (std::string v = info(c, "GPUVendor"); !v.empty()) g.vendor = v;
    }
    if (g.cuda_index >= 0 && !taken.insert(g.cuda_index).second) g.cuda_index = -1;
    out->gpus.push_back(std::move(g));
  }
  int next = 0;
  for (GpuInfo& g : out->gpus) {
    if (g.cuda_index >= 0) continue;
    while (taken.count(next) != 0) ++next;
    g.cuda_index = next;
    taken.insert(next);
  }
  std::stable_sort(out->gpus.begin(), out->gpus.end(),
                   [](const GpuInfo& a, const GpuInfo& b) { return a.cuda_index < b.cuda_index; });
}

// NVML records NVLink bandwidth between GPU OS devices, and to NVSwitch PCI
// devices when GPUs meet only through switches; merging the switch ports and
// closing transitively turns the latter into GPU-to-GPU bandwidth.
void discover_nvlink(hwloc_topology_t t, HostTopology* out) {
  if (out->gpus.empty()) return;
  unsigned nr = 1;
  hwloc_distances_s* d = nullptr;
  if (hwloc_distances_get_by_name(t, "NVLinkBandwidth", &nr, &d, 0) != 0 || nr == 0 || d == nullptr) return;
  auto gpu_of = [&](hwloc_obj_t obj) -> int {
    hwloc_obj_t pci = pci_ancestor(obj);
    if (pci == nullptr) return -1;
    std::string id = bus_id(pci);
    for (size_t i = 0; i < out->gpus.size(); ++i)
      if (out->gpus[i].location.pci_bus_id == id) return static_cast<int>(i);
    return -1;
  };
  bool only_gpus = true;
  for (unsigned i = 0; i < d->nbobjs; ++i) only_gpus = only_gpus && gpu_of(d->objs[i]) >= 0;
  if (!only_gpus) {
    // Either may fail (no switch ports to merge): the matrix is then used as is.
    hwloc_distances_transform(t, d, HWLOC_DISTANCES_TRANSFORM_MERGE_SWITCH_PORTS, nullptr, 0);
    hwloc_distances_transform(t, d, HWLOC_DISTANCES_TRANSFORM_TRANSITIVE_CLOSURE, nullptr, 0);
  }
  size_t n = out->gpus.size();
  out->nvlink_mbyte_s.assign(n, std::vector<uint64_t>(n, 0));
  for (unsigned i = 0; i < d->nbobjs; ++i) {
    if (d->objs[i] == nullptr) continue;  // removed by a transform
    int gi = gpu_of(d->objs[i]);
    for (unsigned j = 0; j < d->nbobjs && gi >= 0; ++j) {
      if (i == j || d->objs[j] == nullptr) continue;
      int gj = gpu_of(d->objs[j]);
      if (gj < 0 || gj == gi) continue;
      uint64_t& cell = out->nvlink_mbyte_s[gi][gj];
      cell = std::max(cell, static_cast<uint64_t>(d->values[i * d->nbobjs + j]));
    }
  }
  hwloc_distances_release(t, d);
}

// InfiniBand ports have a LID; RoCE ports report LID 0.
std::string verbs_kind(hwloc_obj_t osdev, bool live) {
  std::string layer;
  if (live &&
      read_first_line(std::string("/sys/class/infiniband/") + osdev->name + "/ports/1/link_layer", &layer)) {
    if (layer == "InfiniBand") return "ib";
    if (layer == "Ethernet") return "roce";
  }
  std::string lid = info(osdev, "Port1LID");
  if (lid.empty()) return "";
  return std::strtoul(lid.c_str(), nullptr, 0) != 0 ? "ib" : "roce";
}

// An IPoIB interface has a 20-byte hardware address (59 characters as hex).
std::string netdev_kind(hwloc_obj_t osdev) {
  return info(osdev, "Address").size() == 59 ? "ib" : "eth";
}

double port_rate_gbit_s(const NicInfo& nic, bool verbs, bool live) {
  if (!live) return 0;
  std::string line;
  // "200 Gb/sec (4X HDR)"
  if (verbs && read_first_line("/sys/class/infiniband/" + nic.name + "/ports/1/rate", &line))
    return std::strtod(line.c_str(), nullptr);
  // Mb/s; -1 or unreadable while the link is down.
  if (!nic.netdev.empty() && read_first_line("/sys/class/net/" + nic.netdev + "/speed", &line)) {
    double mbit = std::strtod(line.c_str(), nullptr);
    return mbit > 0 ? mbit / 1000 : 0;
  }
  return 0;
}

// One NIC per PCI function: its verbs device and network interface together.
void discover_nics(hwloc_topology_t t, bool live, HostTopology* out) {
  struct Found {
    NicInfo nic;
    bool verbs = false;
  };
  std::vector<Found> found;
  std::map<hwloc_obj_t, size_t> by_pci;
  hwloc_obj_t osdev = nullptr;
  while ((osdev = hwloc_get_next_osdev(t, osdev)) != nullptr) {
    auto type = osdev->attr->osdev.type;
    if ((type != HWLOC_OBJ_OSDEV_OPENFABRICS && type != HWLOC_OBJ_OSDEV_NETWORK) || osdev->name == nullptr)
      continue;
    hwloc_obj_t pci = pci_ancestor(osdev);
    size_t k;
    if (auto it = by_pci.find(pci); pci != nullptr && it != by_pci.end()) {
      k = it->second;
    } else {
      k = found.size();
      found.emplace_back();
      found[k].nic.location = location_of(t, pci != nullptr ? pci : osdev);
      if (pci != nullptr) {
        found[k].nic.pci_link_gbyte_s = pci->attr->pcidev.linkspeed;
        by_pci[pci] = k;
      }
    }
    NicInfo& nic = found[k].nic;
    if (type == HWLOC_OBJ_OSDEV_OPENFABRICS) {
      if (found[k].verbs) continue;  // several verbs devices on one function: keep the first
      found[k].verbs = true;
      nic.name = osdev->name;
      nic.kind = verbs_kind(osdev, live);
    } else if (nic.netdev.empty()) {
      nic.netdev = osdev->name;
      if (!found[k].verbs) {
        nic.name = osdev->name;
        nic.kind = netdev_kind(osdev);
      }
    }
  }
  for (Found& f : found) {
    f.nic.port_gbit_s = port_rate_gbit_s(f.nic, f.verbs, live);
    out->nics.push_back(std::move(f.nic));
  }
  std::stable_sort(out->nics.begin(), out->nics.end(), [](const NicInfo& a, const NicInfo& b) {
    return a.location.pci_bus_id < b.location.pci_bus_id;
  });
}

// The binding is stable; the CPU the calling thread last ran on is a snapshot,
// used when the binding spans several NUMA nodes (or cores).
void locate_process(hwloc_topology_t t, HostTopology* out) {
  BitmapHandle bound, last;
  bool have_bound = hwloc_get_cpubind(t, bound.b, 0) == 0 && !hwloc_bitmap_iszero(bound.b);
  bool have_last =
      hwloc_get_last_cpu_location(t, last.b, HWLOC_CPUBIND_THREAD) == 0 && !hwloc_bitmap_iszero(last.b);
  auto locate = [&](auto find) {
    int i = have_bound ? find(bound.b) : -1;
    return (i < 0 && have_last) ? find(last.b) : i;
  };
  out->process_numa = locate([&](hwloc_const_cpuset_t s) { return numa_containing(t, s); });
  out->process_package = locate([&](hwloc_const_cpuset_t s) { return package_containing(t, s); });
  hwloc_obj_type_t core_type =
      hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_CORE) > 0 ? HWLOC_OBJ_CORE : HWLOC_OBJ_PU;
  out->process_core = locate([&](hwloc_const_cpuset_t s) { return index_containing(t, core_type, s); });
}

Status apply_numa_override(HostTopology* out) {
  long numa = 0;
  bool present = false;
  BRAID_RETURN_IF_ERROR(env_int("BRAID_TOPO_NUMA", 0, INT_MAX, &numa, &present));
  if (!present) return Status::ok();
  if (numa >= static_cast<long>(out->numa_nodes.size()))
    return Status::invalid_argument("environment variable BRAID_TOPO_NUMA=" + std::to_string(numa) +
                                    " is out of range: the topology (" + out->source + ") has " +
                                    std::to_string(out->numa_nodes.size()) + " NUMA node(s)");
  out->process_numa = static_cast<int>(numa);
  out->process_package = out->numa_nodes[numa].package;
  if (out->process_core >= 0 && out->cores[out->process_core].numa != out->process_numa)
    out->process_core = -1;
  return Status::ok();
}

Status load(hwloc_topology_t t, const std::string& spec) {
  if (hwloc_topology_set_io_types_filter(t, HWLOC_TYPE_FILTER_KEEP_IMPORTANT) != 0)
    return Status::system("hwloc_topology_set_io_types_filter", errno);
  if (spec.rfind(kSyntheticPrefix, 0) == 0) {
    std::string description = spec.substr(std::strlen(kSyntheticPrefix));
    if (hwloc_topology_set_synthetic(t, description.c_str()) != 0)
      return Status::invalid_argument("BRAID_TOPO_FILE='" + spec +
                                      "': hwloc rejected the synthetic description (" + std::strerror(errno) +
                                      ")");
  } else if (!spec.empty()) {
    if (hwloc_topology_set_xml(t, spec.c_str()) != 0)
      return Status::invalid_argument("BRAID_TOPO_FILE='" + spec +
                                      "': hwloc cannot read it as a topology XML file (" +
                                      std::strerror(errno) + ")");
  }
  if (hwloc_topology_load(t) != 0) {
    int err = errno;
    if (!spec.empty())
      return Status::invalid_argument("BRAID_TOPO_FILE='" + spec + "': hwloc failed to load the topology (" +
                                      std::strerror(err) + ")");
    return Status::system("hwloc_topology_load of this host", err);
  }
  return Status::ok();
}

}  // namespace

namespace {
hwloc_topology_t g_plugin_keeper = nullptr;  // see discover()
}  // namespace

Status discover(HostTopology* out) {
  *out = HostTopology{};
  // hwloc unloads its plugins when its last topology is destroyed, and the
  // PCI plugin's libpciaccess then loses what it allocated (LeakSanitizer
  // reports it). An empty topology kept for the life of the process keeps
  // the plugins loaded.
  static std::once_flag once;
  std::call_once(once, [] {
    if (hwloc_topology_init(&g_plugin_keeper) != 0) g_plugin_keeper = nullptr;
  });
  const char* file = std::getenv("BRAID_TOPO_FILE");
  std::string spec = file != nullptr ? file : "";
  TopologyHandle topo;
  if (hwloc_topology_init(&topo.t) != 0) return Status::system("hwloc_topology_init", errno);
  BRAID_RETURN_IF_ERROR(load(topo.t, spec));
  hwloc_topology_t t = topo.t;
  // hwloc's own HWLOC_XMLFILE / HWLOC_SYNTHETIC can also make it load a file.
  bool live = spec.empty() && hwloc_topology_is_thissystem(t) != 0;
  out->source = spec.empty() ? "this host" : spec;
  out->hostname = info(hwloc_get_root_obj(t), "HostName");
  discover_cpus(t, out);
  discover_gpus(t, out);
  discover_nvlink(t, out);
  discover_nics(t, live, out);
  if (live) locate_process(t, out);
  return apply_numa_override(out);
}

// ---- placement and path classes ----

uint64_t host_hash(const std::string& host_id) {
  // FNV-1a: stable across processes and builds, unlike std::hash.
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : host_id) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

RankPlacement placement_of(const HostTopology& topology, const std::string& host_id) {
  RankPlacement p;
  p.host_hash = host_hash(host_id);
  p.numa = topology.process_numa;
  p.package = topology.process_package;
  p.core = topology.process_core;
  p.num_gpus = static_cast<int32_t>(topology.gpus.size());
  p.num_nics = static_cast<int32_t>(topology.nics.size());
  p.num_numa_nodes = static_cast<int32_t>(topology.numa_nodes.size());
  return p;
}

std::vector<RankPlacement> simulated_placements(const HostTopology& topology, int hosts, int ranks_per_host) {
  // Cores of each NUMA node that has any; one pseudo-node for a topology
  // without NUMA information.
  std::vector<std::vector<int>> cores_of;
  std::vector<int> numa_of;
  for (size_t n = 0; n < topology.numa_nodes.size(); ++n) {
    std::vector<int> cores;
    for (size_t c = 0; c < topology.cores.size(); ++c)
      if (topology.cores[c].numa == static_cast<int>(n)) cores.push_back(static_cast<int>(c));
    if (cores.empty()) continue;
    cores_of.push_back(std::move(cores));
    numa_of.push_back(static_cast<int>(n));
  }
  if (cores_of.empty()) {
    std::vector<int> all;
    for (size_t c = 0; c < topology.cores.size(); ++c) all.push_back(static_cast<int>(c));
    cores_of.push_back(std::move(all));
    numa_of.push_back(-1);
  }
  std::vector<RankPlacement> out;
  for (int h = 0; h < hosts; ++h) {
    RankPlacement base = placement_of(topology, "host" + std::to_string(h));
    for (int r = 0; r < ranks_per_host; ++r) {
      size_t group = static_cast<size_t>(r) % cores_of.size();
      const std::vector<int>& cores = cores_of[group];
      RankPlacement p = base;
      p.numa = numa_of[group];
      p.core = cores.empty() ? -1 : cores[(static_cast<size_t>(r) / cores_of.size()) % cores.size()];
      p.package = p.core >= 0 ? topology.cores[p.core].package
                              : (p.numa >= 0 ? topology.numa_nodes[p.numa].package : -1);
      out.push_back(p);
    }
  }
  return out;
}

namespace {
// Indexed by PathClass: the short code and the legend's line.
constexpr const char* kPathText[][2] = {
    {"X", "the same core"},
    {"NUMA", "same NUMA node (local memory, usually a shared L3)"},
    {"HOST", "same host and package, different NUMA nodes or NUMA unknown"},
    {"SYS", "same host, different packages (crosses the inter-socket link)"},
    {"NET", "different hosts (crosses the network)"},
};
}  // namespace

const char* path_name(PathClass path) {
  return kPathText[static_cast<int>(path)][0];
}

const char* path_description(PathClass path) {
  return kPathText[static_cast<int>(path)][1];
}

PathClass path_between(const RankPlacement& a, const RankPlacement& b) {
  if (a.host_hash != b.host_hash) return PathClass::kOtherHost;
  if (a.core >= 0 && a.core == b.core) return PathClass::kSelf;
  // Sockets first: one NUMA node may span both (node interleaving, or a
  // saved topology whose only node hwloc made for the whole machine).
  if (a.package >= 0 && b.package >= 0 && a.package != b.package) return PathClass::kCrossSocket;
  if (a.numa >= 0 && a.numa == b.numa) return PathClass::kSameNuma;
  return PathClass::kSameHost;
}

uint64_t l3_bytes_of_host_ranks(const HostTopology& topology, const std::vector<RankPlacement>& ranks,
                                int me) {
  std::vector<int> packages;
  bool unknown = false;
  for (const RankPlacement& p : ranks) {
    if (p.host_hash != ranks[me].host_hash) continue;
    unknown |= p.package < 0;
    packages.push_back(p.package);
  }
  uint64_t bytes = 0;
  for (const CacheInfo& c : topology.l3_caches)
    if (unknown || c.package < 0 || std::find(packages.begin(), packages.end(), c.package) != packages.end())
      bytes += c.size_bytes;
  return bytes;
}

std::vector<std::vector<PathClass>> path_matrix(const std::vector<RankPlacement>& ranks) {
  std::vector<std::vector<PathClass>> m(ranks.size(), std::vector<PathClass>(ranks.size()));
  for (size_t i = 0; i < ranks.size(); ++i)
    for (size_t j = 0; j < ranks.size(); ++j)
      m[i][j] = i == j ? PathClass::kSelf : path_between(ranks[i], ranks[j]);
  return m;
}

// ---- device paths ----

const char* pci_path_name(PciPath path) {
  switch (path) {
    case PciPath::kPix:
      return "PIX";
    case PciPath::kPxb:
      return "PXB";
    case PciPath::kPhb:
      return "PHB";
    case PciPath::kNode:
      return "NODE";
    case PciPath::kSys:
      return "SYS";
  }
  return "?";
}

PciPath pci_path_between(const DeviceLocation& a, const DeviceLocation& b) {
  const auto& pa = a.pci_bridges;
  const auto& pb = b.pci_bridges;
  size_t common = 0;
  while (common < pa.size() && common < pb.size() && pa[common] == pb[common]) ++common;
  if (common == 1) return PciPath::kPhb;
  if (common > 1) {
    // A PCIe switch shows as an upstream bridge over one downstream bridge per
    // port: devices at most one bridge below the shared one share a switch.
    return (pa.size() - common <= 1 && pb.size() - common <= 1) ? PciPath::kPix : PciPath::kPxb;
  }
  // Another socket is SYS even where one NUMA node spans both.
  if (a.package >= 0 && b.package >= 0 && a.package != b.package) return PciPath::kSys;
  if (a.numa >= 0 && a.numa == b.numa) return PciPath::kNode;
  // NUMA unknown on one side but the same package: still one socket.
  if ((a.numa < 0 || b.numa < 0) && a.package >= 0 && a.package == b.package) return PciPath::kNode;
  return PciPath::kSys;
}

int nvlink_count(uint64_t mbyte_s) {
  if (mbyte_s == 0) return 0;
  if (mbyte_s % 25000 == 0) return static_cast<int>(mbyte_s / 25000);
  if (mbyte_s % 20000 == 0) return static_cast<int>(mbyte_s / 20000);
  return std::max(1, static_cast<int>(std::lround(static_cast<double>(mbyte_s) / 25000)));
}

std::vector<std::vector<std::string>> gpu_matrix(const HostTopology& topology) {
  const auto& gpus = topology.gpus;
  std::vector<std::vector<std::string>> m(gpus.size(), std::vector<std::string>(gpus.size()));
  for (size_t i = 0; i < gpus.size(); ++i) {
    for (size_t j = 0; j < gpus.size(); ++j) {
      uint64_t nv = topology.nvlink_mbyte_s.empty() ? 0 : topology.nvlink_mbyte_s[i][j];
      if (i == j)
        m[i][j] = "X";
      else if (nv > 0)
        m[i][j] = "NV" + std::to_string(nvlink_count(nv));
      else
        m[i][j] = pci_path_name(pci_path_between(gpus[i].location, gpus[j].location));
    }
  }
  return m;
}

std::vector<std::vector<std::string>> gpu_nic_matrix(const HostTopology& topology) {
  std::vector<std::vector<std::string>> m;
  for (const GpuInfo& g : topology.gpus) {
    m.emplace_back();
    for (const NicInfo& n : topology.nics)
      m.back().push_back(pci_path_name(pci_path_between(g.location, n.location)));
  }
  return m;
}

const char* device_matrix_legend() {
  return "  X    = self\n"
         "  SYS  = across NUMA nodes / sockets (the SMP interconnect: UPI, Infinity Fabric), or locality "
         "unknown\n"
         "  NODE = within one NUMA node, between PCIe host bridges\n"
         "  PHB  = through one PCIe host bridge (the CPU's root complex)\n"
         "  PXB  = through several PCIe switches, no host bridge\n"
         "  PIX  = through at most one PCIe switch\n"
         "  NV#  = # NVLinks (hwloc's NVLinkBandwidth at 25 GB/s per link)\n";
}

// ---- CUDA peer access ----

namespace {

constexpr P2pLevel kP2pLevels[] = {P2pLevel::kLoc, P2pLevel::kNvl,  P2pLevel::kPix, P2pLevel::kPxb,
                                   P2pLevel::kPhb, P2pLevel::kNode, P2pLevel::kSys};

P2pLevel level_of(PciPath path) {
  switch (path) {
    case PciPath::kPix:
      return P2pLevel::kPix;
    case PciPath::kPxb:
      return P2pLevel::kPxb;
    case PciPath::kPhb:
      return P2pLevel::kPhb;
    case PciPath::kNode:
      return P2pLevel::kNode;
    case PciPath::kSys:
      break;
  }
  return P2pLevel::kSys;
}

// Domain, bus, device and function of a bus id, whatever its case or domain
// width; false if it is not one.
bool parse_bus_id(const std::string& text, uint64_t* key) {
  unsigned domain = 0, bus = 0, dev = 0, fn = 0;
  char end = 0;
  if (std::sscanf(text.c_str(), "%x:%x:%x.%x%c", &domain, &bus, &dev, &fn, &end) != 4) return false;
  *key = (uint64_t{domain} << 32) | (uint64_t{bus} << 16) | (uint64_t{dev} << 8) | fn;
  return true;
}

}  // namespace

const char* p2p_level_name(P2pLevel level) {
  switch (level) {
    case P2pLevel::kLoc:
      return "LOC";
    case P2pLevel::kNvl:
      return "NVL";
    case P2pLevel::kPix:
      return "PIX";
    case P2pLevel::kPxb:
      return "PXB";
    case P2pLevel::kPhb:
      return "PHB";
    case P2pLevel::kNode:
      return "NODE";
    case P2pLevel::kSys:
      return "SYS";
  }
  return "?";
}

Status parse_p2p_level(const std::string& text, P2pLevel* out) {
  std::string upper;
  for (char c : text) upper += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  for (P2pLevel level : kP2pLevels) {
    if (upper == p2p_level_name(level)) {
      *out = level;
      return Status::ok();
    }
  }
  return Status::invalid_argument("'" + text +
                                  "' is not a path level (valid: LOC, NVL, PIX, PXB, PHB, NODE, SYS)");
}

int gpu_by_bus_id(const HostTopology& topology, const std::string& bus_id) {
  uint64_t want = 0, have = 0;
  if (!parse_bus_id(bus_id, &want)) return -1;
  for (size_t i = 0; i < topology.gpus.size(); ++i)
    if (parse_bus_id(topology.gpus[i].location.pci_bus_id, &have) && have == want) return static_cast<int>(i);
  return -1;
}

bool p2p_allowed(const HostTopology& topology, const P2pLevel* level, const std::string& bus_a,
                 const std::string& bus_b, std::string* path, std::string* why) {
  const int a = gpu_by_bus_id(topology, bus_a), b = gpu_by_bus_id(topology, bus_b);
  // A matrix without one link between GPUs says nothing (hwloc's NVML
  // backend may not resolve NVSwitch paths): NVLink counts as unseen then.
  bool nvlink_known = false;
  for (const auto& row : topology.nvlink_mbyte_s)
    for (uint64_t v : row) nvlink_known = nvlink_known || v > 0;
  P2pLevel reach = P2pLevel::kSys;
  *path = "unknown";
  if (a >= 0 && b >= 0) {
    const uint64_t nv = nvlink_known ? topology.nvlink_mbyte_s[a][b] : 0;
    if (nv > 0) {
      reach = P2pLevel::kNvl;
      *path = "NV" + std::to_string(nvlink_count(nv));
    } else {
      const PciPath pci = pci_path_between(topology.gpus[a].location, topology.gpus[b].location);
      reach = level_of(pci);
      *path = pci_path_name(pci);
    }
  }
  const std::string pair = "GPUs " + bus_a + " and " + bus_b + " (path " + *path + ")";
  if (level != nullptr) {
    if (reach <= *level) return true;
    *why =
        *level == P2pLevel::kLoc
            ? pair +
                  ": BRAID_CUDA_P2P_LEVEL=LOC keeps ranks on different GPUs from reading each other's memory"
            : pair + " are farther apart than BRAID_CUDA_P2P_LEVEL=" + p2p_level_name(*level);
    return false;
  }
  // SYS also stands for an unknown locality and for NUMA nodes of one
  // package: refused by default only where both packages are known and differ.
  const int pa = a >= 0 ? topology.gpus[a].location.package : -1;
  const int pb = b >= 0 ? topology.gpus[b].location.package : -1;
  if (nvlink_known && reach == P2pLevel::kSys && pa >= 0 && pb >= 0 && pa != pb) {
    *why = pair +
           " have no NVLink and cross the link between sockets, where reading peer memory is "
           "slower than staging through host memory (BRAID_CUDA_P2P_LEVEL=SYS allows it)";
    return false;
  }
  return true;
}

// ---- text ----

namespace {

std::string human_bytes(uint64_t bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  size_t u = 0;
  while (v >= 1024 && u + 1 < std::size(kUnits)) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  if (v == std::floor(v))
    std::snprintf(buf, sizeof(buf), "%.0f %s", v, kUnits[u]);
  else
    std::snprintf(buf, sizeof(buf), "%.1f %s", v, kUnits[u]);
  return buf;
}

std::string plural(int n, const char* one, const char* many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

std::string gpu_line(const GpuInfo& g) {
  std::string s = "GPU " + std::to_string(g.cuda_index);
  if (!g.location.pci_bus_id.empty()) s += "  " + g.location.pci_bus_id;
  if (!g.name.empty()) s += "  " + g.name;
  if (!g.os_device.empty()) s += "  (" + g.os_device + ")";
  return s;
}

std::string nic_line(const NicInfo& n) {
  std::string s = "NIC " + n.name;
  if (!n.kind.empty()) s += "  " + n.kind;
  if (!n.location.pci_bus_id.empty()) s += "  " + n.location.pci_bus_id;
  if (!n.netdev.empty() && n.netdev != n.name) s += "  netdev " + n.netdev;
  if (n.port_gbit_s > 0) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "  %g Gb/s", n.port_gbit_s);
    s += buf;
  }
  return s;
}

void append_devices(const HostTopology& t, int numa, int package, const std::string& indent,
                    std::string* out) {
  for (const GpuInfo& g : t.gpus)
    if (g.location.numa == numa && g.location.package == package) *out += indent + gpu_line(g) + "\n";
  for (const NicInfo& n : t.nics)
    if (n.location.numa == numa && n.location.package == package) *out += indent + nic_line(n) + "\n";
}

void append_caches(const HostTopology& t, int numa, int package, const std::string& indent,
                   std::string* out) {
  for (const CacheInfo& c : t.l3_caches)
    if (c.numa == numa && c.package == package)
      *out += indent + "L3 " + human_bytes(c.size_bytes) + " shared by " + plural(c.cores, "core", "cores") +
              "\n";
}

void append_numa(const HostTopology& t, int n, const std::string& indent, std::string* out) {
  const NumaNodeInfo& node = t.numa_nodes[n];
  *out += indent + "NUMA " + std::to_string(n) + " (os " + std::to_string(node.os_index) +
          "): " + human_bytes(node.memory_bytes) + ", " +
          (node.pus == 0 ? std::string("no CPUs (memory only)")
                         : plural(node.cores, "core", "cores") + ", " + plural(node.pus, "PU", "PUs")) +
          "\n";
  append_caches(t, n, node.package, indent + "  ", out);
  append_devices(t, n, node.package, indent + "  ", out);
}

}  // namespace

std::string describe_tree(const HostTopology& t) {
  std::string out = "Host";
  if (!t.hostname.empty()) out += " " + t.hostname;
  out += " (" + t.source + "): " + plural(static_cast<int>(t.packages.size()), "package", "packages") + ", " +
         plural(static_cast<int>(t.numa_nodes.size()), "NUMA node", "NUMA nodes") + ", " +
         plural(static_cast<int>(t.cores.size()), "core", "cores") + ", " + plural(t.pus, "PU", "PUs") +
         ", " + plural(static_cast<int>(t.gpus.size()), "GPU", "GPUs") + ", " +
         plural(static_cast<int>(t.nics.size()), "NIC", "NICs") + "\n";
  for (size_t p = 0; p < t.packages.size(); ++p) {
    const PackageInfo& pkg = t.packages[p];
    out += "  Package " + std::to_string(p);
    if (!pkg.cpu_model.empty()) out += " (" + pkg.cpu_model + ")";
    out += ": " + plural(pkg.cores, "core", "cores") + ", " + plural(pkg.pus, "PU", "PUs") + "\n";
    for (size_t n = 0; n < t.numa_nodes.size(); ++n)
      if (t.numa_nodes[n].package == static_cast<int>(p)) append_numa(t, static_cast<int>(n), "    ", &out);
    // Shared by several NUMA nodes of this package (sub-NUMA clustering),
    // or in this package under a node that spans packages (interleaving).
    append_caches(t, -1, static_cast<int>(p), "    ", &out);
    append_devices(t, -1, static_cast<int>(p), "    ", &out);
    for (size_t n = 0; n < t.numa_nodes.size(); ++n) {
      if (t.numa_nodes[n].package >= 0) continue;
      append_caches(t, static_cast<int>(n), static_cast<int>(p), "    ", &out);
      append_devices(t, static_cast<int>(n), static_cast<int>(p), "    ", &out);
    }
  }
  // NUMA nodes without a package (memory-only nodes, or spanning packages)
  // and devices with no single-package locality.
  std::string rest;
  for (size_t n = 0; n < t.numa_nodes.size(); ++n)
    if (t.numa_nodes[n].package < 0) append_numa(t, static_cast<int>(n), "    ", &rest);
  append_caches(t, -1, -1, "    ", &rest);
  append_devices(t, -1, -1, "    ", &rest);
  if (!rest.empty()) out += "  Not local to one package:\n" + rest;
  if (t.process_numa < 0 && t.process_package < 0 && t.process_core < 0) {
    out += "Process: location unknown\n";
  } else {
    out += "Process: NUMA " + std::to_string(t.process_numa) + ", package " +
           std::to_string(t.process_package) + ", core " + std::to_string(t.process_core) + "\n";
  }
  return out;
}

// ---- JSON ----

namespace {

// The length of the well-formed UTF-8 sequence at s[i], or 0 (a stray
// continuation byte, a truncated or overlong sequence, a surrogate).
size_t utf8_length(const std::string& s, size_t i) {
  const auto at = [&](size_t k) { return k < s.size() ? static_cast<unsigned char>(s[k]) : 0u; };
  const unsigned c = at(i);
  size_t n = 0;
  unsigned low = 0x80, high = 0xbf;  // the second byte's range
  if (c >= 0xc2 && c <= 0xdf) {
    n = 2;
  } else if (c >= 0xe0 && c <= 0xef) {
    n = 3;
    if (c == 0xe0) low = 0xa0;
    if (c == 0xed) high = 0x9f;
  } else if (c >= 0xf0 && c <= 0xf4) {
    n = 4;
    if (c == 0xf0) low = 0x90;
    if (c == 0xf4) high = 0x8f;
  } else {
    return 0;
  }
  if (at(i + 1) < low || at(i + 1) > high) return 0;
  for (size_t k = 2; k < n; ++k)
    if (at(i + k) < 0x80 || at(i + k) > 0xbf) return 0;
  return n;
}

}  // namespace

std::string json_quote(const std::string& s) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else if (c < 0x80) {
          out += static_cast<char>(c);
        } else if (const size_t n = utf8_length(s, i); n > 0) {
          out.append(s, i, n);
          i += n - 1;
        } else {
          out += "\\ufffd";  // JSON is UTF-8: a host name read from a file may not be
        }
    }
  }
  return out + "\"";
}

namespace {

// Appends members of one JSON object or array, placing the commas.
class JsonList {
 public:
  explicit JsonList(std::string* out, char open) : out_(out), close_(open == '{' ? '}' : ']') {
    *out_ += open;
  }
  ~JsonList() { *out_ += close_; }
  JsonList(const JsonList&) = delete;
  JsonList& operator=(const JsonList&) = delete;

  // Starts a member; returns the string to append the value to.
  std::string& key(const char* name) {
    comma();
    *out_ += json_quote(name) + ":";
    return *out_;
  }
  std::string& item() {
    comma();
    return *out_;
  }
  void field(const char* name, const std::string& v) { key(name) += json_quote(v); }
  void field(const char* name, int64_t v) { key(name) += std::to_string(v); }
  void field(const char* name, uint64_t v) { key(name) += std::to_string(v); }
  void field(const char* name, int v) { field(name, static_cast<int64_t>(v)); }
  void field(const char* name, double v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.6g", std::isfinite(v) ? v : 0.0);
    key(name) += buf;
  }

 private:
  void comma() {
    if (!first_) *out_ += ',';
    first_ = false;
  }
  std::string* out_;
  char close_;
  bool first_ = true;
};

void location_json(const DeviceLocation& loc, JsonList* o) {
  o->field("pci_bus_id", loc.pci_bus_id);
  o->field("numa", loc.numa);
  o->field("package", loc.package);
}

void string_matrix_json(const std::vector<std::vector<std::string>>& m, std::string* out) {
  JsonList rows(out, '[');
  for (const auto& row : m) {
    JsonList cells(&rows.item(), '[');
    for (const std::string& c : row) cells.item() += json_quote(c);
  }
}

}  // namespace

std::string to_json(const HostTopology& t) {
  std::string out;
  {
    JsonList top(&out, '{');
    top.field("source", t.source);
    top.field("hostname", t.hostname);
    {
      JsonList list(&top.key("packages"), '[');
      for (const PackageInfo& p : t.packages) {
        JsonList o(&list.item(), '{');
        o.field("os_index", p.os_index);
        o.field("cpu_model", p.cpu_model);
        o.field("cores", p.cores);
        o.field("pus", p.pus);
      }
    }
    {
      JsonList list(&top.key("numa_nodes"), '[');
      for (const NumaNodeInfo& n : t.numa_nodes) {
        JsonList o(&list.item(), '{');
        o.field("os_index", n.os_index);
        o.field("package", n.package);
        o.field("memory_bytes", n.memory_bytes);
        o.field("cores", n.cores);
        o.field("pus", n.pus);
      }
    }
    top.field("cores", static_cast<int>(t.cores.size()));
    top.field("pus", t.pus);
    {
      JsonList list(&top.key("l3_caches"), '[');
      for (const CacheInfo& c : t.l3_caches) {
        JsonList o(&list.item(), '{');
        o.field("size_bytes", c.size_bytes);
        o.field("package", c.package);
        o.field("numa", c.numa);
        o.field("cores", c.cores);
      }
    }
    {
      JsonList list(&top.key("gpus"), '[');
      for (const GpuInfo& g : t.gpus) {
        JsonList o(&list.item(), '{');
        o.field("cuda_index", g.cuda_index);
        location_json(g.location, &o);
        char ids[16];
        std::snprintf(ids, sizeof(ids), "%04x:%04x", g.vendor_id, g.device_id);
        o.field("pci_id", std::string(ids));
        o.field("vendor", g.vendor);
        o.field("name", g.name);
        o.field("os_device", g.os_device);
        o.field("pci_link_gbyte_s", g.pci_link_gbyte_s);
      }
    }
    {
      JsonList list(&top.key("nics"), '[');
      for (const NicInfo& n : t.nics) {
        JsonList o(&list.item(), '{');
        o.field("name", n.name);
        o.field("netdev", n.netdev);
        o.field("kind", n.kind);
        location_json(n.location, &o);
        o.field("port_gbit_s", n.port_gbit_s);
        o.field("pci_link_gbyte_s", n.pci_link_gbyte_s);
      }
    }
    {
      JsonList rows(&top.key("nvlink_mbyte_s"), '[');
      for (const auto& row : t.nvlink_mbyte_s) {
        JsonList cells(&rows.item(), '[');
        for (uint64_t v : row) cells.item() += std::to_string(v);
      }
    }
    string_matrix_json(gpu_matrix(t), &top.key("gpu_matrix"));
    string_matrix_json(gpu_nic_matrix(t), &top.key("gpu_nic_matrix"));
    {
      JsonList o(&top.key("process"), '{');
      o.field("numa", t.process_numa);
      o.field("package", t.process_package);
      o.field("core", t.process_core);
    }
  }
  return out;
}

}  // namespace braid::topo
