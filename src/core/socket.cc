#include "src/core/socket.h"

#include "src/core/fork_guard.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <thread>

namespace braid {

uint16_t SockAddr::port() const {
  if (family() == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&storage)->sin_port);
  if (family() == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_port);
  return 0;
}

void SockAddr::set_port(uint16_t port) {
  if (family() == AF_INET) reinterpret_cast<sockaddr_in*>(&storage)->sin_port = htons(port);
  if (family() == AF_INET6) reinterpret_cast<sockaddr_in6*>(&storage)->sin6_port = htons(port);
}

bool SockAddr::is_loopback() const {
  if (family() == AF_INET)
    return (ntohl(reinterpret_cast<const sockaddr_in*>(&storage)->sin_addr.s_addr) >> 24) == 127;
  if (family() == AF_INET6)
    return IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_addr);
  return false;
}

std::string SockAddr::str() const {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (family() == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&storage)->sin_addr, buf, sizeof(buf));
    return std::string(buf) + ":" + std::to_string(port());
  }
  if (family() == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_addr, buf, sizeof(buf));
    return "[" + std::string(buf) + "]:" + std::to_string(port());
  }
  return "<no address>";
}

void SockAddr::to_wire(uint8_t* out) const {
  std::memset(out, 0, kWireBytes);
  uint16_t fam = static_cast<uint16_t>(family());
  uint16_t p = port();
  std::memcpy(out, &fam, 2);
  std::memcpy(out + 2, &p, 2);
  if (family() == AF_INET) std::memcpy(out + 4, &reinterpret_cast<const sockaddr_in*>(&storage)->sin_addr, 4);
  if (family() == AF_INET6)
    std::memcpy(out + 4, &reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_addr, 16);
}

Status SockAddr::from_wire(const uint8_t* in, SockAddr* out) {
  uint16_t fam = 0, p = 0;
  std::memcpy(&fam, in, 2);
  std::memcpy(&p, in + 2, 2);
  SockAddr a;
  if (fam == AF_INET) {
    auto* s = reinterpret_cast<sockaddr_in*>(&a.storage);
    s->sin_family = AF_INET;
    std::memcpy(&s->sin_addr, in + 4, 4);
    a.len = sizeof(sockaddr_in);
  } else if (fam == AF_INET6) {
    auto* s = reinterpret_cast<sockaddr_in6*>(&a.storage);
    s->sin6_family = AF_INET6;
    std::memcpy(&s->sin6_addr, in + 4, 16);
    a.len = sizeof(sockaddr_in6);
  } else {
    return Status::invalid_argument("address has unknown family " + std::to_string(fam));
  }
  a.set_port(p);
  *out = a;
  return Status::ok();
}

Status SockAddr::parse(const std::string& host, uint16_t port, SockAddr* out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr)
    return Status::invalid_argument("cannot resolve host '" + host + "': " + gai_strerror(rc));
  SockAddr a;
  std::memcpy(&a.storage, res->ai_addr, res->ai_addrlen);
  a.len = res->ai_addrlen;
  freeaddrinfo(res);
  a.set_port(port);
  *out = a;
  return Status::ok();
}

namespace {

// Bridges that are up without carrying traffic to other hosts (a Docker or
// libvirt host's): NCCL skips them too.
bool virtual_bridge(const std::string& name) {
  for (const char* prefix : {"docker", "virbr", "veth", "br-"})
    if (name.rfind(prefix, 0) == 0) return true;
  return false;
}

bool ipv6_link_local(const SockAddr& a) {
  if (a.family() != AF_INET6) return false;
  const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&a.storage);
  return IN6_IS_ADDR_LINKLOCAL(&in6->sin6_addr);
}

}  // namespace

