#include "client/channel.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace weightsync {

absl::StatusOr<std::shared_ptr<grpc::Channel>> ConnectChannel(
    const ClientOptions& options) {
  if (options.target.empty()) {
    return absl::InvalidArgumentError("no daemon target given");
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  auto channel = grpc::CreateCustomChannel(
      options.target, grpc::InsecureChannelCredentials(), args);
  if (!channel->WaitForConnected(
          absl::ToChronoTime(absl::Now() + options.connect_timeout))) {
    return absl::UnavailableError(absl::StrCat(
        "weightsyncd is not reachable at ", options.target, " within ",
        absl::FormatDuration(options.connect_timeout)));
  }
  return channel;
}

}  // namespace weightsync
