// One line per event on stderr: "braid <host>:<pid> [rank] LEVEL SUBSYS message".
// BRAID_DEBUG=WARN (default) | INFO | TRACE | NONE picks what is printed.
#pragma once

namespace braid {

enum class LogLevel { kNone = 0, kWarn = 1, kInfo = 2, kTrace = 3 };

LogLevel log_level();
void log_message(LogLevel level, const char* subsys, int rank, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));

#define BRAID_LOG(level, subsys, rank, ...)                                                      \
  do {                                                                                           \
    if (::braid::log_level() >= (level)) ::braid::log_message(level, subsys, rank, __VA_ARGS__); \
  } while (0)
#define BRAID_WARN(subsys, rank, ...) BRAID_LOG(::braid::LogLevel::kWarn, subsys, rank, __VA_ARGS__)
#define BRAID_INFO(subsys, rank, ...) BRAID_LOG(::braid::LogLevel::kInfo, subsys, rank, __VA_ARGS__)
#define BRAID_TRACE(subsys, rank, ...) BRAID_LOG(::braid::LogLevel::kTrace, subsys, rank, __VA_ARGS__)

}  // namespace braid
