// The name of a braid_result_t ("BRAID_ERR_REMOTE"), for tools that print
// codes: braid-check's failure lines, bench/fault_times' table.
#pragma once

#include <braid/braid.h>

namespace braid {

inline const char* result_name(braid_result_t r) {
  switch (r) {
    case BRAID_SUCCESS:
      return "BRAID_SUCCESS";
    case BRAID_ERR_INVALID_ARGUMENT:
      return "BRAID_ERR_INVALID_ARGUMENT";
    case BRAID_ERR_INVALID_USAGE:
      return "BRAID_ERR_INVALID_USAGE";
    case BRAID_ERR_SYSTEM:
      return "BRAID_ERR_SYSTEM";
    case BRAID_ERR_INTERNAL:
      return "BRAID_ERR_INTERNAL";
    case BRAID_ERR_REMOTE:
      return "BRAID_ERR_REMOTE";
    case BRAID_ERR_TIMEOUT:
      return "BRAID_ERR_TIMEOUT";
    case BRAID_ERR_ABORTED:
      return "BRAID_ERR_ABORTED";
    case BRAID_ERR_MISMATCH:
      return "BRAID_ERR_MISMATCH";
    case BRAID_ERR_UNSUPPORTED:
      return "BRAID_ERR_UNSUPPORTED";
    case BRAID_ERR_IN_PROGRESS:
      return "BRAID_ERR_IN_PROGRESS";
  }
  return "BRAID_ERR_?";
}

}  // namespace braid
