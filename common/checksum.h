// The receipt checksum (docs/protocol.md, "Receipts"): a 64-bit,
// order-independent sum over the elements an update installed, so the
// daemon (after writing) and a trainer client (from what it sent, mapped
// through the engine's segments) compute the same value independently, and
// a GPU can compute it as a parallel reduction. Pure functions.
#ifndef WEIGHTSYNC_COMMON_CHECKSUM_H_
#define WEIGHTSYNC_COMMON_CHECKSUM_H_

#include <cstdint>
#include <cstring>
#include <string>

namespace weightsync {

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// FNV-1a of a parameter's name: its salt.
inline uint64_t ParameterSalt(const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// One element's term: element `index` of the parameter salted `salt`,
// holding `bits` (its raw bytes, little-endian, zero-extended).
inline uint64_t ElementTerm(uint64_t salt, uint64_t index, uint64_t bits) {
  return SplitMix64(((salt + index) * 0x9E3779B97F4A7C15ull) ^ bits);
}

// Raw bits of an element of `size` bytes at `p`.
inline uint64_t ElementBits(const uint8_t* p, int64_t size) {
  uint64_t bits = 0;
  std::memcpy(&bits, p, static_cast<size_t>(size));
  return bits;
}

// Sum of the terms of `n` consecutive elements of `es` bytes at `p`, the
// first being element `index` of the parameter salted `salt`.
template <int kSize>
inline uint64_t RunTermsOf(uint64_t salt, uint64_t index, const uint8_t* p,
                           int64_t n) {
  uint64_t sum = 0;
  for (int64_t k = 0; k < n; ++k) {
    uint64_t bits = 0;
    std::memcpy(&bits, p + k * kSize, kSize);  // fixed size: a plain load
    sum += ElementTerm(salt, index + k, bits);
  }
  return sum;
}

inline uint64_t RunTerms(uint64_t salt, uint64_t index, const uint8_t* p,
                         int64_t n, int64_t es) {
  switch (es) {
    case 1:
      return RunTermsOf<1>(salt, index, p, n);
    case 2:
      return RunTermsOf<2>(salt, index, p, n);
    case 4:
      return RunTermsOf<4>(salt, index, p, n);
    default:
      return RunTermsOf<8>(salt, index, p, n);
  }
}

}  // namespace weightsync

#endif  // WEIGHTSYNC_COMMON_CHECKSUM_H_
