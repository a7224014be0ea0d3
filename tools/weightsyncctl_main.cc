// weightsyncctl: the operator's command line for a running weightsyncd
// (docs/weightsyncctl.md).
//
//   weightsyncctl status                  engines, GPUs, versions, the update
//   weightsyncctl watch [--until_done]    live progress of the current update
//   weightsyncctl pause [--mode=keep|wait|abort] [ENGINE_ID...]
//   weightsyncctl resume [--allow_dirty] [ENGINE_ID...]
//   weightsyncctl check ENGINE_ID         receipt of an engine's weights now
//
// Text for people; --json for scripts (watch: one object per sample and
// line). Exit status: 0 done; 1 a call failed ("weightsyncctl: CODE:
// message" on stderr) or the update `watch --until_done` followed failed;
// 2 usage. The bearer token of --token_file is sent, never printed.
//
// This file: the flags, their checks and the command line's parsing; the
// commands themselves are in weightsyncctl_commands.cc.
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/channel.h"
#include "common/local_files.h"
#include "common/version.h"
#include "gflags/gflags.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/client_context.h"
#include "tools/weightsyncctl_commands.h"
#include "weightsync/v1/trainer_service.grpc.pb.h"

DEFINE_string(socket, "",
              "Unix socket of the daemon; empty: the daemon's default "
              "($XDG_RUNTIME_DIR/weightsync/weightsyncd.sock, else "
              "/tmp/weightsync-<uid>/weightsyncd.sock)");
DEFINE_string(target, "",
              "gRPC target instead of --socket: unix:PATH or host:port (TCP "
              "is TLS: give --tls_ca, and --token_file)");
DEFINE_string(tls_ca, "", "TCP: PEM file of the CA of the daemon's cert");
DEFINE_string(token_file, "", "TCP: file holding the bearer token");
DEFINE_string(tls_cert, "", "TCP, mutual TLS: PEM file of this client's cert");
DEFINE_string(tls_key, "", "TCP, mutual TLS: PEM file of this client's key");
DEFINE_bool(json, false, "print JSON instead of text (watch: one per line)");
DEFINE_int32(timeout_ms, 15000,
             "deadline for connecting and for each call; pause/resume give "
             "engines 2/3 of it to acknowledge");
DEFINE_int32(interval_ms, 200, "watch: time between two samples");
DEFINE_bool(once, false, "watch: print one sample and exit");
DEFINE_bool(until_done, false,
            "watch: exit when the update followed ends (0 committed, 1 "
            "failed)");
DEFINE_string(mode, "keep",
              "pause: what engines do with requests in flight: keep (freeze, "
              "continue after resume), wait (let them finish) or abort");
DEFINE_bool(allow_dirty, false,
            "resume: also resume engines whose memory is DIRTY");

namespace weightsync {
namespace {

constexpr char kUsage[] =
    R"(usage: weightsyncctl [FLAGS] COMMAND [ARGS]

commands:
  status                      engines (state, version, GPUs), backend and
                              the current or last update
  watch                       progress of the current update: bytes, rate, ETA
        [--interval_ms=200] [--once] [--until_done]
  pause [ENGINE_ID...]        pause engines (all without ids)
        [--mode=keep|wait|abort]
  resume [ENGINE_ID...]       resume engines (all without ids)
        [--allow_dirty]
  check ENGINE_ID             read the engine's memory and print its receipt

flags:
  --socket=PATH               the daemon's Unix socket (default: the daemon's)
  --target=unix:PATH|HOST:PORT  with --tls_ca=PEM --token_file=FILE for TCP
  --json                      JSON for scripts
  --timeout_ms=15000          deadline for connecting and for each call
  --version                   print this tool's version and exit

exit status: 0 ok, 1 a call failed or the watched update failed, 2 usage
)";

