// Fp8Divider (fp8_math.h) against the division it replaces, for every
// element and every scale a bfloat16 or float16 source can have: each
// x of the dtype against each positive finite amax of the dtype with
// |x| <= amax (x of both signs, zeros and subnormals included) and +-inf, d =
// Fp8DequantScale(amax), e4m3fn and e5m2. The FP8 byte must be the one
// x / d (an IEEE division here) encodes to, and the quotient itself bit
// for bit x / d wherever it is not tiny (|x / d| >= 2^-24). This is
// the check Fp8Divider's comment relies on; the GPU runs the same
// operations (__fmul_rn, __fmaf_rn).
#include <atomic>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

#include "backends/cuda/fp8_math.h"
#include "gtest/gtest.h"

namespace weightsync {
namespace cuda {
namespace {

struct Tally {
  std::atomic<int64_t> checked{0}, fast{0}, bad_bytes{0}, bad_quotients{0};
  std::atomic<uint32_t> first_bad_x{0}, first_bad_amax{0};
};

float Widen(uint32_t bits, bool bf16) {
  return bf16 ? Fp8FloatOf(bits << 16) : Fp8FloatOf(Fp8HalfBits(bits));
}

// amax bit patterns [lo, hi) of the dtype against every x.
void Sweep(bool bf16, bool e5m2, uint32_t lo, uint32_t hi, Tally* t) {
  const Fp8Format f = Fp8FormatOf(e5m2);
  const uint32_t inf = bf16 ? 0x7F80u : 0x7C00u;
  int64_t checked = 0, fast = 0, bad_bytes = 0, bad_q = 0;
  for (uint32_t ab = lo; ab < hi && ab < inf; ++ab) {
    const float amax = Widen(ab, bf16);
    const float d = Fp8DequantScale(amax, f);
    const Fp8Divider v = Fp8DividerOf(d);
    fast += v.fast;
    // Every x up to amax, and +-inf (which amax skips).
    for (uint32_t xi = 0; xi <= ab + 1; ++xi) {
      const uint32_t xb = xi <= ab ? xi : inf;
      for (uint32_t sign : {0u, 0x8000u}) {
        const float x = Widen(xb | sign, bf16);
        const float want = x / d;
        // +-inf passes as it is, as VecWrite passes it.
        const float got = std::isinf(x) ? x : Fp8Quotient(v, x);
        ++checked;
        const bool byte_ok = Fp8Encode(got, f) == Fp8Encode(want, f);
        const bool tiny = std::fabs(want) < 0x1p-24f;
        const bool q_ok = tiny || Fp8BitsOf(got) == Fp8BitsOf(want);
        if (!byte_ok || !q_ok) {
          if (bad_bytes + bad_q == 0) {
            t->first_bad_x.store(xb | sign);
            t->first_bad_amax.store(ab);
          }
          bad_bytes += !byte_ok;
          bad_q += !q_ok;
        }
      }
    }
  }
  t->checked += checked;
  t->fast += fast;
  t->bad_bytes += bad_bytes;
  t->bad_quotients += bad_q;
}

void Exhaustive(bool bf16, bool e5m2) {
  Tally t;
  const uint32_t inf = bf16 ? 0x7F80u : 0x7C00u;
  // Work grows with amax: interleave the ranges among the threads.
  const unsigned n = std::max(2u, std::thread::hardware_concurrency());
  std::vector<std::thread> threads;
  for (unsigned i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      for (uint32_t lo = 1 + 64 * i; lo < inf; lo += 64 * n) {
        Sweep(bf16, e5m2, lo, lo + 64, &t);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(t.bad_bytes.load(), 0)
      << "first bad: x bits " << std::hex << t.first_bad_x.load()
      << " amax bits " << t.first_bad_amax.load();
  EXPECT_EQ(t.bad_quotients.load(), 0)
      << "first bad: x bits " << std::hex << t.first_bad_x.load()
      << " amax bits " << t.first_bad_amax.load();
  // Every amax swept, each against all x up to it.
  const int64_t amaxes = inf - 1;
  EXPECT_GT(t.checked.load(), amaxes * int64_t{inf});
  // The fast path covers scales in [2^-60, 2^60]: every float16 amax,
  // about half of the bfloat16 ones (the rest divide).
  EXPECT_GT(t.fast.load(), amaxes * 2 / 5);
}

TEST(Fp8DivideTest, EveryBfloat16ElementAndScaleE4m3) {
  Exhaustive(true, false);
}
TEST(Fp8DivideTest, EveryBfloat16ElementAndScaleE5m2) {
  Exhaustive(true, true);
}
TEST(Fp8DivideTest, EveryFloat16ElementAndScaleE4m3) {
  Exhaustive(false, false);
}
TEST(Fp8DivideTest, EveryFloat16ElementAndScaleE5m2) {
  Exhaustive(false, true);
}

// The slow cases: scales outside [2^-60, 2^60] divide.
TEST(Fp8DivideTest, Divider) {
  EXPECT_FALSE(Fp8DividerOf(0x1p-61f).fast);
  EXPECT_FALSE(Fp8DividerOf(0x1p61f).fast);
  EXPECT_FALSE(Fp8DividerOf(0x1p-130f).fast);
  const Fp8Divider v = Fp8DividerOf(0x1.8p-20f);
  EXPECT_TRUE(v.fast);
  EXPECT_EQ(v.y, 1.0f / 0x1.8p-20f);
  EXPECT_EQ(Fp8Quotient(v, 3.0f), 3.0f / 0x1.8p-20f);
  EXPECT_EQ(Fp8Quotient(Fp8DividerOf(0x1p-130f), 0x1p-140f), 0x1p-10f);
  // Signed zeros keep their sign.
  EXPECT_TRUE(std::signbit(Fp8Quotient(v, -0.0f)));
  EXPECT_FALSE(std::signbit(Fp8Quotient(v, 0.0f)));
}

}  // namespace
}  // namespace cuda
}  // namespace weightsync
