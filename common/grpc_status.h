// The one place where absl::Status and grpc::Status meet: the RPC edge of
// the daemon and of the clients. Codes map one to one.
#ifndef WEIGHTSYNC_COMMON_GRPC_STATUS_H_
#define WEIGHTSYNC_COMMON_GRPC_STATUS_H_

#include <cstddef>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace weightsync {

// The answer's message is cut to kMaxStatusMessageBytes: gRPC carries it in
// a header, and a header over the client's metadata limit (8 KiB by
// default) fails the call with RESOURCE_EXHAUSTED and resets the channel.
inline constexpr size_t kMaxStatusMessageBytes = 2048;
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace weightsync

#endif  // WEIGHTSYNC_COMMON_GRPC_STATUS_H_
