#include "daemon/core/nccl_version.h"

#include "absl/strings/str_cat.h"

namespace weightsync {

NcclVersion DecodeNcclVersion(int code) {
  NcclVersion v;
  if (code >= 10000) {  // NCCL >= 2.9: NCCL_VERSION(X, Y, Z) = X*10000+Y*100+Z
    v.major = code / 10000;
    v.minor = code % 10000 / 100;
  } else {  // before: X*1000 + Y*100 + Z
    v.major = code / 1000;
    v.minor = code % 1000 / 100;
  }
  v.patch = code % 100;
  return v;
}

std::string NcclVersionString(int code) {
  if (code == 0) return "unknown";
  const NcclVersion v = DecodeNcclVersion(code);
  return absl::StrCat(v.major, ".", v.minor, ".", v.patch);
}

absl::Status CheckNcclVersions(int trainer_code, int daemon_code,
                               bool allow_mismatch) {
  if (trainer_code < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nccl_version ", trainer_code,
        " is not an ncclGetVersion code (2.28.9 = 22809; 0: not said)"));
  }
  if (trainer_code == 0 || daemon_code == 0 || allow_mismatch) {
    return absl::OkStatus();
  }
  const NcclVersion t = DecodeNcclVersion(trainer_code);
  const NcclVersion d = DecodeNcclVersion(daemon_code);
  if (t.major == d.major && t.minor == d.minor) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "the trainer's NCCL is ", NcclVersionString(trainer_code),
      ", this daemon's is ", NcclVersionString(daemon_code),
      ": versions that differ in major.minor may hang one communicator; use "
      "the same NCCL on both sides (the trainer's comes from torch's wheel, "
      "the daemon's from the toolkit), or start the daemon with "
      "--allow_nccl_version_mismatch"));
}

}  // namespace weightsync
