// How a string a peer sent may appear in an error message or a log line:
// bounded and printable, so that no request can make a status message
// outgrow gRPC's metadata limit (which resets the caller's whole channel)
// or write control characters into the daemon's log.
#ifndef WEIGHTSYNC_COMMON_ECHO_H_
#define WEIGHTSYNC_COMMON_ECHO_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace weightsync {

// Bytes of a peer's string that Echo keeps.
inline constexpr size_t kEchoBytes = 64;

// `s` as it may be quoted in a message: its first kEchoBytes bytes with
// anything but printable ASCII shown as '?', and, when cut, "... (N bytes)"
// after them. Echo("abc") == "abc".
std::string Echo(absl::string_view s);

// "[begin, end)" for `count` items from `begin`, as a refusal quotes a
// range a peer sent: "[begin, +count)" when begin + count does not fit in
// 64 bits (no overflow while formatting what was refused).
std::string HalfOpen(int64_t begin, int64_t count);

// `message` cut to at most `max_bytes` (a status message's last line of
// defence: ToGrpcStatus applies it to every answer).
std::string CapMessage(absl::string_view message, size_t max_bytes);

}  // namespace weightsync

#endif  // WEIGHTSYNC_COMMON_ECHO_H_
