// The one place where absl::Status and grpc::Status meet: the RPC edge of
// the daemon and of the clients. Codes map one to one.
#ifndef WEIGHTSYNC_COMMON_GRPC_STATUS_H_
#define WEIGHTSYNC_COMMON_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace weightsync {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace weightsync

#endif  // WEIGHTSYNC_COMMON_GRPC_STATUS_H_
