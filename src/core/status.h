// Errors as values: a code plus a message, cheap when OK. Converted to
// braid_result_t (and a last-error string) at the C boundary.
#pragma once

#include <braid/braid.h>

#include <memory>
#include <string>
#include <utility>

namespace braid {

class Status {
 public:
  Status() = default;
  Status(braid_result_t code, std::string message)
      : rep_(code == BRAID_SUCCESS ? nullptr : std::make_shared<Rep>(Rep{code, std::move(message)})) {}

  static Status ok() { return Status(); }
  static Status invalid_argument(std::string m) { return Status(BRAID_ERR_INVALID_ARGUMENT, std::move(m)); }
  static Status invalid_usage(std::string m) { return Status(BRAID_ERR_INVALID_USAGE, std::move(m)); }
  static Status internal(std::string m) { return Status(BRAID_ERR_INTERNAL, std::move(m)); }
  static Status remote(std::string m) { return Status(BRAID_ERR_REMOTE, std::move(m)); }
  static Status timeout(std::string m) { return Status(BRAID_ERR_TIMEOUT, std::move(m)); }
  static Status aborted(std::string m) { return Status(BRAID_ERR_ABORTED, std::move(m)); }
  static Status unsupported(std::string m) { return Status(BRAID_ERR_UNSUPPORTED, std::move(m)); }
  // An OS call failed: the message gets strerror(err) appended.
  static Status system(std::string m, int err);

  bool is_ok() const { return rep_ == nullptr; }
  explicit operator bool() const { return is_ok(); }
  braid_result_t code() const { return rep_ ? rep_->code : BRAID_SUCCESS; }
  const std::string& message() const;

  // The same error with context in front: "while X: <message>".
  Status with_context(const std::string& context) const;

 private:
  struct Rep {
    braid_result_t code;
    std::string message;
  };
  std::shared_ptr<const Rep> rep_;
};

// Text another process sent (a peer's failure reason), fit to print: each
// byte outside printable ASCII becomes '?', so no escape sequence, line
// break or NUL reaches a log or an error message.
std::string printable_text(const char* data, size_t n);

#define BRAID_RETURN_IF_ERROR(expr)           \
  do {                                        \
    ::braid::Status _braid_st = (expr);       \
    if (!_braid_st.is_ok()) return _braid_st; \
  } while (0)

}  // namespace braid
