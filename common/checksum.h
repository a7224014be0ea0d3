// The receipt checksum (docs/protocol.md, "Receipts"): a 64-bit,
// order-independent sum over the elements an update installed, so the
// daemon (after writing) and a trainer client (from what it sent, mapped
// through the engine's segments) compute the same value independently, and
// a GPU can compute it as a parallel reduction. Pure functions.
//
// The function (v3), all in 32-bit arithmetic mod 2^32 but the sum:
//   salt(p)    = FNV-1a 64 of p's name; s = lo32(salt) ^ hi32(salt)
//   key(p, i)  = s + lo32(i) * 0x9E3779B1 + hi32(i) * 0x85EBCA77
//   bits32(e)  = lo32(b) ^ hi32(b) * 0x27D4EB2F, b = e's bytes,
//                little-endian, zero-extended to 64 bits
//   mix32(x)   = y ^ (y >> 16), y = x * 0x85EBCA6B
//   term(p, i) = mix32(bits32(p[i]) ^ key(p, i))
//   checksum   = sum of the terms (32-bit values) mod 2^64
// Only 32-bit multiplies, so a GPU computes it at memory speed and a CPU
// vectorises it. mix32 (v3) replaced murmur3's fmix32 finaliser (v2): one
// multiply and one xorshift instead of two and three, because with fmix32
// the GPU receipt kernels were bound by integer operations, not memory;
// both are bijections of 32-bit values, which is what detection rests on.
// Implementations that must agree bit for bit: backends/cuda/kernel_math.h
// (the GPU kernel), client/python/weightsync/receipts.py (numpy, torch) and
// receipts_gpu.py (Triton); tests/vectors/receipts.json holds values
// computed by an independent implementation (tools/receipt_vectors.py).
#ifndef WEIGHTSYNC_COMMON_CHECKSUM_H_
#define WEIGHTSYNC_COMMON_CHECKSUM_H_

#include <cstdint>
#include <cstring>
#include <string>

namespace weightsync {

constexpr uint32_t kReceiptIndexLo = 0x9E3779B1u;
constexpr uint32_t kReceiptIndexHi = 0x85EBCA77u;
constexpr uint32_t kReceiptBitsHi = 0x27D4EB2Fu;
constexpr uint32_t kReceiptMix = 0x85EBCA6Bu;

// FNV-1a of a parameter's name: its salt.
inline uint64_t ParameterSalt(const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// The 32-bit salt the terms use.
inline uint32_t Salt32(uint64_t salt) {
  return static_cast<uint32_t>(salt) ^ static_cast<uint32_t>(salt >> 32);
}

inline uint32_t ReceiptKey(uint32_t salt32, uint64_t index) {
  return salt32 + static_cast<uint32_t>(index) * kReceiptIndexLo +
         static_cast<uint32_t>(index >> 32) * kReceiptIndexHi;
}

inline uint32_t Bits32(uint64_t bits) {
  return static_cast<uint32_t>(bits) ^
         static_cast<uint32_t>(bits >> 32) * kReceiptBitsHi;
}

// The terms' mixing step: a bijection of 32-bit values (an xorshift, an
// odd multiply, an xorshift), so distinct inputs give distinct terms. The
// first xorshift carries the high bits (a float's sign) into the multiply.
inline uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  const uint32_t y = x * kReceiptMix;
  return y ^ (y >> 16);
}

// One element's term: element `index` of the parameter salted `salt`
// (ParameterSalt), holding `bits` (its raw bytes, little-endian,
// zero-extended). A 32-bit value.
inline uint64_t ElementTerm(uint64_t salt, uint64_t index, uint64_t bits) {
  return Mix32(Bits32(bits) ^ ReceiptKey(Salt32(salt), index));
}

// Raw bits of an element of `size` bytes at `p`.
inline uint64_t ElementBits(const uint8_t* p, int64_t size) {
  uint64_t bits = 0;
  std::memcpy(&bits, p, static_cast<size_t>(size));
  return bits;
}

// Sum of the terms of `n` consecutive elements of kSize bytes at `p`, the
// first being element `index` of the parameter salted `salt`.
template <int kSize>
inline uint64_t RunTermsOf(uint64_t salt, uint64_t index, const uint8_t* p,
                           int64_t n) {
  const uint32_t s = Salt32(salt);
  uint64_t sum = 0;
  while (n > 0) {
    // Split where lo32(index) wraps: within a piece hi32(index) is fixed,
    // so key(index + k) = key(index) + k * kReceiptIndexLo and the loop is
    // 32-bit arithmetic only (the compiler vectorises it).
    const uint64_t to_wrap = (uint64_t{1} << 32) - (index & 0xFFFFFFFFull);
    const int64_t m =
        static_cast<uint64_t>(n) < to_wrap ? n : static_cast<int64_t>(to_wrap);
    const uint32_t key0 = ReceiptKey(s, index);
    uint32_t step = 0;
    for (int64_t k = 0; k < m; ++k, step += kReceiptIndexLo) {
      uint32_t x;
      if constexpr (kSize == 8) {
        uint32_t w[2];
        std::memcpy(w, p + k * 8, 8);
        x = w[0] ^ w[1] * kReceiptBitsHi;
      } else if constexpr (kSize == 4) {
        std::memcpy(&x, p + k * 4, 4);
      } else if constexpr (kSize == 2) {
        uint16_t h;
        std::memcpy(&h, p + k * 2, 2);
        x = h;
      } else {
        x = p[k];
      }
      sum += Mix32(x ^ (key0 + step));
    }
    p += m * kSize;
    index += static_cast<uint64_t>(m);
    n -= m;
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