constexpr char kProg[] = "weightsyncctl";
int Usage(const std::string& why) {
  std::fprintf(stderr, "%s: %s\n\n%s", kProg, why.c_str(), kUsage);
  return 2;
}
// gflags exits 1 on an unknown flag or a bad value; usage errors here exit
// 2, so the flags are checked first. Returns false (with *why) on the first
// bad one; *help on --help or -h.
bool CheckFlags(int argc, char** argv, bool* help, bool* version,
                std::string* why) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;
    if (arg.size() < 2 || arg[0] != '-') continue;  // an argument
    std::string name = arg.substr(arg[1] == '-' ? 2 : 1);
    if (name == "help" || name == "h") {
      *help = true;
      return true;
    }
    if (name == "version") {
      *version = true;
      return true;
    }
    std::string value;
    const size_t eq = name.find('=');
    const bool has_value = eq != std::string::npos;
    if (has_value) {
      value = name.substr(eq + 1);
      name.resize(eq);
    }
    gflags::CommandLineFlagInfo info;
    if (!gflags::GetCommandLineFlagInfo(name.c_str(), &info)) {
      if (!has_value && absl::StartsWith(name, "no") &&
          gflags::GetCommandLineFlagInfo(name.substr(2).c_str(), &info) &&
          info.type == "bool") {
        continue;  // --nojson
      }
      *why = absl::StrCat("unknown flag --", name);
      return false;
    }
    if (!has_value) {
      if (info.type == "bool") continue;
      if (i + 1 >= argc) {
        *why = absl::StrCat("flag --", name, " needs a value");
        return false;
      }
      value = argv[++i];
    }
    if (name == "flagfile" || name == "fromenv" || name == "tryfromenv") {
      continue;  // gflags reads those itself
    }
    gflags::FlagSaver saver;  // puts every flag back when it goes
    if (gflags::SetCommandLineOption(name.c_str(), value.c_str()).empty()) {
      *why = absl::StrCat("bad value '", value, "' for --", name);
      return false;
    }
  }
  return true;
}

