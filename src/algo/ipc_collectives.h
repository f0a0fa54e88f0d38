// Stream-ordered collectives on device memory between the ranks of one host,
// through CUDA IPC windows (transports/cuda/ipc_window.h): copies and
// reduction kernels on each rank's internal stream move the data between
// device buffers and the windows every rank maps; empty messages on the
// channel order the phases, as in the peer-read algorithms over shm.
//
// Each collective runs in chunks of the window's region size, and every
// chunk in two phases, each ending when every rank's stream settled and the
// ranks synchronised: (1) the input is copied into this rank's window;
// (2) the work that reads peers' windows (reduce a slice, copy blocks).
// So a rank overwrites its window only once every peer is done reading it,
// and when an op completes no peer reads this rank's window any more.
#pragma once

#include <memory>
#include <string>

#include "src/algo/collectives.h"
#include "transports/cuda/ipc_window.h"

namespace braid {

struct IpcSetup {
  const CudaDriver* cu = nullptr;
  CUcontext ctx = nullptr;
  size_t region_bytes = 0;
  std::function<void()> wake;              // wakes the engine (CUDA's callback thread calls it)
  std::atomic<uint64_t>* moved = nullptr;  // bytes read from peers' windows
  IpcWindow::GpuPathCheck
      gpu_path_allowed;  // whether to read another GPU's window (unset: the driver decides)
};

// This rank's window, made on the calling thread, not inside an op: making
// it loads kernels and allocates device memory, which may synchronise the
// device, and the thread that drives the engine must not wait for a stream
// that waits for the engine (a stream-ordered send parked on its release
// word). Null with *failure set when it cannot be made.
std::unique_ptr<IpcWindow> make_ipc_window(const IpcSetup& setup, int nranks, int rank, std::string* failure);
// Collective over `ch` (every rank of a communicator on one host): every
// rank offers its window `w` (null: `failure` says why) and maps every
// other's. If any rank cannot, every rank ends with *connected false and
// `why` naming the first such rank and the cause (device collectives then
// go through host staging); the windows made are unmapped in step.
// The caller owns the window and frees it, on its own thread once the op
// is done: freeing device memory waits for the context's streams, and a
// stream may wait for an earlier stream-ordered op that only the engine
// can end, so the thread driving the engine must never free it.
Task ipc_connect(const Channel& ch, IpcSetup setup, IpcWindow* w, std::string failure, bool* connected,
                 std::string* why);
// Collective: unmaps the peers' windows and marks this rank's free to go
// once no peer maps it any more (the caller then frees it, as above; a
// window a peer never answers for stays allocated).
Task ipc_disconnect(const Channel& ch, IpcWindow* w);

// Buffers are device memory of the window's context (sendbuf and recvbuf as
// the C API lays them out; the input never overlaps the output except in the
// canonical in-place layouts).
Task ipc_all_reduce(const Channel& ch, IpcWindow& w, CollArgs a);
Task ipc_broadcast(const Channel& ch, IpcWindow& w, CollArgs a);
Task ipc_reduce(const Channel& ch, IpcWindow& w, CollArgs a);
Task ipc_all_gather(const Channel& ch, IpcWindow& w, CollArgs a);
Task ipc_reduce_scatter(const Channel& ch, IpcWindow& w, CollArgs a);
Task ipc_gather(const Channel& ch, IpcWindow& w, CollArgs a);
Task ipc_scatter(const Channel& ch, IpcWindow& w, CollArgs a);
Task ipc_all_to_all(const Channel& ch, IpcWindow& w, CollArgs a);
// Counts a peer sends that differ from this rank's recvcounts fail the op
// (BRAID_ERR_MISMATCH) on this rank before it moves any data; the others
// fail when they next wait on it (outputs undefined, as for any failed call).
Task ipc_all_to_allv(const Channel& ch, IpcWindow& w, CollArgs a);
// `run` over a copy of the input (in_bytes of it) in `copy` (device
// memory, IpcWindow::scratch): for an input that overlaps the output other
// than in place.
Task ipc_with_input_copy(const Channel& ch, IpcWindow& w, CollArgs a, size_t in_bytes, char* copy,
                         Task (*run)(const Channel&, IpcWindow&, CollArgs));

}  // namespace braid
