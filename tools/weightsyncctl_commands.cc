// weightsyncctl's commands (docs/weightsyncctl.md): status, watch, pause,
// resume and check against a daemon, their text and JSON output. The
// flags and their parsing are in weightsyncctl_main.cc.
#include "tools/weightsyncctl_commands.h"

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
#include "google/protobuf/util/json_util.h"
#include "grpcpp/client_context.h"
#include "weightsync/v1/trainer_service.grpc.pb.h"

namespace weightsync {
namespace {

constexpr char kProg[] = "weightsyncctl";

// The daemon's default socket (daemon/main.cc DefaultSocket), without
// creating its directory.

// ---- Formatting ----

// "ENGINE_READY" -> "READY"; `prefix` stripped when present.
std::string StripPrefix(const std::string& name, absl::string_view prefix) {
  return absl::StartsWith(name, prefix) ? name.substr(prefix.size()) : name;
}

std::string StateName(v1::EngineState state) {
  if (state == v1::ENGINE_STATE_UNSPECIFIED) return "UNSPECIFIED";
  return StripPrefix(v1::EngineState_Name(state), "ENGINE_");
}

std::string BackendName(v1::Backend backend) {
  if (backend == v1::BACKEND_UNSPECIFIED) return "none (no transfer group)";
  return absl::AsciiStrToLower(
      StripPrefix(v1::Backend_Name(backend), "BACKEND_"));
}

std::string ModeName(v1::UpdateMode mode) {
  return absl::AsciiStrToLower(
      StripPrefix(v1::UpdateMode_Name(mode), "UPDATE_MODE_"));
}

constexpr const char* kUnits[] = {"B", "kB", "MB", "GB", "TB", "PB"};

// Decimal units, as the demo and bench print them: "442.6 MB".
std::string HumanBytes(double bytes, int decimals = 1) {
  int unit = 0;
  while (bytes >= 1000 && unit < 5) {
    bytes /= 1000;
    ++unit;
  }
  if (unit == 0) return absl::StrFormat("%.0f B", bytes);
  return absl::StrFormat("%.*f %s", decimals, bytes, kUnits[unit]);
}

// "1.21/2.50 GB": both in the unit of `total`.
std::string BytesOf(int64_t done, int64_t total) {
  double scale = 1;
  int unit = 0;
  while (total / scale >= 1000 && unit < 5) {
    scale *= 1000;
    ++unit;
  }
  if (unit == 0) return absl::StrFormat("%d/%d B", done, total);
  return absl::StrFormat("%.2f/%.2f %s", done / scale, total / scale,
                         kUnits[unit]);
}

std::string Duration(double s) {
  if (s < 10) return absl::StrFormat("%.1fs", s);
  if (s < 60) return absl::StrFormat("%.0fs", s);
  const int64_t total = static_cast<int64_t>(s + 0.5);
  if (total < 3600) return absl::StrFormat("%dm%02ds", total / 60, total % 60);
  return absl::StrFormat("%dh%02dm", total / 3600, total % 3600 / 60);
}

// "GPU-3f0a1b2c-5d6e-..." -> "GPU-3f0a1b2c"; "host" stays.
std::string ShortDevice(const std::string& uuid) {
  if (absl::StartsWith(uuid, "GPU-") && uuid.size() > 12) {
    return uuid.substr(0, 12);
  }
  return uuid.size() > 16 ? uuid.substr(0, 16) : uuid;
}

std::string JsonString(absl::string_view s) {
  std::string out = "\"";
  for (const char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          absl::StrAppendFormat(&out, "\\u%04x", c);
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

// One JSON object on one line: proto field names, enums by name, every
// field (zero values too). 64-bit integers are strings (proto3 JSON).
int PrintJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string out;
  const auto status =
      google::protobuf::util::MessageToJsonString(message, &out, options);
  if (!status.ok()) {
    return Fail(absl::StatusCode::kInternal,
                absl::StrCat("printing JSON: ", status.ToString()));
  }
  std::printf("%s\n", out.c_str());
  return 0;
}

// Columns separated by two spaces; `right` columns are right-aligned.
void PrintTable(const std::vector<std::vector<std::string>>& rows,
                const std::vector<bool>& right) {
  std::vector<size_t> width(rows[0].size(), 0);
  for (const auto& row : rows) {
    for (size_t i = 0; i < row.size(); ++i) {
      width[i] = std::max(width[i], row[i].size());
    }
  }
  for (const auto& row : rows) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i) {
      const bool last = i + 1 == row.size();
      const std::string pad(width[i] - row[i].size(), ' ');
      if (right[i]) {
        line += pad + row[i];
      } else {
        line += row[i] + (last ? "" : pad);
      }
      if (!last) line += "  ";
    }
    std::printf("%s\n", line.c_str());
  }
}

void PrintEngines(
    const google::protobuf::RepeatedPtrField<v1::EngineStatus>& engines) {
  if (engines.empty()) {
    std::printf("no engines registered\n");
    return;
  }
  std::vector<std::vector<std::string>> rows = {{"ENGINE", "STATE", "VERSION",
                                                 "CONNECTED", "PARAMETERS",
                                                 "BYTES", "DEVICES"}};
  for (const v1::EngineStatus& e : engines) {
    std::vector<std::string> devices;
    for (const std::string& d : e.device_uuids()) {
      devices.push_back(ShortDevice(d));
    }
    rows.push_back({e.engine_id(), StateName(e.state()),
                    absl::StrCat(e.version()), e.connected() ? "yes" : "no",
                    absl::StrCat(e.parameters()), HumanBytes(e.bytes()),
                    devices.empty() ? "-" : absl::StrJoin(devices, ",")});
  }
  PrintTable(rows, {false, false, true, false, true, true, false});
}

bool InProgress(const v1::GetStatusResponse& status) {
  return status.has_update() && status.update().phase() != "committed" &&
         status.update().phase() != "failed";
}

double Percent(const v1::UpdateStatus& u) {
  return u.total_bytes() > 0 ? 100.0 * u.received_bytes() / u.total_bytes() : 0;
}

// ---- Commands ----

class Ctl {
 public:
  Ctl(std::shared_ptr<grpc::Channel> channel, absl::Duration timeout,
      const CtlOptions& options)
      : stub_(v1::TrainerService::NewStub(channel)),
        timeout_(timeout),
        options_(options) {}

