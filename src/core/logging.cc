#include "src/core/logging.h"

#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace braid {

LogLevel log_level() {
  static const LogLevel level = [] {
    const char* v = std::getenv("BRAID_DEBUG");
    if (v == nullptr || *v == '\0' || !strcasecmp(v, "WARN")) return LogLevel::kWarn;
    if (!strcasecmp(v, "INFO")) return LogLevel::kInfo;
    if (!strcasecmp(v, "TRACE")) return LogLevel::kTrace;
    if (!strcasecmp(v, "NONE")) return LogLevel::kNone;
    std::fprintf(stderr,
                 "braid: BRAID_DEBUG='%s' is invalid: expected NONE, WARN, INFO or TRACE; using WARN\n", v);
    return LogLevel::kWarn;
  }();
  return level;
}

void log_message(LogLevel level, const char* subsys, int rank, const char* fmt, ...) {
  static const char* kNames[] = {"NONE", "WARN", "INFO", "TRACE"};
  char host[64] = {0};
  gethostname(host, sizeof(host) - 1);
  char body[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(body, sizeof(body), fmt, ap);
  va_end(ap);
  // One write per line so lines from many ranks do not interleave.
  char line[1200];
  int n = std::snprintf(line, sizeof(line), "braid %s:%d [%d] %s %s %s\n", host, static_cast<int>(getpid()),
                        rank, kNames[static_cast<int>(level)], subsys, body);
  if (n > 0) {
    ssize_t ignored =
        write(STDERR_FILENO, line, static_cast<size_t>(n) < sizeof(line) ? n : sizeof(line) - 1);
    (void)ignored;
  }
}

}  // namespace braid
