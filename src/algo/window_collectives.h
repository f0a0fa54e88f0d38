// Collectives over registered host memory (braid_comm_register on memory
// from braid_mem_alloc, transports/shm/shared_memory.h) between the ranks of
// one host. Registration is collective: every rank maps every other rank's
// registered range, so all ranks hold the same windows under the same ids.
//
// A call that may use them first tells every rank where its buffers lie
// (window and offset). If every buffer it reads or writes on another rank
// lies in a window, it moves the data with loads and stores straight
// between the ranks' buffers, as threads of one process would (the pattern
// of bench/ceiling); otherwise the algorithm the tuner picked runs. Every
// rank decides from the same exchanged spots, so all decide alike.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "src/algo/collectives.h"
#include "src/algo/tuner.h"

namespace braid {

// A peer's whole allocation as mapped here; unmapped when the last window
// that lies in it is gone.
struct PeerMapping {
  PeerMapping(char* b, size_t n) : base(b), bytes(n) {}
  PeerMapping(const PeerMapping&) = delete;
  PeerMapping& operator=(const PeerMapping&) = delete;
  ~PeerMapping();
  char* const base;
  const size_t bytes;
};

struct WindowRecord;

// The peers' allocations one communicator has mapped, shared by its windows:
// registering many slices of one arena maps the arena once per peer, not
// once per slice (each mapping costs address space and a kernel mapping,
// of which a process has a limited number).
class PeerMappings {
 public:
  // Peer `peer`'s allocation that `theirs` names, mapped through `to_peer`.
  Status map(Connection* to_peer, int peer, const WindowRecord& theirs,
             std::shared_ptr<const PeerMapping>* out);

 private:
  std::mutex mu_;
  // By (peer, the allocation's serial there): serials are never reused, so
  // a freed and reallocated peer buffer is never taken for an old mapping.
  std::map<std::pair<int, uint64_t>, std::weak_ptr<const PeerMapping>> live_;
};

// One registration on one rank. Unmaps the peers' ranges when the last
// call that uses it is done.
struct HostWindow {
  HostWindow() = default;
  HostWindow(const HostWindow&) = delete;
  HostWindow& operator=(const HostWindow&) = delete;
  ~HostWindow();
  uint32_t id = 0;        // the same on every rank
  char* local = nullptr;  // this rank's registered range
  size_t bytes = 0;
  std::vector<char*> at;       // every rank's range as mapped here; at[rank] = local
  std::vector<uint64_t> span;  // every rank's range's length
  std::vector<std::shared_ptr<const PeerMapping>> maps;  // the peers' allocations the ranges lie in
  std::function<void()> on_release;  // run by the destructor (then the allocation may be freed)
};
using HostWindows = std::vector<std::shared_ptr<const HostWindow>>;

// What a rank tells the others when it registers: its allocation's memfd
// (ok = 0: it cannot register, and `why` says why: its argument was bad
// (user_error), or mapping a peer's range failed).
struct WindowRecord {
  int32_t ok = 0;
  int32_t user_error = 0;
  int32_t fd = -1;
  int32_t pad = 0;
  uint64_t alloc_bytes = 0;   // the whole allocation, as the peer maps it
  uint64_t offset = 0;        // of the registered range in the allocation
  uint64_t range_bytes = 0;   // the registered range's length
  uint64_t alloc_serial = 0;  // SharedAllocation::serial: which allocation, for PeerMappings
  char why[160] = {};
  void set_failure(const std::string& reason, bool by_user);
};

// How a registration ended, the same on every rank.
struct WindowVerdict {
  enum { kMapped, kRefused, kUnmappable } outcome = kMapped;
  std::string why;  // kRefused: the first bad argument; kUnmappable: the first failed mapping
};

// Collective over `ch` (every rank of a communicator on one host): maps
// every peer's registered range into *w (whose id and local range are set),
// through `mappings` (allocations mapped before are taken from there).
// If any rank's argument was bad, or any mapping failed, every rank unmaps
// what it mapped and *verdict says which and why (a bad argument wins);
// the communicator stays usable either way.
Task window_connect(const Channel& ch, WindowRecord mine, PeerMappings* mappings, HostWindow* w,
                    WindowVerdict* verdict);
// Collective: every rank names the window it deregisters (its id, or
// kNoWindow for a buffer it never registered). If they differ, every rank
// sets *why, naming two ranks that differ, and keeps its windows.
constexpr uint32_t kNoWindow = ~0u;
Task window_disconnect(const Channel& ch, uint32_t id, std::string* why);

// `c`: all_reduce, broadcast, all_gather or reduce_scatter. `otherwise`:
// the tuner's algorithm for the call. Outputs are written with streaming
// stores where the call's buffers on all ranks together reach
// `streaming_min_bytes` (they would not stay in cache, and a plain store
// first reads every line it writes). `moved` counts the bytes this rank
// reads from and writes to peers' windows.
Task window_or(const Channel& ch, HostWindows windows, Coll c, CollArgs a, Task otherwise,
               size_t streaming_min_bytes, std::atomic<uint64_t>* moved);

}  // namespace braid