  int Status();
  int Watch();
  int Pause(const std::vector<std::string>& ids, v1::PauseMode mode);
  int Resume(const std::vector<std::string>& ids);
  int Check(const std::string& id);

 private:
  std::unique_ptr<grpc::ClientContext> Context() const {
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
    return context;
  }
  grpc::Status GetStatus(v1::GetStatusResponse* response) const {
    return stub_->GetStatus(Context().get(), v1::GetStatusRequest(), response);
  }
  // Engines get 2/3 of our deadline to acknowledge, so that the daemon's
  // answer (naming an engine that did not) arrives before we give up.
  int64_t NoticeTimeoutMs() const {
    return std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout_) * 2 / 3);
  }

  std::unique_ptr<v1::TrainerService::Stub> stub_;
  const absl::Duration timeout_;
  const CtlOptions options_;
};

int Ctl::Status() {
  v1::GetStatusResponse status;
  const grpc::Status s = GetStatus(&status);
  if (!s.ok()) return Fail(s);
  if (options_.json) return PrintJson(status);
  std::printf("backend: %s", BackendName(status.backend()).c_str());
  if (!status.version().empty()) {
    std::printf("   version: %s", status.version().c_str());
  }
  if (!status.build_info().empty()) {
    std::printf("   build: %s", status.build_info().c_str());
  }
  std::printf("\n\n");
  PrintEngines(status.engines());
  std::printf("\n");
  if (!status.has_update()) {
    std::printf("update: none since the daemon started\n");
    return 0;
  }
  const v1::UpdateStatus& u = status.update();
  std::printf("%s update: %s  version %" PRId64 "  %s  %s\n",
              InProgress(status) ? "current" : "last", u.update_id().c_str(),
              u.target_version(), ModeName(u.mode()).c_str(),
              u.phase().c_str());
  if (u.phase() == "failed" && u.received_chunks() == 0) {
    // Once a failed update has ended, the daemon keeps no count of what it
    // received.
    std::printf("  total %s, %" PRId64 " chunks",
                HumanBytes(u.total_bytes(), 2).c_str(), u.total_chunks());
  } else {
    std::printf("  received %s (%.1f%%), %" PRId64 "/%" PRId64 " chunks",
                BytesOf(u.received_bytes(), u.total_bytes()).c_str(),
                Percent(u), u.received_chunks(), u.total_chunks());
  }
  if (!u.engine_ids().empty()) {
    std::printf("; engines %s", absl::StrJoin(u.engine_ids(), ", ").c_str());
  }
  std::printf("\n");
  if (!u.error().empty()) std::printf("  error: %s\n", u.error().c_str());
  return 0;
}

