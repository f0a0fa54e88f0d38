// One line per event: "braid <host>:<pid> [rank] LEVEL SUBSYS message".
// BRAID_DEBUG=WARN (default) | INFO | TRACE | NONE picks what is printed;
// BRAID_DEBUG_SUBSYS=INIT,COLL,... keeps only those subsystems, ^SHM,TCP drops
// those; BRAID_DEBUG_FILE=path (%h host, %p pid) writes there instead of stderr.
#pragma once

#include <string>

namespace braid {

enum class LogLevel { kNone = 0, kWarn = 1, kInfo = 2, kTrace = 3 };

// The subsystems a line may name (BRAID_DEBUG_SUBSYS selects among them).
#define BRAID_LOG_SUBSYSTEMS "INIT,BOOTSTRAP,TOPO,TUNE,SHM,TCP,CUDA,COLL,P2P,TRACE,DUMP"

LogLevel log_level();
bool log_subsys_enabled(const char* subsys);
void log_message(LogLevel level, const char* subsys, int rank, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));

#define BRAID_LOG(level, subsys, rank, ...)                                     \
  do {                                                                          \
    if (::braid::log_level() >= (level) && ::braid::log_subsys_enabled(subsys)) \
      ::braid::log_message(level, subsys, rank, __VA_ARGS__);                   \
  } while (0)
#define BRAID_WARN(subsys, rank, ...) BRAID_LOG(::braid::LogLevel::kWarn, subsys, rank, __VA_ARGS__)
#define BRAID_INFO(subsys, rank, ...) BRAID_LOG(::braid::LogLevel::kInfo, subsys, rank, __VA_ARGS__)
#define BRAID_TRACE(subsys, rank, ...) BRAID_LOG(::braid::LogLevel::kTrace, subsys, rank, __VA_ARGS__)

// "256 KiB", "16 MiB", "1 GiB", or "1000 B" when not a whole unit: sizes in log lines.
std::string bytes_text(size_t bytes);
// "1.5 s", "600 s": a timeout as people write it.
std::string seconds_text(double seconds);

// "%h" -> host name, "%p" -> pid, "%r" -> rank (when rank >= 0) in a path.
std::string expand_path_pattern(const char* pattern, int rank);

}  // namespace braid
