// CopyConvert2D on a real GPU, bit for bit against the CPU reference
// (weightsync::ConvertElements). Needs a GPU: tagged "gpu" and "manual" in
// BUILD, and skips itself where no device is visible.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backends/cuda/gpu_test_util.h"
#include "backends/cuda/scatter.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "weightsync/v1/types.pb.h"

namespace weightsync {
namespace cuda {
namespace {

using gpu_testing::DeviceBuffer;
using gpu_testing::HaveGpu;
using ScatterGpuTest = gpu_testing::GpuStreamTest;

const DType kFloats[] = {v1::FLOAT32, v1::BFLOAT16, v1::FLOAT16};

// Random element bits: half uniformly random patterns (every exponent, NaN,
// inf and subnormals included), half values of realistic magnitude so that
// fp16 conversions see mostly normal numbers. Other dtypes: random bits.
std::vector<uint8_t> RandomElements(DType dtype, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> scale(-20, 12);
  const int64_t size = ElementSize(dtype);
  std::vector<uint8_t> out(static_cast<size_t>(n * size));
  for (int64_t i = 0; i < n; ++i) {
    uint8_t* p = out.data() + i * size;
    if (!IsConvertibleFloat(dtype) || (rng() & 1)) {
      const uint64_t bits = rng();
      std::memcpy(p, &bits, static_cast<size_t>(size));
    } else {
      const float f = std::ldexp(normal(rng), scale(rng));
      ConvertElements(&f, v1::FLOAT32, p, dtype, 1);
    }
  }
  return out;
}

// A block copy: rows x cols elements, strides and offsets in elements of
// the respective side.
struct Block {
  int64_t rows;
  int64_t cols;
  int64_t src_stride;
  int64_t dst_stride;
  int64_t src_offset;
  int64_t dst_offset;
};

std::string Describe(const Block& b, DType from, DType to) {
  return DTypeName(from) + "->" + DTypeName(to) +
         " rows=" + std::to_string(b.rows) + " cols=" + std::to_string(b.cols) +
         " src_stride=" + std::to_string(b.src_stride) +
         " dst_stride=" + std::to_string(b.dst_stride) +
         " src_offset=" + std::to_string(b.src_offset) +
         " dst_offset=" + std::to_string(b.dst_offset);
}

// Copies `b` on the GPU from `src_host` (uploaded whole) and compares the
// whole destination allocation with the CPU reference: the block converted
// by ConvertElements, every byte outside it untouched.
void CheckBlock(cudaStream_t stream, const Block& b, DType from, DType to,
                const std::vector<uint8_t>& src_host) {
  SCOPED_TRACE(Describe(b, from, to));
  const int64_t ss = ElementSize(from);
  const int64_t ds = ElementSize(to);
  const int64_t src_elems = b.src_offset + (b.rows - 1) * b.src_stride + b.cols;
  const int64_t dst_elems =
      b.dst_offset + (b.rows - 1) * b.dst_stride + b.cols + 16;
  ASSERT_LE(src_elems * ss, static_cast<int64_t>(src_host.size()));

  DeviceBuffer src(src_host.size());
  DeviceBuffer dst(static_cast<size_t>(dst_elems * ds));
  ASSERT_NE(src.get(), nullptr);
  ASSERT_NE(dst.get(), nullptr);
  ASSERT_CUDA_OK(cudaMemcpy(src.get(), src_host.data(), src_host.size(),
                            cudaMemcpyHostToDevice));
  ASSERT_CUDA_OK(cudaMemset(dst.get(), 0xA5, dst.bytes()));

  std::vector<uint8_t> expected(dst.bytes(), 0xA5);
  for (int64_t r = 0; r < b.rows; ++r) {
    ConvertElements(
        src_host.data() + (b.src_offset + r * b.src_stride) * ss, from,
        expected.data() + (b.dst_offset + r * b.dst_stride) * ds, to, b.cols);
  }

  ASSERT_CUDA_OK(CopyConvert2D(src.get() + b.src_offset * ss, b.src_stride * ss,
                               from, dst.get() + b.dst_offset * ds,
                               b.dst_stride * ds, to, b.rows, b.cols, stream));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
  std::vector<uint8_t> got(dst.bytes());
  ASSERT_CUDA_OK(
      cudaMemcpy(got.data(), dst.get(), got.size(), cudaMemcpyDeviceToHost));

  if (got == expected) return;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] == expected[i]) continue;
    const int64_t elem = static_cast<int64_t>(i) / ds;
    const int64_t rel = elem - b.dst_offset;
    const int64_t row = rel >= 0 ? rel / b.dst_stride : -1;
    const int64_t col = rel >= 0 ? rel % b.dst_stride : -1;
    uint32_t got_bits = 0, want_bits = 0, src_bits = 0;
    std::memcpy(&got_bits, got.data() + elem * ds, static_cast<size_t>(ds));
    std::memcpy(&want_bits, expected.data() + elem * ds,
                static_cast<size_t>(ds));
    if (row >= 0 && row < b.rows && col < b.cols) {
      std::memcpy(
          &src_bits,
          src_host.data() + (b.src_offset + row * b.src_stride + col) * ss,
          static_cast<size_t>(ss));
    }
    ADD_FAILURE() << "first difference at destination element " << elem
                  << " (row " << row << ", col " << col << "): got 0x"
                  << std::hex << got_bits << ", want 0x" << want_bits
                  << ", source 0x" << src_bits;
    return;
  }
}

