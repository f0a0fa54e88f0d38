// Number parsing shared by the *_perf binaries and the ceiling: nccl-tests
// sizes accept K, M and G suffixes (powers of 1024).
#pragma once

#include <cstddef>

namespace braid_bench {

// "64", "8K", "32M", "1G" -> bytes; false on anything else or overflow.
bool parse_size(const char* s, size_t* out);
// A base-10 integer within [min, max]; false otherwise.
bool parse_long(const char* s, long min, long max, long* out);

}  // namespace braid_bench
