#include "src/core/status.h"

#include <cerrno>
#include <cstring>

namespace braid {
namespace {

// The errors a user can fix get the fix with them.
const char* remedy(int err) {
  switch (err) {
    case EMFILE:
      return " (this process's limit on open files: raise it with `ulimit -n`)";
    case ENFILE:
      return " (the system's limit on open files: raise fs.file-max or close files)";
    case EADDRINUSE:
      return " (another process holds this port: pick another one)";
    default:
      return "";
  }
}

}  // namespace

Status Status::system(std::string m, int err) {
  return Status(BRAID_ERR_SYSTEM, m + ": " + std::strerror(err) + remedy(err));
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return rep_ ? rep_->message : kEmpty;
}

Status Status::with_context(const std::string& context) const {
  if (is_ok()) return *this;
  return Status(code(), context + ": " + message());
}

std::string printable_text(const char* data, size_t n) {
  std::string text(data, n);
  for (char& ch : text)
    if (ch < 0x20 || ch > 0x7e) ch = '?';
  return text;
}

}  // namespace braid