// Follows GetStatus every --interval_ms. The update followed is the one in
// progress, or one that started (and maybe ended) between two samples: any
// update other than the last one of the first sample.
class Watcher {
 public:
  Watcher(bool tty, bool json) : tty_(tty), json_(json) {}

  // Takes one sample; returns true when the followed update just ended
  // (*failed tells how).
  bool Sample(const v1::GetStatusResponse& status, absl::Time now,
              bool* failed) {
    const bool has = status.has_update();
    const v1::UpdateStatus& u = status.update();
    const std::string key =
        has ? absl::StrCat(u.update_id(), "\n", u.target_version()) : "";
    const std::string state = absl::StrCat(key, "\n", u.phase());
    if (first_) {
      first_ = false;
      initial_ = state;
    }
    const bool in_progress = InProgress(status);
    if (in_progress) {
      // A retry may reuse the id and version of an update that failed.
      if (reported_ == key) reported_.clear();
      if (key != last_key_) samples_.clear();
      samples_.push_back({now, u.received_bytes()});
      while (samples_.size() > 2 && now - samples_[1].time >= kWindow) {
        samples_.pop_front();
      }
      last_key_ = key;
      last_bytes_ = u.received_bytes();
    } else {
      samples_.clear();
    }
    Rate(&rate_, &eta_, u);
    const bool ended =
        has && !in_progress && state != initial_ && reported_ != key;
    if (ended) reported_ = key;
    *failed = ended && u.phase() == "failed";
    if (json_) {
      PrintSample(status, now, in_progress, ended, Received(u, key));
    } else if (ended) {
      Draw(FinalLine(u, key), "", /*final=*/true);
    } else if (in_progress) {
      Draw(ProgressLine(u),
           absl::StrCat(key, "\n", u.phase(), "\n", u.received_bytes()), false);
    } else {
      const std::string line = IdleLine(status);
      Draw(line, line, false);
    }
    return ended;
  }

  // --once: ends the line a TTY draw left open.
  void Finish() {
    if (open_) std::printf("\n");
    open_ = false;
    std::fflush(stdout);
  }

 private:
  struct Point {
    absl::Time time;
    int64_t bytes;
  };
  static constexpr absl::Duration kWindow = absl::Seconds(2);

  // Bytes per second over the samples of the last 2 s (< 0: not known
  // yet); ETA = bytes left / rate (< 0: not known, or stalled).
  void Rate(double* rate, double* eta, const v1::UpdateStatus& u) const {
    *rate = *eta = -1;
    if (samples_.size() < 2) return;
    const double dt =
        absl::ToDoubleSeconds(samples_.back().time - samples_.front().time);
    if (dt <= 0) return;
    *rate = (samples_.back().bytes - samples_.front().bytes) / dt;
    if (*rate > 0) {
      *eta = std::max<double>(0, u.total_bytes() - u.received_bytes()) / *rate;
    }
  }

  std::string Title(const v1::UpdateStatus& u) const {
    return absl::StrCat("update ", u.update_id(), " v", u.target_version(), " ",
                        u.phase());
  }

