// Number parsing shared by the *_perf binaries and the ceiling: nccl-tests
// sizes accept K, M and G suffixes (powers of 1024).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace braid_bench {

// The size sweep and timing flags every benchmark takes, spelt as in
// nccl-tests (-b -e -f -i -n -w -c). A benchmark's options derive from it.
// The largest -b, -e or -i: 1 TiB.
constexpr size_t kMaxSweepBytes = size_t{1} << 40;

struct Sweep {
  size_t min_bytes = 8;
  size_t max_bytes = size_t{64} << 20;
  size_t step_factor = 2;  // 0 when stepping by step_bytes
  size_t step_bytes = 0;
  long iters = 20;
  long warmup = 5;
  bool check = true;
  bool saw_factor = false, saw_bytes = false;  // -f, -i given (they exclude each other)
};

// Applies getopt letter `c` with its argument. False, with *why saying what
// is wrong, for a bad value or a letter that is no sweep flag (the callers
// handle their own flags first, so that one is unknown).
bool take_sweep_flag(int c, const char* arg, Sweep* sweep, std::string* why);
// The checks that need every flag (-f with -i, -b above -e): false with the
// flag to blame in *flag and the reason in *why.
bool finish_sweep(Sweep* sweep, std::string* flag, std::string* why);

// "64", "8K", "32M", "1G" -> bytes; false on anything else or overflow.
bool parse_size(const char* s, size_t* out);
// A base-10 integer within [min, max]; false otherwise.
bool parse_long(const char* s, long min, long max, long* out);
// "a,b,,c" -> {"a", "b", "", "c"}: every comma-separated entry, empty ones too.
std::vector<std::string> split_list(const char* s);

}  // namespace braid_bench
