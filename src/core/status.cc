#include "src/core/status.h"

#include <cstring>

namespace braid {

Status Status::system(std::string m, int err) {
  return Status(BRAID_ERR_SYSTEM, m + ": " + std::strerror(err));
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return rep_ ? rep_->message : kEmpty;
}

Status Status::with_context(const std::string& context) const {
  if (is_ok()) return *this;
  return Status(code(), context + ": " + message());
}

}  // namespace braid
