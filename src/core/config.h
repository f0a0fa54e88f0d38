// Settings read from BRAID_* environment variables when a communicator is
// made. A bad value is an error that names the variable, never a silent default.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "src/algo/tuner.h"
#include "src/core/status.h"
#include "src/topo/topology.h"

namespace braid {

enum class TransportChoice { kAuto, kShm, kTcp };

struct Config {
  double timeout_s = 600.0;                            // BRAID_TIMEOUT
  TransportChoice transport = TransportChoice::kAuto;  // BRAID_TRANSPORT=auto|shm|tcp
  std::string socket_ifname;                           // BRAID_SOCKET_IFNAME
  std::string host_id;                                 // BRAID_HOST_ID (default: hostname + boot id)
  size_t shm_slot_bytes = 256 * 1024;                  // BRAID_SHM_SLOT_BYTES
  int shm_slots = 4;                                   // BRAID_SHM_SLOTS
  bool shm_peer_reads = true;                          // BRAID_SHM_PEER_READS=0: no process_vm_readv
  size_t peer_read_min_bytes = 256 * 1024;             // BRAID_PEER_READ_MIN_BYTES
  size_t copy_peer_read_min_bytes = 64 * 1024;         // the same for broadcast and all_gather; set by it too
  bool peer_read_min_set = false;                      // BRAID_PEER_READ_MIN_BYTES was set
  bool tune_probe = true;  // BRAID_TUNE_PROBE=0: peer reads priced by the model, not timed at init
  // Copies into shm slots of [min, max) bytes use streaming stores, by
  // default only where every rank of the machine has a core of its own;
  // either variable set applies the band as given.
  size_t shm_stream_min_bytes = 16 * 1024;   // BRAID_SHM_STREAM_MIN_BYTES
  size_t shm_stream_max_bytes = 256 * 1024;  // BRAID_SHM_STREAM_MAX_BYTES (0: never)
  bool shm_stream_set = false;               // either was set
  size_t tcp_slot_bytes = 512 * 1024;        // BRAID_TCP_SLOT_BYTES
  int tcp_slots = 4;                         // BRAID_TCP_SLOTS
  int tcp_sockets = 1;                       // BRAID_TCP_SOCKETS, per peer and channel
  size_t tcp_read_ahead = 4096;              // BRAID_TCP_READ_AHEAD: bytes a short read asks for (0: none)
  // BRAID_TCP_BUFFER_BYTES: each socket's send and receive buffer, fixed
  // where net.core.[rw]mem_max allow it (0: the kernel's autotuning).
  size_t tcp_buffer_bytes = 4u << 20;
  double spin_us = 300.0;               // BRAID_SPIN_US: spin this long before blocking
  AlgoChoice algo;                      // BRAID_ALGO=ring or all_reduce:tree;...
  size_t direct_max_bytes = 32 * 1024;  // BRAID_DIRECT_MAX_BYTES
  // BRAID_WINDOW_MIN_BYTES: the smallest call offered registered windows;
  // unset (SIZE_MAX): 16 KiB, or 128 KiB where ranks share cores.
  size_t window_min_bytes = SIZE_MAX;
  std::string trace_file;                        // BRAID_TRACE_FILE (%r rank, %h host, %p pid)
  double trace_min_wait_us = 20.0;               // BRAID_TRACE_MIN_WAIT_US
  size_t trace_max_events = 4u << 20;            // BRAID_TRACE_MAX_EVENTS
  bool dump_on_signal = true;                    // BRAID_DUMP_SIGNAL=0: no SIGUSR1 handler
  bool check_calls = false;                      // BRAID_CHECK_CALLS=1: compare every call
  bool cuda_ipc = true;                          // BRAID_CUDA_IPC=0: device data through host staging
  size_t cuda_chunk_bytes = 32u << 20;           // BRAID_CUDA_CHUNK_BYTES: each half of the IPC window
  std::optional<topo::P2pLevel> cuda_p2p_level;  // BRAID_CUDA_P2P_LEVEL; unset: the topology's default

  static Status from_env(Config* out);
};

// Helpers shared by the config and by init_env (RANK, WORLD_SIZE, ...).
Status env_int(const char* name, long min, long max, long* value, bool* present);
Status env_double(const char* name, double min, double max, double* value, bool* present);
Status env_size(const char* name, size_t min, size_t max, size_t* value, bool* present);

std::string default_host_id();
// Every BRAID_* environment variable the library reads.
const std::vector<std::string>& known_variables();
// One warning per BRAID_* variable of `env` (NAME=value strings, as in
// environ) that braid does not read but that is two edits or fewer from one
// it does: a misspelt setting would otherwise be ignored without a word.
std::vector<std::string> misspelt_variables(const char* const* env);
// The longest host id ranks exchange (BRAID_HOST_ID is refused beyond it:
// cut short, two hosts' ids could become one).
constexpr size_t kMaxHostIdBytes = 191;
// The machine itself (hostname and boot), whatever namespaces a process is in.
std::string machine_id();

}  // namespace braid
