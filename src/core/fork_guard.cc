#include "src/core/fork_guard.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <mutex>
#include <vector>

namespace braid {
namespace {

struct Marked {
  int fd;
  dev_t dev;
  ino_t ino;
};

// Taken around fork() (pthread_atfork), so that the child finds the list
// whole; the child then needs no lock (it has one thread).
std::mutex g_mu;
std::vector<Marked>* g_marked = nullptr;  // never freed: read in forked children

void release_in_child() {
  if (g_marked != nullptr && !g_marked->empty()) {
    const int null_fd = open("/dev/null", O_RDWR | O_CLOEXEC);
    for (const Marked& m : *g_marked) {
      struct stat st;
      if (null_fd < 0 || fstat(m.fd, &st) != 0 || st.st_dev != m.dev || st.st_ino != m.ino) continue;
      dup3(null_fd, m.fd, O_CLOEXEC);
    }
    if (null_fd >= 0) close(null_fd);
    g_marked->clear();  // what the child makes itself is its own
  }
  g_mu.unlock();
}

}  // namespace

void guard_socket_from_children(int fd) {
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0) return;
  static std::once_flag hook;
  std::call_once(hook, [] { pthread_atfork([] { g_mu.lock(); }, [] { g_mu.unlock(); }, release_in_child); });
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_marked == nullptr) g_marked = new std::vector<Marked>();
  // A number marked before and made again was closed meanwhile.
  for (Marked& m : *g_marked) {
    if (m.fd != fd) continue;
    m = {fd, st.st_dev, st.st_ino};
    return;
  }
  g_marked->push_back({fd, st.st_dev, st.st_ino});
}

}  // namespace braid
