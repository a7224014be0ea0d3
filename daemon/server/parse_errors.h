// Requests that don't parse get a clear answer. gRPC's sync server answers
// a request it can't deserialize (truncated, a wrong wire type, a varint
// over ten bytes, nesting past protobuf's depth limit, invalid UTF-8 in a
// string) with INTERNAL and an empty message, which reads like a daemon
// bug. This server interceptor rewrites exactly that answer, the only
// INTERNAL-with-no-message the daemon sends, into INVALID_ARGUMENT naming
// the method. (Inside a stream, a message that doesn't parse ends the
// stream like a half-close; the chunk streams catch that themselves:
// services.cc, ServeChunkStream.)
#ifndef WEIGHTSYNC_DAEMON_SERVER_PARSE_ERRORS_H_
#define WEIGHTSYNC_DAEMON_SERVER_PARSE_ERRORS_H_

#include <memory>

#include "grpcpp/support/server_interceptor.h"

namespace weightsync {

// For ServerBuilder::experimental().SetInterceptorCreators.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
ParseErrorInterceptorFactory();

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_SERVER_PARSE_ERRORS_H_
