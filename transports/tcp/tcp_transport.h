// TCP transport: BRAID_TCP_SOCKETS non-blocking sockets per (peer, channel),
// messages framed with a validated header and dealt to the sockets in turn,
// staged through a bounded ring of slots on each side (or moved straight
// between the socket and the caller's memory where the caller allows). Used between hosts, and on one host
// when BRAID_TRANSPORT=tcp.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "src/core/bootstrap.h"
#include "src/core/config.h"
#include "transports/connection.h"

namespace braid {

class TcpTransport {
 public:
  // Collective over every rank of the bootstrap; `peers` are the ranks this
  // rank reaches over tcp (the relation is symmetric across ranks); `hosts`
  // names every rank's host, for errors.
  static Status setup(Bootstrap& bootstrap, const std::vector<int>& peers,
                      const std::vector<std::string>& hosts, int nchannels, const Config& config,
                      std::unique_ptr<TcpTransport>* out);
  ~TcpTransport();

  Connection* connection(int channel, int peer);
  // Connection::shutdown on every connection at once: their flushes share
  // one bound, so a failing rank takes it once, not once per peer.
  void shutdown(const Status& why);
  // A connection over already connected, non-blocking sockets (which it
  // then owns; the peer must list its ends in the same order): what setup
  // builds, and what the frame fuzzer reads through.
  static std::unique_ptr<Connection> adopt(const std::vector<int>& fds, int peer, const std::string& host,
                                           const Config& config);

 private:
  TcpTransport() = default;
  struct Entry {
    int channel;
    int peer;
    std::unique_ptr<Connection> conn;
  };
  std::vector<Entry> conns_;
};

}  // namespace braid
