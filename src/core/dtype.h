// Element sizes for the library's own code: inline, where a call to the
// exported braid_dtype_size went through the PLT (dozens per small call).
// For dtypes already checked (check_dtype); braid_dtype_size takes any value.
#pragma once

#include <braid/braid.h>

#include <cstddef>

namespace braid {

inline size_t dtype_size(braid_dtype_t dtype) {
  // static: a plain constexpr local array is rebuilt on the stack per call.
  static constexpr size_t kSizes[BRAID_NUM_DTYPES] = {1, 1, 4, 4, 8, 8, 2, 2, 4, 8};
  const int v = static_cast<int>(dtype);
  return v >= 0 && v < BRAID_NUM_DTYPES ? kSizes[v] : 0;
}

}  // namespace braid
