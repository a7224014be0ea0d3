// The daemon's optional configuration file (--config; docs/operations.md,
// "Configuration file"): "name = value" lines naming the daemon's flags,
// '#' comments, blank lines ignored. A flag given on the command line wins
// over the file; an unknown name or a bad value is an error naming the file
// and line, and nothing is applied then.
#ifndef WEIGHTSYNC_DAEMON_CONFIG_FILE_H_
#define WEIGHTSYNC_DAEMON_CONFIG_FILE_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace weightsync {

// The (name, value) settings of a configuration file's text; `path` names
// it in errors.
absl::StatusOr<std::vector<std::pair<std::string, std::string>>>
ParseConfigFile(const std::string& text, const std::string& path);

// Reads `path` and sets every flag it names that the command line left at
// its default. Validates every line (known flag, parsable value) first.
absl::Status ApplyConfigFile(const std::string& path);

// "name = value" lines of every flag defined in `file_suffix` (e.g.
// "daemon/main.cc"), with its current value: the effective configuration.
std::string DumpConfig(const std::string& file_suffix);

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_CONFIG_FILE_H_
