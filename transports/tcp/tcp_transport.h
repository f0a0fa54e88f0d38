// TCP transport: one non-blocking socket per (peer, channel), messages framed
// with a validated header, staged through a bounded ring of slots on each
// side. Used between hosts, and on one host when BRAID_TRANSPORT=tcp.
#pragma once

#include <memory>
#include <vector>

#include "src/core/bootstrap.h"
#include "src/core/config.h"
#include "transports/connection.h"

namespace braid {

class TcpTransport {
 public:
  // Collective over every rank of the bootstrap; `peers` are the ranks this
  // rank reaches over tcp (the relation is symmetric across ranks).
  static Status setup(Bootstrap& bootstrap, const std::vector<int>& peers, int nchannels,
                      const Config& config, std::unique_ptr<TcpTransport>* out);
  ~TcpTransport();

  Connection* connection(int channel, int peer);

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
