#include "flags.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdlib>

namespace braid_bench {

bool parse_size(const char* s, size_t* out) {
  if (!std::isdigit(static_cast<unsigned char>(s[0]))) return false;
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s, &end, 10);
  if (errno != 0) return false;
  unsigned shift = 0;
  switch (*end) {
    case '\0':
      break;
    case 'K':
    case 'k':
      shift = 10;
      break;
    case 'M':
    case 'm':
      shift = 20;
      break;
    case 'G':
    case 'g':
      shift = 30;
      break;
    default:
      return false;
  }
  if (*end != '\0' && end[1] != '\0') return false;
  if (v > (static_cast<unsigned long long>(SIZE_MAX) >> shift)) return false;
  *out = static_cast<size_t>(v) << shift;
  return true;
}

bool parse_long(const char* s, long min, long max, long* out) {
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0' || v < min || v > max) return false;
  *out = v;
  return true;
}

bool take_sweep_flag(int c, const char* arg, Sweep* s, std::string* why) {
  auto bad = [&](std::string text) {
    *why = std::move(text);
    return false;
  };
  switch (c) {
    case 'b':
    case 'e': {
      size_t* bytes = c == 'b' ? &s->min_bytes : &s->max_bytes;
      if (!parse_size(arg, bytes)) return bad("invalid size '" + std::string(arg) + "'");
      // Buffers are this plus guard bytes, rounded up to pages: far below
      // where that would wrap.
      if (*bytes > kMaxSweepBytes) return bad("'" + std::string(arg) + "' is above the largest size, 1024G");
      return true;
    }
    case 'f': {
      long v = 0;
      if (!parse_long(arg, 2, 1 << 20, &v)) return bad("the step factor must be an integer >= 2");
      s->step_factor = static_cast<size_t>(v);
      s->saw_factor = true;
      return true;
    }
    case 'i':
      if (!parse_size(arg, &s->step_bytes) || s->step_bytes == 0 || s->step_bytes > kMaxSweepBytes)
        return bad("invalid step size '" + std::string(arg) + "' (must be > 0)");
      s->saw_bytes = true;
      return true;
    case 'n':
      if (!parse_long(arg, 1, 1L << 30, &s->iters)) return bad("iterations must be an integer >= 1");
      return true;
    case 'w':
      if (!parse_long(arg, 0, 1L << 30, &s->warmup)) return bad("warmup must be an integer >= 0");
      return true;
    case 'c': {
      long v = 0;
      if (!parse_long(arg, 0, 1, &v)) return bad("expected 0 or 1");
      s->check = v == 1;
      return true;
    }
    default:
      return bad("unknown flag");
  }
}

bool finish_sweep(Sweep* s, std::string* flag, std::string* why) {
  if (s->saw_factor && s->saw_bytes) {
    *flag = "-i";
    *why = "cannot be combined with -f";
    return false;
  }
  if (s->saw_bytes) s->step_factor = 0;
  if (s->min_bytes > s->max_bytes) {
    *flag = "-b";
    *why = "minbytes is larger than maxbytes (-e)";
    return false;
  }
  return true;
}

std::vector<std::string> split_list(const char* s) {
  const std::string list = s;
  std::vector<std::string> out;
  for (size_t start = 0; start <= list.size();) {
    const size_t end = std::min(list.find(',', start), list.size());
    out.push_back(list.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

}  // namespace braid_bench
