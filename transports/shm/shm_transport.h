// Shared-memory transport between processes of one host.
//
// Each rank owns one segment holding its doorbell, a failure flag, and one
// receive FIFO per (channel, local peer). A sender writes straight into the
// receiver's FIFO slots, so a message is copied once (or reduced once) on
// its way; small messages are packed several to a slot, so a sender can run
// far ahead of a receiver that is not scheduled. Segments are unlinked as soon as every local peer has mapped them,
// so nothing is left in /dev/shm even if a process dies later.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "src/core/bootstrap.h"
#include "src/core/config.h"
#include "src/core/futex.h"
#include "transports/connection.h"

namespace braid {

class ShmTransport {
 public:
  // Collective over every rank of the bootstrap. `host_group` lists the ranks
  // that share this rank's host and talk over shm (sorted, including this
  // rank); a rank alone in its group makes no segment. On failure,
  // *unavailable says that segments could not be made or mapped somewhere
  // (/dev/shm full, limits): every rank of the job then returns an error with
  // *unavailable set, so all can fall back to tcp together.
  static Status setup(Bootstrap& bootstrap, const std::vector<int>& host_group, int nchannels,
                      const Config& config, std::unique_ptr<ShmTransport>* out, bool* unavailable);
  ~ShmTransport();

  // The connection to `peer` (a member of host_group) on `channel`.
  Connection* connection(int channel, int peer);
  // Rung by local peers whenever they post to or release one of our FIFOs.
  Doorbell* doorbell();
  // Tells local peers this rank failed, with the reason they should report.
  void mark_failed(const Status& why);

  struct Mapping;

 private:
  ShmTransport() = default;
  std::vector<std::unique_ptr<Mapping>> maps_;  // [0] is ours
  std::vector<std::unique_ptr<Connection>> conns_;
  std::vector<int> conn_peer_;
  std::vector<int> conn_channel_;
};

}  // namespace braid