// Shapes: contiguous (collapsed to one row), strided sub-blocks (shards),
// odd sizes and offsets, equal and unequal misalignment of the two sides
// (vectorised kernel with head and tail, element-wise kernel), narrow rows.
const Block kBlocks[] = {
    {1, 1, 1, 1, 0, 0},
    {1, 1000003, 1000003, 1000003, 0, 0},
    {1, 1000003, 1000003, 1000003, 3, 11},
    {1, 777, 777, 777, 1, 2},
    {7, 13, 13, 13, 0, 0},
    {7, 13, 13, 13, 5, 5},
    {37, 129, 200, 131, 3, 5},
    {64, 4096, 8192, 4096, 0, 0},
    {64, 4096, 8192, 4096, 4096, 0},
    {33, 1000, 1032, 1024, 8, 16},
    {33, 1000, 1032, 1024, 5, 13},
    {1000, 3, 7, 5, 0, 0},
    {2048, 24, 32, 24, 0, 8},
    {513, 9, 16, 24, 7, 7},
    {3, 70000, 70001, 70003, 1, 0},
    {300, 520, 4096, 520, 0, 0},
    {5, 65536, 65536 + 8, 65536 + 16, 0, 0},
};

TEST_F(ScatterGpuTest, EveryFloatPairMatchesCpuReference) {
  uint64_t seed = 1;
  for (DType from : kFloats) {
    for (DType to : kFloats) {
      for (const Block& b : kBlocks) {
        const int64_t n =
            b.src_offset + (b.rows - 1) * b.src_stride + b.cols + 8;
        CheckBlock(stream_, b, from, to, RandomElements(from, n, seed++));
        if (HasFatalFailure()) return;
      }
    }
  }
}

// Every bf16 and fp16 bit pattern, to every float type, through both the
// vectorised and the element-wise kernel.
TEST_F(ScatterGpuTest, Every16BitPatternMatchesCpuReference) {
  std::vector<uint8_t> all(2 * 65536 + 64);
  for (uint32_t i = 0; i < 65536 + 32; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    std::memcpy(all.data() + 2 * i, &h, 2);
  }
  for (DType from : {v1::BFLOAT16, v1::FLOAT16}) {
    for (DType to : kFloats) {
      CheckBlock(stream_, {1, 65536, 65536, 65536, 0, 0}, from, to, all);
      CheckBlock(stream_, {1, 65536, 65536, 65536, 3, 0}, from, to, all);
      CheckBlock(stream_, {256, 256, 256, 264, 0, 8}, from, to, all);
    }
  }
}

