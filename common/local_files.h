// Local paths and files the daemon and its command-line tools agree on.
#ifndef WEIGHTSYNC_COMMON_LOCAL_FILES_H_
#define WEIGHTSYNC_COMMON_LOCAL_FILES_H_

#include <string>

namespace weightsync {

// The daemon's default Unix socket: $XDG_RUNTIME_DIR/weightsync/
// weightsyncd.sock, or /tmp/weightsync-$UID/weightsyncd.sock without
// XDG_RUNTIME_DIR (docs/operations.md, "Socket"). Creates nothing.
std::string DefaultSocketPath();

// The contents of `path` without trailing whitespace (certificates,
// tokens); false if it can't be read.
bool ReadTrimmedFile(const std::string& path, std::string* out);

}  // namespace weightsync

#endif  // WEIGHTSYNC_COMMON_LOCAL_FILES_H_
