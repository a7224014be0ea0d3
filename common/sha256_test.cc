#include "common/sha256.h"

#include <string>

#include "gtest/gtest.h"

namespace weightsync {
namespace {

// FIPS 180-4's examples (NIST CSRC "Example Algorithms") and the empty
// string: one block, two blocks, the padding's edges.
TEST(Sha256Test, StandardVectors) {
  EXPECT_EQ(Sha256Hex(""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(
      Sha256Hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
      "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(Sha256Hex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

// Any split of the input into Update calls gives the digest of the whole,
// across every length around the block and padding boundaries.
TEST(Sha256Test, UpdatesInPiecesEqualTheWhole) {
  std::string data;
  for (int i = 0; i < 300; ++i) data.push_back(static_cast<char>(i * 7 + 1));
  for (size_t n : {0, 1, 55, 56, 57, 63, 64, 65, 119, 120, 128, 300}) {
    const std::string whole = Sha256Hex(data.substr(0, n));
    for (size_t cut : {size_t{0}, size_t{1}, n / 3, n / 2, n}) {
      if (cut > n) continue;
      Sha256 sha;
      sha.Update(data.substr(0, cut));
      sha.Update(data.substr(cut, n - cut));
      const auto d = sha.Final();
      std::string hex;
      for (uint8_t b : d) {
        static const char* kHex = "0123456789abcdef";
        hex.push_back(kHex[b >> 4]);
        hex.push_back(kHex[b & 15]);
      }
      EXPECT_EQ(hex, whole) << "n=" << n << " cut=" << cut;
    }
  }
}

}  // namespace
}  // namespace weightsync