// All 2^32 float32 bit patterns to bfloat16 and float16: proves that the
// kernel's rounding (hardware cvt for fp16, integer code for bf16) and its
// NaN handling equal FloatToBf16 / FloatToHalf everywhere.
TEST_F(ScatterGpuTest, EveryFloat32PatternMatchesCpuReference) {
  constexpr int64_t kChunk = int64_t{1} << 26;
  DeviceBuffer src(kChunk * 4), bf16(kChunk * 2), fp16(kChunk * 2);
  ASSERT_NE(src.get(), nullptr);
  ASSERT_NE(bf16.get(), nullptr);
  ASSERT_NE(fp16.get(), nullptr);
  uint32_t* in = nullptr;
  uint16_t* out = nullptr;
  ASSERT_CUDA_OK(cudaMallocHost(&in, kChunk * 4));
  ASSERT_CUDA_OK(cudaMallocHost(&out, kChunk * 4));
  const int workers = static_cast<int>(
      std::max(2u, std::min(16u, std::thread::hardware_concurrency())));
  int64_t mismatches = 0;
  for (int64_t base = 0; base < (int64_t{1} << 32) && mismatches == 0;
       base += kChunk) {
    for (int64_t i = 0; i < kChunk; ++i)
      in[i] = static_cast<uint32_t>(base + i);
    ASSERT_CUDA_OK(cudaMemcpyAsync(src.get(), in, kChunk * 4,
                                   cudaMemcpyHostToDevice, stream_));
    ASSERT_CUDA_OK(CopyConvert2D(src.get(), 0, v1::FLOAT32, bf16.get(), 0,
                                 v1::BFLOAT16, 1, kChunk, stream_));
    ASSERT_CUDA_OK(CopyConvert2D(src.get(), 0, v1::FLOAT32, fp16.get(), 0,
                                 v1::FLOAT16, 1, kChunk, stream_));
    ASSERT_CUDA_OK(cudaMemcpyAsync(out, bf16.get(), kChunk * 2,
                                   cudaMemcpyDeviceToHost, stream_));
    ASSERT_CUDA_OK(cudaMemcpyAsync(out + kChunk, fp16.get(), kChunk * 2,
                                   cudaMemcpyDeviceToHost, stream_));
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));

    std::vector<int64_t> bad(workers, 0);
    std::vector<int64_t> first_bad(workers, -1);
    std::vector<std::thread> threads;
    for (int w = 0; w < workers; ++w) {
      threads.emplace_back([&, w] {
        constexpr int64_t kBatch = 4096;
        uint16_t want_bf16[kBatch], want_fp16[kBatch];
        const int64_t lo = kChunk / workers * w;
        const int64_t hi =
            w == workers - 1 ? kChunk : kChunk / workers * (w + 1);
        for (int64_t i = lo; i < hi; i += kBatch) {
          const int64_t n = std::min(kBatch, hi - i);
          ConvertElements(in + i, v1::FLOAT32, want_bf16, v1::BFLOAT16, n);
          ConvertElements(in + i, v1::FLOAT32, want_fp16, v1::FLOAT16, n);
          for (int64_t j = 0; j < n; ++j) {
            if (out[i + j] != want_bf16[j] ||
                out[kChunk + i + j] != want_fp16[j]) {
              if (bad[w]++ == 0) first_bad[w] = i + j;
            }
          }
        }
      });
    }
    for (std::thread& t : threads) t.join();
    for (int w = 0; w < workers; ++w) {
      if (bad[w] == 0) continue;
      mismatches += bad[w];
      const int64_t i = first_bad[w];
      uint16_t want_bf16 = 0, want_fp16 = 0;
      ConvertElements(in + i, v1::FLOAT32, &want_bf16, v1::BFLOAT16, 1);
      ConvertElements(in + i, v1::FLOAT32, &want_fp16, v1::FLOAT16, 1);
      ADD_FAILURE() << bad[w] << " mismatches; first at float bits 0x"
                    << std::hex << in[i] << ": bf16 got 0x" << out[i]
                    << " want 0x" << want_bf16 << ", fp16 got 0x"
                    << out[kChunk + i] << " want 0x" << want_fp16;
    }
  }
  cudaFreeHost(in);
  cudaFreeHost(out);
}

TEST_F(ScatterGpuTest, EqualNonFloatDtypesCopy) {
  const Block b = {19, 33, 40, 35, 1, 2};
  for (DType t : {v1::INT8, v1::INT32, v1::INT64, v1::BOOL}) {
    CheckBlock(stream_, b, t, t,
               RandomElements(t, b.src_offset + 18 * b.src_stride + b.cols, 7));
  }
}

