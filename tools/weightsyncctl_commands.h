// weightsyncctl's commands, apart from its flags and their parsing
// (weightsyncctl_main.cc): each runs against a connected channel with the
// options already checked, prints its text or JSON and returns the exit
// status (0 done; 1 a call failed, "weightsyncctl: CODE: message" on
// stderr, or the update `watch --until_done` followed failed).
// Thread-compatible; one command per process.
#ifndef WEIGHTSYNC_TOOLS_WEIGHTSYNCCTL_COMMANDS_H_
#define WEIGHTSYNC_TOOLS_WEIGHTSYNCCTL_COMMANDS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/support/status.h"
#include "weightsync/v1/trainer_service.pb.h"

namespace weightsync {

// What the flags asked of a command.
struct CtlOptions {
  bool json = false;                                  // JSON instead of text
  absl::Duration interval = absl::Milliseconds(200);  // watch: between samples
  bool once = false;                                  // watch: one sample
  bool until_done = false;                            // watch: until it ends
  bool allow_dirty = false;                           // resume
  v1::PauseMode mode = v1::PAUSE_MODE_KEEP;           // pause
};

// Runs `command` ("status", "watch", "pause", "resume" or "check", its
// arguments checked) with each call's deadline `timeout`.
int RunCtlCommand(std::shared_ptr<grpc::Channel> channel,
                  absl::Duration timeout, const CtlOptions& options,
                  const std::string& command,
                  const std::vector<std::string>& args);

// Prints "weightsyncctl: CODE: message" on stderr; returns 1.
int Fail(absl::StatusCode code, const std::string& message);
int Fail(const grpc::Status& status);

}  // namespace weightsync

#endif  // WEIGHTSYNC_TOOLS_WEIGHTSYNCCTL_COMMANDS_H_
