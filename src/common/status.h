// Status and Result<T>: the values expected failures travel in. Bugs are assertions, not Statuses.
// Both are [[nodiscard]]: a failure nobody looks at is a bug; `(void)` marks the rare call whose
// outcome truly does not matter. Reading a Result's value when it holds an error aborts in every
// build (NBOS_CHECK), instead of reading a variant that is not there.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <variant>

#include "common/check.h"

namespace nbos {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,   // the caller sent something malformed
  kUnauthenticated,   // a signature or token did not match
  kPermissionDenied,  // a known caller may not do this (another user's kernel, a quota)
  kNotFound,
  kResourceExhausted,  // over a size or count limit
  kUnavailable,        // a peer or store cannot be reached now
  kInternal,
};

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) {
  return {StatusCode::kInvalidArgument, std::move(m)};
}
inline Status Unauthenticated(std::string m) {
  return {StatusCode::kUnauthenticated, std::move(m)};
}
inline Status PermissionDenied(std::string m) {
  return {StatusCode::kPermissionDenied, std::move(m)};
}
inline Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status ResourceExhausted(std::string m) {
  return {StatusCode::kResourceExhausted, std::move(m)};
}
inline Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

// Either a value or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT: implicit by design
    NBOS_CHECK(!std::get<Status>(v_).ok(), "a Result needs a value or an error, not an ok Status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & {
    CheckHasValue();
    return std::get<T>(v_);
  }
  const T& value() const& {
    CheckHasValue();
    return std::get<T>(v_);
  }
  T&& value() && {
    CheckHasValue();
    return std::get<T>(std::move(v_));
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  void CheckHasValue() const {
    if (__builtin_expect(!ok(), 0)) {
      internal::CheckFailed("ok()", __FILE__, __LINE__,
                            "read a Result that holds an error: " + status().ToString());
    }
  }
  std::variant<T, Status> v_;
};

}  // namespace nbos
