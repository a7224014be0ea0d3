// NCCL versions of a transfer group (issue 20): a trainer whose NCCL
// differs from the daemon's in major.minor is refused at Init, since mixed
// versions in one communicator are a known source of hangs. Pure functions
// of the two version codes, so they are tested without a GPU.
#ifndef WEIGHTSYNC_DAEMON_CORE_NCCL_VERSION_H_
#define WEIGHTSYNC_DAEMON_CORE_NCCL_VERSION_H_

#include <string>

#include "absl/status/status.h"

namespace weightsync {

// A version code as ncclGetVersion returns it: major * 10000 + minor * 100
// + patch from NCCL 2.9 on (2.28.9 = 22809), major * 1000 + minor * 100 +
// patch before (2.8.4 = 2804).
struct NcclVersion {
  int major = 0, minor = 0, patch = 0;
};
NcclVersion DecodeNcclVersion(int code);
// "2.28.9"; "unknown" for 0.
std::string NcclVersionString(int code);

// OK if either side is unknown (0: an older trainer, or a daemon without
// NCCL), if both agree in major.minor, or if `allow_mismatch`
// (--allow_nccl_version_mismatch); else FAILED_PRECONDITION naming both
// versions and the flag. A negative code is INVALID_ARGUMENT.
absl::Status CheckNcclVersions(int trainer_code, int daemon_code,
                               bool allow_mismatch);

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_CORE_NCCL_VERSION_H_
