#include "transports/shm/shared_memory.h"

#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

namespace braid {
namespace {

struct Allocations {
  std::mutex mu;
  std::map<uintptr_t, SharedAllocation> by_base;
  uint64_t next_serial = 1;
};

Allocations& allocations() {
  static Allocations* const a = [] {
    auto* made = new Allocations();  // outlives static destructors
    // A fork while another thread holds the lock must not leave it held in
    // the child. The child's table keeps the parent's allocations (it shares
    // their pages), but not their registrations: those are the parent's
    // communicators', which the child cannot use or destroy, so they would
    // refuse the child's braid_mem_free forever.
    pthread_atfork([] { allocations().mu.lock(); }, [] { allocations().mu.unlock(); },
                   [] {
                     Allocations& mine = allocations();
                     for (auto& entry : mine.by_base) entry.second.registrations = 0;
                     mine.mu.unlock();
                   });
    return made;
  }();
  return *a;
}

size_t page_bytes() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

}  // namespace

Status shared_alloc(size_t bytes, void** out) {
  if (out == nullptr) return Status::invalid_argument("ptr is NULL");
  *out = nullptr;
  if (bytes == 0) return Status::invalid_argument("bytes is 0");
  const size_t page = page_bytes();
  if (bytes > SIZE_MAX - page)
    return Status::invalid_argument("bytes=" + std::to_string(bytes) + " is too large");
  const size_t mapped = (bytes + page - 1) / page * page;
  const int fd = static_cast<int>(syscall(SYS_memfd_create, "braid-shared", MFD_CLOEXEC));
  if (fd < 0) return Status::system("memfd_create for braid_mem_alloc", errno);
  if (ftruncate(fd, static_cast<off_t>(mapped)) != 0) {
    const int err = errno;
    close(fd);
    return Status::system("ftruncate of a " + std::to_string(mapped) + "-byte memfd for braid_mem_alloc",
                          err);
  }
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return Status::system("mmap of " + std::to_string(mapped) + " bytes for braid_mem_alloc", err);
  }
  Allocations& a = allocations();
  std::lock_guard<std::mutex> lock(a.mu);
  a.by_base[reinterpret_cast<uintptr_t>(p)] =
      SharedAllocation{static_cast<char*>(p), mapped, fd, 0, a.next_serial++};
  *out = p;
  return Status::ok();
}

Status shared_free(void* ptr) {
  if (ptr == nullptr) return Status::ok();  // as free(NULL)
  SharedAllocation s;
  {
    Allocations& a = allocations();
    std::lock_guard<std::mutex> lock(a.mu);
    auto it = a.by_base.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == a.by_base.end()) {
      char buf[64];
      std::snprintf(buf, sizeof(buf), "%p", ptr);
      return Status::invalid_argument(std::string("ptr ") + buf +
                                      " was not returned by braid_mem_alloc (or was freed already)");
    }
    s = it->second;
    if (s.registrations > 0)
      return Status::invalid_usage("ptr is still registered on " + std::to_string(s.registrations) +
                                   " communicator(s); braid_comm_deregister it (or destroy the communicator) "
                                   "before braid_mem_free");
    a.by_base.erase(it);
  }
  munmap(s.base, s.bytes);
  close(s.fd);
  return Status::ok();
}

void shared_release(char* base) {
  Allocations& a = allocations();
  std::lock_guard<std::mutex> lock(a.mu);
  auto it = a.by_base.find(reinterpret_cast<uintptr_t>(base));
  if (it != a.by_base.end()) --it->second.registrations;
}

bool retain_shared(const void* ptr, size_t bytes, SharedAllocation* out) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  Allocations& a = allocations();
  std::lock_guard<std::mutex> lock(a.mu);
  auto it = a.by_base.upper_bound(p);
  if (it == a.by_base.begin()) return false;
  --it;
  SharedAllocation& s = it->second;
  if (p - it->first > s.bytes || bytes > s.bytes - (p - it->first)) return false;
  ++s.registrations;
  *out = s;
  return true;
}

Status map_peer_allocation(int pidfd, int fd, size_t bytes, char** out) {
#ifdef SYS_pidfd_getfd
  if (pidfd < 0) return Status::unsupported("the peer's pidfd could not be opened");
  const int mine = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd, fd, 0));
  if (mine < 0) return Status::system("pidfd_getfd of the peer's braid_mem_alloc memory", errno);
  // A mapping longer than the file maps; its pages past the end raise
  // SIGBUS when touched. The size is the peer's word: check it.
  struct stat st {};
  if (fstat(mine, &st) != 0) {
    const int err = errno;
    close(mine);
    return Status::system("fstat of a peer's braid_mem_alloc memory", err);
  }
  if (!S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) < bytes) {
    close(mine);
    return Status::internal("the peer's braid_mem_alloc memory (its descriptor " + std::to_string(fd) +
                            ") holds " + std::to_string(st.st_size) + " bytes of a " +
                            (S_ISREG(st.st_mode) ? "memory file" : "file of another kind") +
                            ", where its registration says " + std::to_string(bytes));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, mine, 0);
  const int err = errno;
  close(mine);  // the mapping keeps the memory
  if (p == MAP_FAILED) return Status::system("mmap of a peer's braid_mem_alloc memory", err);
  *out = static_cast<char*>(p);
  return Status::ok();
#else
  (void)pidfd;
  (void)fd;
  (void)bytes;
  (void)out;
  return Status::unsupported("this build has no pidfd_getfd");
#endif
}

}  // namespace braid