// A flag of one command given to another is a mistake, not a no-op.
bool FlagsFit(const std::string& command, std::string* why) {
  struct Owned {
    const char* flag;
    const char* command;
  };
  for (const Owned& o : {Owned{"interval_ms", "watch"}, Owned{"once", "watch"},
                         Owned{"until_done", "watch"}, Owned{"mode", "pause"},
                         Owned{"allow_dirty", "resume"}}) {
    gflags::CommandLineFlagInfo info;
    gflags::GetCommandLineFlagInfo(o.flag, &info);
    if (command != o.command && info.current_value != info.default_value) {
      *why = absl::StrCat("--", o.flag, " is a flag of '", o.command, "'");
      return false;
    }
  }
  return true;
}
int Main(const std::vector<std::string>& args) {
  if (args.empty()) return Usage("no command given");
  const std::string& command = args[0];
  if (command == "help") {
    std::printf("%s", kUsage);
    return 0;
  }
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (command != "status" && command != "watch" && command != "pause" &&
      command != "resume" && command != "check") {
    return Usage(absl::StrCat("unknown command '", command, "'"));
  }
  std::string why;
  if (!FlagsFit(command, &why)) return Usage(why);
  if ((command == "status" || command == "watch") && !rest.empty()) {
    return Usage(absl::StrCat("'", command, "' takes no arguments"));
  }
  if (command == "check" && rest.size() != 1) {
    return Usage("'check' takes one engine id");
  }
  v1::PauseMode mode = v1::PAUSE_MODE_KEEP;
  if (command == "pause") {
    const std::string m = absl::AsciiStrToLower(FLAGS_mode);
    if (m == "keep") {
      mode = v1::PAUSE_MODE_KEEP;
    } else if (m == "wait") {
      mode = v1::PAUSE_MODE_WAIT;
    } else if (m == "abort") {
      mode = v1::PAUSE_MODE_ABORT;
    } else {
      return Usage(absl::StrCat("--mode is keep, wait or abort, not '",
                                FLAGS_mode, "'"));
    }
  }
  if (FLAGS_timeout_ms <= 0) return Usage("--timeout_ms must be positive");
  if (FLAGS_interval_ms <= 0) return Usage("--interval_ms must be positive");
  if (FLAGS_once && FLAGS_until_done) {
    return Usage("--once and --until_done exclude each other");
  }
  if (!FLAGS_socket.empty() && !FLAGS_target.empty()) {
    return Usage("give --socket or --target, not both");
  }

  ClientOptions options;
  options.target =
      FLAGS_target.empty()
          ? absl::StrCat("unix:", FLAGS_socket.empty() ? DefaultSocketPath()
                                                       : FLAGS_socket)
          : FLAGS_target;
  if (absl::StartsWith(options.target, "/")) {
    options.target = absl::StrCat("unix:", options.target);
  }
  const bool tcp = !absl::StartsWith(options.target, "unix:") &&
                   !absl::StartsWith(options.target, "unix-abstract:");
  if (tcp && FLAGS_tls_ca.empty()) {
    return Usage(
        "a TCP --target needs --tls_ca (weightsyncd's TCP listener "
        "is TLS only)");
  }
  if (!tcp && (!FLAGS_tls_ca.empty() || !FLAGS_token_file.empty())) {
    return Usage("--tls_ca and --token_file are for TCP targets");
  }
  const struct {
    const std::string& path;
    const char* flag;
    std::string* out;
  } files[] = {{FLAGS_tls_ca, "tls_ca", &options.tls_ca_pem},
               {FLAGS_token_file, "token_file", &options.token},
               {FLAGS_tls_cert, "tls_cert", &options.tls_cert_pem},
               {FLAGS_tls_key, "tls_key", &options.tls_key_pem}};
  for (const auto& f : files) {
    if (!f.path.empty() && !ReadTrimmedFile(f.path, f.out)) {
      return Usage(absl::StrCat("can't read --", f.flag, "=", f.path));
    }
  }
  const absl::Duration timeout = absl::Milliseconds(FLAGS_timeout_ms);
  options.call_timeout = timeout;
  options.connect_timeout = timeout;
  if (FLAGS_target.empty()) {
    // gRPC would retry a missing socket until the deadline; say it now.
    const std::string path = options.target.substr(strlen("unix:"));
    struct stat st;
    if (stat(path.c_str(), &st) != 0) {
      return Fail(
          absl::StatusCode::kUnavailable,
          absl::StrCat("no daemon socket at ", path, ": ", std::strerror(errno),
                       " (is weightsyncd running? --socket=PATH)"));
    }
  }
  if (!tcp) {
    // A local daemon accepts at once; a stale socket file would make gRPC
    // retry until the deadline.
    options.connect_timeout = std::min(timeout, absl::Seconds(5));
  }
  auto channel = ConnectChannel(options);
  if (!channel.ok()) {
    return Fail(channel.status().code(),
                std::string(channel.status().message()));
  }
  CtlOptions ctl;
  ctl.json = FLAGS_json;
  ctl.interval = absl::Milliseconds(FLAGS_interval_ms);
  ctl.once = FLAGS_once;
  ctl.until_done = FLAGS_until_done;
  ctl.allow_dirty = FLAGS_allow_dirty;
  ctl.mode = mode;
  return RunCtlCommand(*channel, timeout, ctl, command, rest);
}
}  // namespace
}  // namespace weightsync

int main(int argc, char** argv) {
  gflags::SetUsageMessage(weightsync::kUsage);
  bool help = false;
  bool version = false;
  std::string why;
  if (!weightsync::CheckFlags(argc, argv, &help, &version, &why)) {
    return weightsync::Usage(why);
  }
  if (help) {
    std::printf("%s", weightsync::kUsage);
    return 0;
  }
  if (version) {  // this tool's; `status` shows the daemon's
    std::printf("weightsyncctl version %s\n", weightsync::kVersion);
    return 0;
  }
  // Everything after "--" is an argument (an engine id starting with '-').
  // gflags would move the arguments before it behind those after it.
  int flags_argc = 1;
  while (flags_argc < argc && std::strcmp(argv[flags_argc], "--") != 0) {
    ++flags_argc;
  }
  const std::vector<std::string> tail(argv + std::min(flags_argc + 1, argc),
                                      argv + argc);
  gflags::ParseCommandLineFlags(&flags_argc, &argv, true);
  std::vector<std::string> args(argv + 1, argv + flags_argc);
  args.insert(args.end(), tail.begin(), tail.end());
  return weightsync::Main(args);
}
