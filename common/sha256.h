// SHA-256 (FIPS 180-4), for identities that clients compute too: a
// transfer plan's id is the first 8 bytes of the SHA-256 of its canonical
// text (docs/transfer_plan.md), which Python's hashlib computes at C speed
// (FNV-1a, the id before, cost a Python loop per byte: 1.2 s for a 256-rank
// plan). Not for secrets: nothing here is constant-time.
#ifndef WEIGHTSYNC_COMMON_SHA256_H_
#define WEIGHTSYNC_COMMON_SHA256_H_

#include <array>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace weightsync {

class Sha256 {
 public:
  Sha256();
  void Update(absl::string_view data);
  // The digest of everything updated; the object is spent afterwards.
  std::array<uint8_t, 32> Final();

 private:
  void Block(const uint8_t* p);

  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buffered_ = 0;
  uint64_t length_ = 0;  // bytes
};

// The digest of `data` in lowercase hex.
std::string Sha256Hex(absl::string_view data);

}  // namespace weightsync

#endif  // WEIGHTSYNC_COMMON_SHA256_H_