// CopyBatchWithSMs: thousands of small copies (aligned and not, one row
// and strided, empty) land exactly where a byte-by-byte host copy puts
// them, and nothing else in the destination changes.
TEST_F(ScatterGpuTest, BatchOfSmallCopiesMatchesHostCopies) {
  constexpr int64_t kBytes = 8 << 20;
  std::mt19937_64 rng(11);
  std::vector<uint8_t> src(kBytes), dst(kBytes, 0xA5);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  DeviceBuffer dsrc(kBytes), ddst(kBytes);
  ASSERT_EQ(cudaMemcpy(dsrc.get(), src.data(), kBytes, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(ddst.get(), dst.data(), kBytes, cudaMemcpyHostToDevice),
            cudaSuccess);
  std::vector<BatchCopy> table;
  std::vector<uint8_t> want = dst;
  int64_t at = 0;  // destinations are disjoint: each copy takes the next span
  for (int i = 0; i < 5000 && at < kBytes - 4096; ++i) {
    const bool aligned = i % 3 != 0;
    const int64_t rows = i % 4 == 0 ? 1 + static_cast<int64_t>(rng() % 5) : 1;
    int64_t width = aligned ? 16 * static_cast<int64_t>(1 + rng() % 24)
                            : static_cast<int64_t>(rng() % 300);
    const int64_t dst_stride = width + (aligned ? 16 : 3);
    const int64_t src_stride = width + 48;
    const int64_t src_at = aligned ? 16 * static_cast<int64_t>(rng() % 1000)
                                   : static_cast<int64_t>(rng() % 16000);
    const int64_t dst_at = aligned ? (at + 15) / 16 * 16 : at + 1;
    table.push_back({dsrc.get() + src_at, ddst.get() + dst_at, width, rows,
                     src_stride, dst_stride});
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(want.data() + dst_at + r * dst_stride,
                  src.data() + src_at + r * src_stride, width);
    }
    at = dst_at + rows * dst_stride;
  }
  DeviceBuffer dtable(table.size() * sizeof(BatchCopy));
  ASSERT_EQ(
      cudaMemcpy(dtable.get(), table.data(), table.size() * sizeof(BatchCopy),
                 cudaMemcpyHostToDevice),
      cudaSuccess);
  ASSERT_EQ(CopyBatchWithSMs(reinterpret_cast<const BatchCopy*>(dtable.get()),
                             table.size(), stream_),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  std::vector<uint8_t> got(kBytes);
  ASSERT_EQ(cudaMemcpy(got.data(), ddst.get(), kBytes, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_TRUE(got == want) << table.size() << " copies";
  EXPECT_EQ(CopyBatchWithSMs(nullptr, 0, stream_), cudaSuccess);
  EXPECT_EQ(CopyBatchWithSMs(nullptr, -1, stream_), cudaErrorInvalidValue);
}

TEST_F(ScatterGpuTest, RejectsWhatItCannotDo) {
  DeviceBuffer buf(1 << 20);
  ASSERT_NE(buf.get(), nullptr);
  uint8_t* p = buf.get();
  // Pairs that are neither equal nor both convertible floats.
  EXPECT_EQ(
      CopyConvert2D(p, 0, v1::FLOAT32, p + 4096, 0, v1::INT32, 1, 4, stream_),
      cudaErrorInvalidValue);
  EXPECT_EQ(
      CopyConvert2D(p, 0, v1::INT8, p + 4096, 0, v1::UINT8, 1, 4, stream_),
      cudaErrorInvalidValue);
  EXPECT_EQ(
      CopyConvert2D(p, 0, v1::FLOAT64, p + 4096, 0, v1::FLOAT32, 1, 4, stream_),
      cudaErrorInvalidValue);
  EXPECT_EQ(CopyConvert2D(p, 0, 0, p + 4096, 0, 0, 1, 4, stream_),
            cudaErrorInvalidValue);
  // Pointers not aligned to their element size.
  EXPECT_EQ(CopyConvert2D(p + 1, 0, v1::BFLOAT16, p + 4096, 0, v1::FLOAT32, 1,
                          4, stream_),
            cudaErrorInvalidValue);
  EXPECT_EQ(CopyConvert2D(p, 0, v1::BFLOAT16, p + 4098, 0, v1::FLOAT32, 1, 4,
                          stream_),
            cudaErrorInvalidValue);
  // Strides shorter than a row, or not a multiple of the element size.
  EXPECT_EQ(CopyConvert2D(p, 6, v1::BFLOAT16, p + 4096, 16, v1::FLOAT32, 2, 4,
                          stream_),
            cudaErrorInvalidValue);
  EXPECT_EQ(CopyConvert2D(p, 9, v1::BFLOAT16, p + 4096, 16, v1::FLOAT32, 2, 4,
                          stream_),
            cudaErrorInvalidValue);
  EXPECT_EQ(
      CopyConvert2D(p, 8, v1::FLOAT32, p + 4096, 8, v1::FLOAT32, 2, 4, stream_),
      cudaErrorInvalidValue);
  EXPECT_EQ(CopyConvert2D(p, 0, v1::FLOAT32, p + 4096, 0, v1::BFLOAT16, -1, 4,
                          stream_),
            cudaErrorInvalidValue);
  // Empty blocks are no-ops, null pointers included.
  EXPECT_EQ(CopyConvert2D(nullptr, 0, v1::FLOAT32, nullptr, 0, v1::BFLOAT16, 0,
                          4, stream_),
            cudaSuccess);
  EXPECT_EQ(CopyConvert2D(nullptr, 0, v1::FLOAT32, nullptr, 0, v1::FLOAT32, 3,
                          0, stream_),
            cudaSuccess);
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
}

TEST(ScatterTest, DTypeSizeMatchesElementSize) {
  for (int t = -1; t <= 20; ++t) {
    EXPECT_EQ(DTypeSize(t), ElementSize(static_cast<DType>(t))) << t;
  }
}

// Not a pass/fail test: prints what a large copy achieves (bytes read plus
// bytes written per second), for the record.
TEST_F(ScatterGpuTest, Throughput) {
  constexpr int64_t kElems = int64_t{1} << 29;  // 1 GiB of bf16
  DeviceBuffer src(kElems * 4), dst(kElems * 4);
  ASSERT_NE(src.get(), nullptr);
  ASSERT_NE(dst.get(), nullptr);
  ASSERT_CUDA_OK(cudaMemset(src.get(), 0x3C, src.bytes()));
  cudaEvent_t start, stop;
  ASSERT_CUDA_OK(cudaEventCreate(&start));
  ASSERT_CUDA_OK(cudaEventCreate(&stop));

  struct Case {
    const char* what;
    DType from, to;
    int64_t rows, cols, src_stride, dst_stride;  // elements
  };
  const int64_t kShardRows = 16384, kShardCols = kElems / kShardRows;
  const Case cases[] = {
      {"bf16->bf16 1 GiB contiguous", v1::BFLOAT16, v1::BFLOAT16, 1, kElems,
       kElems, kElems},
      {"fp32->bf16 1 GiB (bf16) contiguous", v1::FLOAT32, v1::BFLOAT16, 1,
       kElems, kElems, kElems},
      {"bf16->fp32 1 GiB (bf16) contiguous", v1::BFLOAT16, v1::FLOAT32, 1,
       kElems, kElems, kElems},
      {"fp32->fp16 1 GiB (fp16) contiguous", v1::FLOAT32, v1::FLOAT16, 1,
       kElems, kElems, kElems},
      {"bf16->bf16 column shard (half of each row)", v1::BFLOAT16, v1::BFLOAT16,
       kShardRows / 2, kShardCols, 2 * kShardCols, kShardCols},
      {"fp32->bf16 column shard (half of each row)", v1::FLOAT32, v1::BFLOAT16,
       kShardRows / 2, kShardCols, 2 * kShardCols, kShardCols},
      {"fp32->bf16 misaligned (element-wise kernel)", v1::FLOAT32, v1::BFLOAT16,
       1, kElems - 8, kElems, kElems},
  };
  for (const Case& c : cases) {
    const int64_t ss = ElementSize(c.from), ds = ElementSize(c.to);
    const bool misaligned =
        std::string(c.what).find("misaligned") != std::string::npos;
    uint8_t* s = src.get() + (misaligned ? ss : 0);
    uint8_t* d = dst.get() + (misaligned ? 2 * ds : 0);
    auto copy = [&] {
      return CopyConvert2D(s, c.src_stride * ss, c.from, d, c.dst_stride * ds,
                           c.to, c.rows, c.cols, stream_);
    };
    ASSERT_CUDA_OK(copy());  // warm-up
    constexpr int kIters = 10;
    ASSERT_CUDA_OK(cudaEventRecord(start, stream_));
    for (int i = 0; i < kIters; ++i) ASSERT_CUDA_OK(copy());
    ASSERT_CUDA_OK(cudaEventRecord(stop, stream_));
    ASSERT_CUDA_OK(cudaEventSynchronize(stop));
    float ms = 0;
    ASSERT_CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
    const double elems = static_cast<double>(c.rows) * c.cols;
    const double bytes = elems * (ss + ds);
    const double sec = ms / 1e3 / kIters;
    std::printf("%-45s %8.3f ms  %7.1f GB/s (read+write)  %6.1f Gelem/s\n",
                c.what, sec * 1e3, bytes / sec / 1e9, elems / sec / 1e9);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

}  // namespace
}  // namespace cuda
}  // namespace weightsync
