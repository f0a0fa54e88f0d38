#include "src/core/logging.h"

#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>

namespace braid {
namespace {

// The host as braid names it: BRAID_HOST_ID when set (simulated hosts), else the host name.
std::string host_name() {
  if (const char* id = std::getenv("BRAID_HOST_ID"); id != nullptr && *id != '\0') return id;
  char host[64] = {0};
  gethostname(host, sizeof(host) - 1);
  return host;
}

// Where lines go and which subsystems print, read once from the environment.
struct LogSettings {
  LogLevel level = LogLevel::kWarn;
  bool exclude = false;        // the set lists subsystems to drop
  std::set<std::string> subs;  // empty with exclude: everything
  int fd = STDERR_FILENO;
  std::string host = host_name();

  LogSettings() {
    const char* v = std::getenv("BRAID_DEBUG");
    if (v == nullptr || *v == '\0' || !strcasecmp(v, "WARN")) {
      level = LogLevel::kWarn;
    } else if (!strcasecmp(v, "INFO")) {
      level = LogLevel::kInfo;
    } else if (!strcasecmp(v, "TRACE")) {
      level = LogLevel::kTrace;
    } else if (!strcasecmp(v, "NONE")) {
      level = LogLevel::kNone;
    } else {
      std::fprintf(stderr,
                   "braid: BRAID_DEBUG='%s' is invalid: expected NONE, WARN, INFO or TRACE; using WARN\n", v);
    }
    exclude = true;
    if (const char* s = std::getenv("BRAID_DEBUG_SUBSYS"); s != nullptr && *s != '\0') parse_subsystems(s);
    if (const char* f = std::getenv("BRAID_DEBUG_FILE"); f != nullptr && *f != '\0') {
      const std::string path = expand_path_pattern(f, -1);
      int opened = open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
      if (opened < 0) {
        std::fprintf(stderr, "braid: BRAID_DEBUG_FILE='%s': cannot open %s: %s; logging to stderr\n", f,
                     path.c_str(), std::strerror(errno));
      } else {
        fd = opened;
      }
    }
  }

  void parse_subsystems(const char* s) {
    std::string list = s;
    exclude = list[0] == '^';
    if (exclude) list.erase(0, 1);
    const std::string known = "," BRAID_LOG_SUBSYSTEMS ",";
    bool all = false, any_known = false;
    size_t start = 0;
    while (start <= list.size()) {
      size_t end = list.find(',', start);
      if (end == std::string::npos) end = list.size();
      std::string name = list.substr(start, end - start);
      for (char& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      if (name == "ALL") {
        all = any_known = true;
      } else if (!name.empty() && known.find("," + name + ",") != std::string::npos) {
        subs.insert(name);
        any_known = true;
      } else if (!name.empty()) {
        std::fprintf(stderr, "braid: BRAID_DEBUG_SUBSYS names an unknown subsystem '%s' (known: %s, ALL)\n",
                     name.c_str(), BRAID_LOG_SUBSYSTEMS);
      }
      start = end + 1;
    }
    if (!any_known) {  // only typos: the default (everything), as the other settings keep theirs
      std::fprintf(stderr, "braid: BRAID_DEBUG_SUBSYS='%s' names no known subsystem; logging all of them\n",
                   s);
      subs.clear();
      exclude = true;
    } else if (all) {  // "ALL" included: everything; "^ALL": nothing
      subs.clear();
      exclude = !exclude;
    }
  }
};

// Read on first use in each process: a child forked before it logs reads the
// environment it was given (the test launcher sets BRAID_DEBUG there).
std::atomic<LogSettings*> g_settings{nullptr};

LogSettings* g_inherited = nullptr;  // the parent's, kept reachable (leak checkers)

void forget_settings_in_child() {
  g_inherited = g_settings.exchange(nullptr);
}

const LogSettings& settings() {
  LogSettings* s = g_settings.load(std::memory_order_acquire);
  if (s != nullptr) return *s;
  static std::once_flag hook;
  std::call_once(hook, [] { pthread_atfork(nullptr, nullptr, forget_settings_in_child); });
  auto* made = new LogSettings();  // lives for the process (and is left behind in a child)
  if (!g_settings.compare_exchange_strong(s, made)) {
    if (made->fd != STDERR_FILENO) close(made->fd);
    delete made;
    return *s;
  }
  return *made;
}

}  // namespace

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g s", s);
  return buf;
}

std::string bytes_text(size_t b) {
  if (b >= (size_t{1} << 30) && b % (size_t{1} << 30) == 0) return std::to_string(b >> 30) + " GiB";
  if (b >= (1u << 20) && b % (1u << 20) == 0) return std::to_string(b >> 20) + " MiB";
  if (b >= 1024 && b % 1024 == 0) return std::to_string(b >> 10) + " KiB";
  return std::to_string(b) + " B";
}

std::string expand_path_pattern(const char* pattern, int rank) {
  std::string out;
  for (const char* p = pattern; *p != '\0'; ++p) {
    if (p[0] == '%' && p[1] == 'h') {
      out += host_name();
      ++p;
    } else if (p[0] == '%' && p[1] == 'p') {
      out += std::to_string(getpid());
      ++p;
    } else if (p[0] == '%' && p[1] == 'r' && rank >= 0) {
      out += std::to_string(rank);
      ++p;
    } else {
      out += *p;
    }
  }
  return out;
}

LogLevel log_level() {
  return settings().level;
}

bool log_subsys_enabled(const char* subsys) {
  const LogSettings& s = settings();
  if (s.subs.empty()) return s.exclude;
  return (s.subs.count(subsys) != 0) != s.exclude;
}

void log_message(LogLevel level, const char* subsys, int rank, const char* fmt, ...) {
  static const char* kNames[] = {"NONE", "WARN", "INFO", "TRACE"};
  const std::string& host = settings().host;
  char body[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(body, sizeof(body), fmt, ap);
  va_end(ap);
  // One event per line, whatever the message holds.
  for (char* c = body; *c != '\0'; ++c) {
    if (*c == '\n' || *c == '\r') *c = ' ';
  }
  // One write per line so lines from many ranks and threads do not interleave.
  char line[1200];
  int n = std::snprintf(line, sizeof(line), "braid %s:%d [%d] %s %s %s\n", host.c_str(),
                        static_cast<int>(getpid()), rank, kNames[static_cast<int>(level)], subsys, body);
  if (n > 0) {
    if (static_cast<size_t>(n) >= sizeof(line)) {
      n = sizeof(line) - 1;
      line[n - 1] = '\n';
    }
    ssize_t ignored = write(settings().fd, line, static_cast<size_t>(n));
    (void)ignored;
  }
}

}  // namespace braid
