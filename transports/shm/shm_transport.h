// Shared-memory transport between processes of one host.
//
// Each rank owns one segment holding its doorbell, a failure flag, and one
// receive FIFO per (channel, local peer). A sender writes straight into the
// receiver's FIFO slots, so a message is copied once (or reduced once) on
// its way; small messages are packed several to a slot, so a sender can run
// far ahead of a receiver that is not scheduled. Segments are unlinked as soon as every local peer has mapped
// them, so nothing is left in /dev/shm even if a process dies later.
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
  // Copies into peers' slots of [min_bytes, max_bytes) use streaming stores
  // (kernels::copy_streaming). Worth it at most while sender and receiver
  // run at once on cores of their own: on one 2-core VM a 16-128 KiB
  // broadcast then took 0.5-0.8x the time (the receiver no longer pulls
  // every line out of the sender's cache), while 4 KiB, 512 KiB and more,
  // and any size with ranks sharing cores, ran up to 2x slower.
  void stream_copies(size_t min_bytes, size_t max_bytes);
  // Which of the two is faster depends on the machine (the 2-core VMs of
  // one provider measured both ways), so the communicator measures it:
  // `sender` times one-way slot copies of `bytes` to `peer` on channel 0,
  // plain and streaming alternately, `rounds` of each after a warm-up, a
  // round ending when the peer has copied the message out and answered.
  // The peer calls this with sender = false and only answers. Both must
  // call it at once, before anything else uses the connection. (Peer
  // reads are timed later, as whole collectives: Communicator::
  // probe_peer_reads.) An abort of `bootstrap` (braid_comm_abort during a
  // comm_split) ends the wait.
  struct CopyTimes {
    // Medians, on the sender: `bytes` through a slot with plain and with
    // streaming stores.
    double plain_us = 0, streaming_us = 0;
  };
  Status time_slot_copies(int peer, bool sender, size_t bytes, int rounds, const Bootstrap& bootstrap,
                          Deadline deadline, CopyTimes* out);

  struct Mapping;

 private:
  ShmTransport() = default;
  std::vector<std::unique_ptr<Mapping>> maps_;  // [0] is ours
  std::vector<std::unique_ptr<Connection>> conns_;
  std::vector<int> conn_peer_;
  std::vector<int> conn_channel_;
};

}  // namespace braid