Status pick_local_address(const std::vector<InterfaceAddress>& addrs, const std::string& ifname,
                          SockAddr* out) {
  // The best by rank, the first of equals: a named interface's IPv4, then
  // global IPv6, then link-local IPv6 (its scope does not travel); unnamed,
  // non-loopback IPv4 on a running link that is not a virtual bridge, then
  // a running bridge or one without carrier, then loopback.
  int best = -1;
  const InterfaceAddress* chosen = nullptr;
  for (const InterfaceAddress& i : addrs) {
    const int fam = i.addr.family();
    if (!i.up || (fam != AF_INET && fam != AF_INET6)) continue;
    int rank;
    if (!ifname.empty()) {
      if (i.name.compare(0, ifname.size(), ifname) != 0) continue;
      rank = fam == AF_INET ? 3 : ipv6_link_local(i.addr) ? 1 : 2;
    } else if (fam != AF_INET) {
      continue;
    } else if (i.loopback || i.addr.is_loopback()) {
      rank = 1;
    } else {
      rank = 2 + (i.running ? 2 : 0) + (virtual_bridge(i.name) ? 0 : 1);
    }
    if (rank > best) {
      best = rank;
      chosen = &i;
    }
  }
  if (chosen == nullptr) {
    if (!ifname.empty())
      return Status::invalid_argument("BRAID_SOCKET_IFNAME='" + ifname + "' matches no interface that is up");
    return Status::system("no usable network interface (not even loopback)", ENODEV);
  }
  *out = chosen->addr;
  if (ifname.empty()) out->set_port(0);
  return Status::ok();
}

Status choose_local_address(const std::string& ifname, SockAddr* out) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return Status::system("getifaddrs", errno);
  std::vector<InterfaceAddress> addrs;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr) continue;
    const int fam = i->ifa_addr->sa_family;
    if (fam != AF_INET && fam != AF_INET6) continue;
    InterfaceAddress a;
    a.name = i->ifa_name;
    a.addr.len = fam == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    std::memcpy(&a.addr.storage, i->ifa_addr, a.addr.len);
    a.up = (i->ifa_flags & IFF_UP) != 0;
    a.running = (i->ifa_flags & IFF_RUNNING) != 0;
    a.loopback = (i->ifa_flags & IFF_LOOPBACK) != 0;
    addrs.push_back(std::move(a));
  }
  freeifaddrs(list);
  return pick_local_address(addrs, ifname, out);
}

Status local_address_toward(const SockAddr& remote, SockAddr* out) {
  int fd = socket(remote.family(), SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status::system("socket", errno);
  SockAddr target = remote;
  if (target.port() == 0) target.set_port(9);
  if (connect(fd, target.sa(), target.len) != 0) {
    int err = errno;
    close(fd);
    return Status::system("finding the interface toward " + remote.str(), err);
  }
  SockAddr local;
  local.len = sizeof(local.storage);
  getsockname(fd, reinterpret_cast<sockaddr*>(&local.storage), &local.len);
  close(fd);
  local.set_port(0);
  *out = local;
  return Status::ok();
}

Status set_nonblocking(int fd, bool nonblocking) {
  int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0) return Status::system("fcntl(F_GETFL)", errno);
  flags = nonblocking ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK);
  if (fcntl(fd, F_SETFL, flags) < 0) return Status::system("fcntl(F_SETFL)", errno);
  return Status::ok();
}

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

namespace {

// A sysctl holding one number (0 where it cannot be read).
size_t read_sysctl(const char* path) {
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return 0;
  unsigned long long v = 0;
  if (std::fscanf(f, "%llu", &v) != 1) v = 0;
  std::fclose(f);
  return static_cast<size_t>(v);
}

}  // namespace

size_t socket_buffer_limit() {
  static const size_t limit =
      std::min(read_sysctl("/proc/sys/net/core/rmem_max"), read_sysctl("/proc/sys/net/core/wmem_max"));
  return limit;
}

bool set_socket_buffers(int fd, size_t bytes) {
  if (bytes == 0 || bytes > socket_buffer_limit() || bytes > static_cast<size_t>(INT_MAX)) return false;
  const int v = static_cast<int>(bytes);
  return setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, sizeof(v)) == 0 &&
         setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &v, sizeof(v)) == 0;
}

void close_fd(int* fd) {
  if (*fd >= 0) close(*fd);
  *fd = -1;
}