  std::string ProgressLine(const v1::UpdateStatus& u) const {
    const double pct = Percent(u);
    const int fill = static_cast<int>(kBar * std::min(pct, 100.0) / 100);
    return absl::StrCat(Title(u), "  [", std::string(fill, '#'),
                        std::string(kBar - fill, '.'), "]  ",
                        absl::StrFormat("%5.1f%%", pct), "  ",
                        BytesOf(u.received_bytes(), u.total_bytes()), "  ",
                        rate_ < 0 ? "-- B/s" : HumanBytes(rate_) + "/s",
                        "  ETA ", eta_ < 0 ? "--" : Duration(eta_));
  }

  std::string FinalLine(const v1::UpdateStatus& u,
                        const std::string& key) const {
    if (u.phase() == "committed") {
      return absl::StrCat(Title(u), "  ", HumanBytes(u.total_bytes()), "  ",
                          u.total_chunks(), " chunks  engines ",
                          absl::StrJoin(u.engine_ids(), ", "));
    }
    return absl::StrCat(Title(u), " after ",
                        BytesOf(Received(u, key), u.total_bytes()), ": ",
                        u.error().empty() ? "(no reason)" : u.error());
  }

  // A failed update's status no longer counts what it received (0): our
  // last sample of it does.
  int64_t Received(const v1::UpdateStatus& u, const std::string& key) const {
    if (u.phase() != "failed" || key != last_key_) return u.received_bytes();
    return std::max(u.received_bytes(), last_bytes_);
  }

  std::string IdleLine(const v1::GetStatusResponse& status) const {
    if (!status.has_update()) return "no update in progress (last: none)";
    const v1::UpdateStatus& u = status.update();
    return absl::StrCat("no update in progress (last: ", u.update_id(), " v",
                        u.target_version(), " ", u.phase(), ")");
  }

  // A TTY gets one line redrawn in place (carriage return, erase to the
  // end); a pipe gets a line each time `change` (what the line shows, less
  // rate and ETA) differs from the last one's, and every final line.
  void Draw(std::string line, const std::string& change, bool final) {
    if (!tty_) {
      if (change != printed_ || final) std::printf("%s\n", line.c_str());
      printed_ = final ? "" : change;
      std::fflush(stdout);
      return;
    }
    const size_t cols = Columns();
    if (cols > 1 && line.size() >= cols) line.resize(cols - 1);
    std::printf("\r%s\x1b[K%s", line.c_str(), final ? "\n" : "");
    open_ = !final;
    std::fflush(stdout);
  }

  static size_t Columns() {
    struct winsize ws;
    if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) {
      return ws.ws_col;
    }
    return 0;
  }

  void PrintSample(const v1::GetStatusResponse& status, absl::Time now,
                   bool in_progress, bool done, int64_t bytes) const {
    const v1::UpdateStatus& u = status.update();
    // A run-time format: snprintf (absl::StrFormat wants it at compile
    // time under clang, which the coverage build uses).
    const auto number = [](double v, const char* format) {
      if (v < 0) return std::string("null");
      char buf[64];
      std::snprintf(buf, sizeof(buf), format, v);
      return std::string(buf);
    };
    std::printf(
        "{\"t\":%.3f,\"in_progress\":%s,\"done\":%s,\"update_id\":%s,"
        "\"target_version\":%" PRId64
        ",\"mode\":%s,\"phase\":%s,\"bytes\":%" PRId64 ",\"total\":%" PRId64
        ",\"chunks\":%" PRId64 ",\"total_chunks\":%" PRId64
        ",\"rate_bytes_per_s\":%s,\"eta_s\":%s,\"error\":%s}\n",
        absl::ToDoubleSeconds(now - absl::UnixEpoch()),
        in_progress ? "true" : "false", done ? "true" : "false",
        JsonString(u.update_id()).c_str(), u.target_version(),
        JsonString(status.has_update() ? ModeName(u.mode()) : "").c_str(),
        JsonString(status.has_update() ? u.phase() : "none").c_str(), bytes,
        u.total_bytes(), u.received_chunks(), u.total_chunks(),
        number(in_progress ? rate_ : -1, "%.0f").c_str(),
        number(in_progress ? eta_ : -1, "%.3f").c_str(),
        JsonString(u.error()).c_str());
    std::fflush(stdout);
  }

  static constexpr int kBar = 20;
  const bool tty_;
  const bool json_;
  bool first_ = true;
  std::string initial_;        // update key and phase of the first sample
  std::string reported_;       // key of the update whose end was printed
  std::deque<Point> samples_;  // of update last_key_ while in progress
  std::string last_key_;       // last update seen in progress
  int64_t last_bytes_ = 0;     // its bytes then
  double rate_ = -1, eta_ = -1;
  std::string printed_;  // `change` of the last line printed (not a TTY)
  bool open_ = false;    // a TTY line without its newline yet
};

