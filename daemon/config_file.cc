#include "daemon/config_file.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "gflags/gflags.h"

namespace weightsync {

absl::StatusOr<std::vector<std::pair<std::string, std::string>>>
ParseConfigFile(const std::string& text, const std::string& path) {
  std::vector<std::pair<std::string, std::string>> out;
  int n = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++n;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    const size_t eq = line.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ":", n, ": expected 'name = value', got '", line, "'"));
    }
    std::string name(absl::StripAsciiWhitespace(line.substr(0, eq)));
    std::string value(absl::StripAsciiWhitespace(line.substr(eq + 1)));
    if (absl::StartsWith(name, "--")) name = name.substr(2);
    // A value may be quoted (to keep leading/trailing spaces or a '#').
    if (value.size() >= 2 && value.front() == '"' && value.back() == '"') {
      value = value.substr(1, value.size() - 2);
    }
    gflags::CommandLineFlagInfo info;
    if (name.empty() || !gflags::GetCommandLineFlagInfo(name.c_str(), &info)) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ":", n, ": unknown setting '", name,
          "' (settings are weightsyncd's flags: weightsyncd --helpshort)"));
    }
    if (name == "config" || name == "flagfile" || name == "dump_config") {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", n, ": '", name,
                       "' can only be given on the command line"));
    }
    out.emplace_back(std::move(name), std::move(value));
  }
  return out;
}

absl::Status ApplyConfigFile(const std::string& path) {
  std::ifstream f(path);
  if (!f) {
    return absl::NotFoundError(absl::StrCat("--config: can't read ", path));
  }
  std::stringstream text;
  text << f.rdbuf();
  auto settings = ParseConfigFile(text.str(), path);
  if (!settings.ok()) return settings.status();
  // Command-line flags win; the rest are checked by a dry run first, so a
  // bad value leaves every flag as it was.
  std::vector<std::pair<std::string, std::string>> apply;
  for (const auto& [name, value] : *settings) {
    gflags::CommandLineFlagInfo info;
    gflags::GetCommandLineFlagInfo(name.c_str(), &info);
    if (info.is_default) apply.emplace_back(name, value);
  }
  for (const auto& [name, value] : apply) {
    gflags::CommandLineFlagInfo info;
    gflags::GetCommandLineFlagInfo(name.c_str(), &info);
    if (gflags::SetCommandLineOption(name.c_str(), value.c_str()).empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": '", value, "' is not a valid value for ", name,
                       " (a ", info.type, ")"));
    }
    // Put it back until every value has proved valid.
    gflags::SetCommandLineOption(name.c_str(), info.current_value.c_str());
  }
  for (const auto& [name, value] : apply) {
    gflags::SetCommandLineOptionWithMode(name.c_str(), value.c_str(),
                                         gflags::SET_FLAGS_VALUE);
  }
  return absl::OkStatus();
}

std::string DumpConfig(const std::string& file_suffix) {
  std::vector<gflags::CommandLineFlagInfo> flags;
  gflags::GetAllFlags(&flags);
  std::string out;
  for (const auto& f : flags) {
    if (!absl::EndsWith(f.filename, file_suffix)) continue;
    if (f.name == "config" || f.name == "dump_config") continue;
    absl::StrAppend(&out, f.name, " = ", f.current_value, "\n");
  }
  return out;
}

}  // namespace weightsync