Status listen_on(const SockAddr& addr, int backlog, int* fd_out, SockAddr* bound) {
  int fd = socket(addr.family(), SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status::system("socket", errno);
  guard_socket_from_children(fd);  // at once: a fork may come while it binds
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, addr.sa(), addr.len) != 0) {
    int err = errno;
    close(fd);
    if (err == EADDRINUSE)
      return Status(BRAID_ERR_SYSTEM,
                    "cannot listen on " + addr.str() +
                        ": port in use; choose another port or stop the process holding it");
    return Status::system("bind to " + addr.str(), err);
  }
  if (listen(fd, backlog) != 0) {
    int err = errno;
    close(fd);
    return Status::system("listen on " + addr.str(), err);
  }
  SockAddr b;
  b.len = sizeof(b.storage);
  getsockname(fd, reinterpret_cast<sockaddr*>(&b.storage), &b.len);
  Status st = set_nonblocking(fd, true);
  if (!st) {
    close(fd);
    return st;
  }
  *fd_out = fd;
  *bound = b;
  return Status::ok();
}

namespace {

Status stopped(const char* what) {
  return Status::aborted(std::string("stopped while ") + what);
}

Status wait_fd(int fd, short events, Deadline deadline, const char* what, const std::atomic<bool>* stop) {
  for (;;) {
    if (stop != nullptr && stop->load()) return stopped(what);
    pollfd p{fd, events, 0};
    int rc = poll(&p, 1, deadline.remaining_ms(100));
    if (rc > 0) return Status::ok();
    if (rc < 0 && errno != EINTR) return Status::system(std::string("poll while ") + what, errno);
    if (deadline.expired()) return Status::timeout(std::string("timed out while ") + what);
  }
}

}  // namespace

Status connect_to(const SockAddr& addr, Deadline deadline, int* fd_out, bool retry_refused,
                  const std::atomic<bool>* stop) {
  int delay_ms = 1;
  for (;;) {
    int fd = socket(addr.family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return Status::system("socket", errno);
    guard_socket_from_children(fd);  // at once: a fork may come while it connects
    int rc = connect(fd, addr.sa(), addr.len);
    int err = rc == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
      Status st = wait_fd(fd, POLLOUT, deadline, ("connecting to " + addr.str()).c_str(), stop);
      if (!st) {
        close(fd);
        return st;
      }
      socklen_t len = sizeof(err);
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    }
    if (err == 0) {
      set_nodelay(fd);
      Status st = set_nonblocking(fd, false);
      if (!st) {
        close(fd);
        return st;
      }
      *fd_out = fd;
      return Status::ok();
    }
    close(fd);
    if (err == ECONNREFUSED && !retry_refused)
      return Status::remote("connecting to " + addr.str() + ": " + std::strerror(err) +
                            " (nothing listens there any more: the process exited or gave up)");
    // The listener may not be up yet (init_env races rank 0): retry until the deadline.
    if ((err == ECONNREFUSED || err == ETIMEDOUT || err == ECONNRESET) && !deadline.expired()) {
      if (stop != nullptr && stop->load()) return stopped(("connecting to " + addr.str()).c_str());
      std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
      delay_ms = delay_ms < 100 ? delay_ms * 2 : 100;
      continue;
    }
    if (deadline.expired())
      return Status::timeout("timed out connecting to " + addr.str() + ": " + std::strerror(err));
    return Status::system("connecting to " + addr.str(), err);
  }
}

Status send_all(int fd, const void* buf, size_t len, Deadline deadline) {
  const char* p = static_cast<const char*>(buf);
  while (len > 0) {
    ssize_t n = send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      BRAID_RETURN_IF_ERROR(wait_fd(fd, POLLOUT, deadline, "sending", nullptr));
      continue;
    }
    return Status::remote(std::string("send failed: ") + std::strerror(errno));
  }
  return Status::ok();
}

Status recv_all(int fd, void* buf, size_t len, Deadline deadline) {
  char* p = static_cast<char*>(buf);
  while (len > 0) {
    ssize_t n = recv(fd, p, len, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return Status::remote("connection closed by the other side (it exited or gave up)");
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      BRAID_RETURN_IF_ERROR(wait_fd(fd, POLLIN, deadline, "receiving", nullptr));
      continue;
    }
    return Status::remote(std::string("receive failed: ") + std::strerror(errno));
  }
  return Status::ok();
}

}  // namespace braid