int Ctl::Watch() {
  Watcher watcher(isatty(STDOUT_FILENO) == 1, options_.json);
  const absl::Duration interval = options_.interval;
  while (true) {
    const absl::Time t = absl::Now();
    v1::GetStatusResponse status;
    const grpc::Status s = GetStatus(&status);
    if (!s.ok()) {
      watcher.Finish();
      return Fail(s);
    }
    bool failed = false;
    const bool ended = watcher.Sample(status, absl::Now(), &failed);
    if (options_.once) {
      watcher.Finish();
      return 0;
    }
    if (ended && options_.until_done) {
      watcher.Finish();
      return failed ? 1 : 0;
    }
    absl::SleepFor(interval - (absl::Now() - t));
  }
}

int Ctl::Pause(const std::vector<std::string>& ids, v1::PauseMode mode) {
  v1::PauseRequest request;
  request.set_mode(mode);
  request.set_timeout_ms(NoticeTimeoutMs());
  for (const std::string& id : ids) request.add_engine_ids(id);
  v1::PauseResponse response;
  const grpc::Status s = stub_->Pause(Context().get(), request, &response);
  if (!s.ok()) return Fail(s);
  if (options_.json) return PrintJson(response);
  PrintEngines(response.engines());
  return 0;
}

int Ctl::Resume(const std::vector<std::string>& ids) {
  v1::ResumeRequest request;
  request.set_allow_dirty(options_.allow_dirty);
  request.set_timeout_ms(NoticeTimeoutMs());
  for (const std::string& id : ids) request.add_engine_ids(id);
  v1::ResumeResponse response;
  const grpc::Status s = stub_->Resume(Context().get(), request, &response);
  if (!s.ok()) return Fail(s);
  if (options_.json) return PrintJson(response);
  PrintEngines(response.engines());
  return 0;
}

int Ctl::Check(const std::string& id) {
  v1::CheckEngineRequest request;
  request.set_engine_id(id);
  v1::CheckEngineResponse response;
  const grpc::Status s =
      stub_->CheckEngine(Context().get(), request, &response);
  if (!s.ok()) return Fail(s);
  if (options_.json) return PrintJson(response);
  const v1::Receipt& r = response.receipt();
  std::printf("engine %s v%" PRId64 " %s receipt 0x%016" PRIx64 " (%" PRId64
              " parameters, %s, read in %.2f s)\n",
              response.engine_id().c_str(), response.version(),
              StateName(response.state()).c_str(), r.checksum(), r.parameters(),
              HumanBytes(r.bytes()).c_str(), response.seconds());
  return 0;
}

// ---- Command line ----

}  // namespace

int Fail(absl::StatusCode code, const std::string& message) {
  std::fprintf(stderr, "%s: %s: %s\n", kProg,
               absl::StatusCodeToString(code).c_str(), message.c_str());
  return 1;
}

int Fail(const grpc::Status& status) {
  return Fail(static_cast<absl::StatusCode>(status.error_code()),
              status.error_message());
}

int RunCtlCommand(std::shared_ptr<grpc::Channel> channel,
                  absl::Duration timeout, const CtlOptions& options,
                  const std::string& command,
                  const std::vector<std::string>& args) {
  Ctl ctl(std::move(channel), timeout, options);
  if (command == "status") return ctl.Status();
  if (command == "watch") return ctl.Watch();
  if (command == "pause") return ctl.Pause(args, options.mode);
  if (command == "resume") return ctl.Resume(args);
  return ctl.Check(args[0]);
}

}  // namespace weightsync
