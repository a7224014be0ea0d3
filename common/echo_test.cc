// How a peer's string is quoted back (Echo), a range it sent (HalfOpen)
// and how long any status message may grow (CapMessage), at each edge.
#include "common/echo.h"

#include <cstdint>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace weightsync {
namespace {

// Printable ASCII is 0x20..0x7e: both ends kept, the bytes just outside
// them (and every byte of 0x80 and up, as a signed char is negative)
// shown as '?'.
TEST(EchoTest, KeepsPrintableAsciiAndMasksEverythingElse) {
  EXPECT_EQ(Echo("abc"), "abc");
  EXPECT_EQ(Echo(" ~"), " ~");
  EXPECT_EQ(Echo(std::string("a\0b", 3)), "a?b");
  EXPECT_EQ(Echo("\x1f\x7f\n\x80\xff"), "?????");
  EXPECT_EQ(Echo(""), "");
}

// kEchoBytes bytes are quoted whole; one more is cut, saying how long the
// string was.
TEST(EchoTest, CutsPastKEchoBytesSayingHowLong) {
  const std::string fits(kEchoBytes, 'x');
  EXPECT_EQ(Echo(fits), fits);
  EXPECT_EQ(Echo(fits + "y"), fits + "... (65 bytes)");
  EXPECT_EQ(Echo(std::string(1000, '\n')),
            std::string(kEchoBytes, '?') + "... (1000 bytes)");
}

TEST(EchoTest, HalfOpenSaysPlusWhereTheEndWouldOverflow) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(HalfOpen(3, 4), "[3, 7)");
  EXPECT_EQ(HalfOpen(-2, 1), "[-2, -1)");
  EXPECT_EQ(HalfOpen(kMax - 1, 1),
            absl::StrCat("[", kMax - 1, ", ", kMax, ")"));
  EXPECT_EQ(HalfOpen(kMax, 1), absl::StrCat("[", kMax, ", +1)"));
}

// A message at the limit is kept; one byte over is cut to exactly the
// limit, ending with its length; a limit too small for that tail keeps
// the message's first max_bytes bytes.
TEST(EchoTest, CapMessageCutsToExactlyTheLimit) {
  const std::string at(100, 'm');
  EXPECT_EQ(CapMessage(at, 100), at);
  const std::string over = CapMessage(at + "n", 100);
  EXPECT_EQ(over.size(), 100u);
  EXPECT_EQ(over, std::string(100 - 20, 'm') + "... (101 bytes, cut)");
  const std::string tail = "... (101 bytes, cut)";  // 20 bytes
  EXPECT_EQ(CapMessage(at + "n", tail.size()), std::string(tail.size(), 'm'));
  EXPECT_EQ(CapMessage(at + "n", tail.size() + 1), std::string(1, 'm') + tail);
  EXPECT_EQ(CapMessage("", 0), "");
}

}  // namespace
}  // namespace weightsync
