// Thin, deadline-bounded helpers over BSD sockets (IPv4 and IPv6).
#pragma once

#include <atomic>

#include <netinet/in.h>
#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "src/core/deadline.h"
#include "src/core/status.h"

namespace braid {

struct SockAddr {
  sockaddr_storage storage{};
  socklen_t len = 0;

  int family() const { return storage.ss_family; }
  uint16_t port() const;
  void set_port(uint16_t port);
  bool is_loopback() const;
  std::string str() const;  // "1.2.3.4:5" or "[::1]:5"
  const sockaddr* sa() const { return reinterpret_cast<const sockaddr*>(&storage); }

  // Packs into / unpacks from a fixed 20-byte wire form (family, port, 16 address bytes).
  static constexpr size_t kWireBytes = 20;
  void to_wire(uint8_t* out) const;
  static Status from_wire(const uint8_t* in, SockAddr* out);
  static Status parse(const std::string& host, uint16_t port, SockAddr* out);  // numeric or resolvable name
};

// The address to listen on: an address of interface `ifname` (exact name or
// prefix) when given, IPv4 first; else a non-loopback IPv4 interface that is
// up, preferring one whose link runs and that is not a virtual bridge
// (docker0, virbr0: up on many hosts, reaching none); else loopback.
Status choose_local_address(const std::string& ifname, SockAddr* out);
// The choice itself, over a list of interface addresses (for the tests).
struct InterfaceAddress {
  std::string name;
  SockAddr addr;
  bool up = false, running = false, loopback = false;
};
Status pick_local_address(const std::vector<InterfaceAddress>& addrs, const std::string& ifname,
                          SockAddr* out);
// The local address the kernel would use to reach `remote` (no packet is sent).
Status local_address_toward(const SockAddr& remote, SockAddr* out);

// A listening, non-blocking socket bound to `addr` (port 0 = any); *bound gets the real port.
Status listen_on(const SockAddr& addr, int backlog, int* fd, SockAddr* bound);
// Connects with retries on refusal until the deadline; returns a blocking-mode fd with TCP_NODELAY.
// `retry_refused` false: a refused connection fails at once (the listener
// is known to have been up, so whoever held it is gone). `stop`, once
// true, ends the wait within 100 ms (BRAID_ERR_ABORTED): a connect whose
// SYNs go unanswered waits for the deadline otherwise.
Status connect_to(const SockAddr& addr, Deadline deadline, int* fd, bool retry_refused = true,
                  const std::atomic<bool>* stop = nullptr);

Status send_all(int fd, const void* buf, size_t len, Deadline deadline);
Status recv_all(int fd, void* buf, size_t len, Deadline deadline);

Status set_nonblocking(int fd, bool nonblocking);
void set_nodelay(int fd);
// Fixes the socket's send and receive buffers at `bytes` each (the kernel
// then stops autotuning them), where net.core.wmem_max and rmem_max allow
// that much; returns false and leaves the socket as it was where they do
// not (a smaller fixed buffer would cap a long, fast link's throughput).
bool set_socket_buffers(int fd, size_t bytes);
// The most set_socket_buffers fixes: the smaller of net.core.rmem_max and
// wmem_max (0 where they cannot be read).
size_t socket_buffer_limit();
void close_fd(int* fd);

}  // namespace braid
