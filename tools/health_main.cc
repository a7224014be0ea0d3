// weightsync_health: asks a weightsyncd grpc.health.v1.Health/Check and
// exits 0 only when it answers SERVING. Meant for probes that can't speak
// gRPC over a Unix socket themselves (Kubernetes exec probes, scripts):
//
//   weightsync_health --socket=/run/weightsync/weightsyncd.sock
//
// Exit status: 0 SERVING; 1 NOT_SERVING, unreachable, refused or any other
// answer; 2 bad flags. One line on stdout says which.
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/channel.h"
#include "common/local_files.h"
#include "common/version.h"
#include "gflags/gflags.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/client_context.h"

DEFINE_string(socket, "", "path of the daemon's Unix socket");
DEFINE_string(target, "",
              "gRPC target instead of --socket: unix:PATH or host:port");
DEFINE_string(service, "", "service to ask about (\"\": the whole daemon)");
DEFINE_int32(timeout_ms, 3000, "deadline for connecting and the call");
DEFINE_string(tls_ca, "", "TCP: PEM file of the CA of the daemon's cert");
DEFINE_string(token_file, "", "TCP: file holding the bearer token");

namespace weightsync {
namespace {

int Main() {
  ClientOptions options;
  options.target =
      FLAGS_target.empty() ? absl::StrCat("unix:", FLAGS_socket) : FLAGS_target;
  if (FLAGS_socket.empty() == FLAGS_target.empty() || FLAGS_timeout_ms <= 0) {
    std::fprintf(stderr,
                 "weightsync_health: give one of --socket or --target, and a "
                 "positive --timeout_ms\n");
    return 2;
  }
  if ((!FLAGS_tls_ca.empty() &&
       !ReadTrimmedFile(FLAGS_tls_ca, &options.tls_ca_pem)) ||
      (!FLAGS_token_file.empty() &&
       !ReadTrimmedFile(FLAGS_token_file, &options.token))) {
    std::fprintf(stderr,
                 "weightsync_health: can't read --tls_ca/--token_file\n");
    return 2;
  }
  const absl::Duration timeout = absl::Milliseconds(FLAGS_timeout_ms);
  const absl::Time deadline = absl::Now() + timeout;
  options.connect_timeout = timeout;
  auto channel = ConnectChannel(options);
  if (!channel.ok()) {
    std::printf("UNREACHABLE: %s\n", channel.status().ToString().c_str());
    return 1;
  }
  auto stub = grpc::health::v1::Health::NewStub(*channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(FLAGS_service);
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = stub->Check(&context, request, &response);
  if (!status.ok()) {
    std::printf("ERROR: %d %s\n", static_cast<int>(status.error_code()),
                status.error_message().c_str());
    return 1;
  }
  std::printf("%s\n", grpc::health::v1::HealthCheckResponse::ServingStatus_Name(
                          response.status())
                          .c_str());
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING
             ? 0
             : 1;
}

}  // namespace
}  // namespace weightsync

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "weightsync_health --socket=PATH: exit 0 iff weightsyncd is SERVING");
  gflags::SetVersionString(weightsync::kVersion);
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  return weightsync::Main();
}
