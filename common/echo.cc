#include "common/echo.h"

#include "absl/strings/str_cat.h"

namespace weightsync {

std::string Echo(absl::string_view s) {
  std::string out(s.substr(0, kEchoBytes));
  for (char& c : out) {
    if (c < 0x20 || c > 0x7e) c = '?';
  }
  if (s.size() > kEchoBytes)
    absl::StrAppend(&out, "... (", s.size(), " bytes)");
  return out;
}

std::string HalfOpen(int64_t begin, int64_t count) {
  int64_t end;
  if (__builtin_add_overflow(begin, count, &end)) {
    return absl::StrCat("[", begin, ", +", count, ")");
  }
  return absl::StrCat("[", begin, ", ", end, ")");
}

std::string CapMessage(absl::string_view message, size_t max_bytes) {
  if (message.size() <= max_bytes) return std::string(message);
  const std::string tail =
      absl::StrCat("... (", message.size(), " bytes, cut)");
  if (max_bytes <= tail.size())
    return std::string(message.substr(0, max_bytes));
  return absl::StrCat(message.substr(0, max_bytes - tail.size()), tail);
}

}  // namespace weightsync
