// The direct quant kernel (quant_kernels.cu, DirectKernel) run on the CPU
// thread by thread through fp8_math.h's functions, as the kernel runs them:
// for quant_steps_test, which compares what it writes with the host data
// plane. Test only.
#ifndef WEIGHTSYNC_BACKENDS_CUDA_QUANT_DIRECT_EMULATION_H_
#define WEIGHTSYNC_BACKENDS_CUDA_QUANT_DIRECT_EMULATION_H_

#include <array>
#include <cstdint>
#include <vector>

#include "backends/cuda/fp8_math.h"
#include "gtest/gtest.h"

namespace weightsync {
namespace testing {

// One block of a direct job as the kernel runs it, thread by thread:
// `threads` threads holding kPer elements each (or reading the source
// twice where the block is larger).
template <int kDtype, int kPer>
void DirectBlock(const cuda::DirectJob& job, int64_t b, uint32_t threads) {
  const bool held = cuda::DirectHeld(job, b, threads, kPer);
  std::vector<std::array<float, kPer>> v(threads);
  auto regs = [&](uint32_t t) -> float(&)[kPer] {
    return *reinterpret_cast<float(*)[kPer]>(v[t].data());
  };
  float amax = 0.0f;
  for (uint32_t t = 0; t < threads; ++t) {
    const float part =
        held ? cuda::DirectLoadPart<kDtype, kPer>(job, b, t, threads, regs(t))
             : cuda::DirectAmaxStream<kDtype>(job, b, t, threads);
    amax = part > amax ? part : amax;
  }
  for (uint32_t t = 0; t < threads; ++t) {
    if (held) {
      cuda::DirectWritePart<kPer>(job, b, t, threads, amax, regs(t));
    } else {
      cuda::DirectWriteStream<kDtype>(job, b, t, threads, amax);
    }
  }
}

// A batch of direct jobs as the kernel runs it: `grid` thread blocks, each
// taking blocks cta, cta + grid, ... of the batch.
template <int kPer>
void RunDirectBatch(std::vector<cuda::DirectJob> jobs, uint32_t threads,
                    int64_t grid) {
  int64_t total = 0;
  for (cuda::DirectJob& job : jobs) {
    job.first_block = total;
    total += cuda::QuantJobBlocks(job.out);
  }
  for (int64_t cta = 0; cta < grid; ++cta) {
    int j = 0;
    for (int64_t g = cta; g < total; g += grid) {
      j = cuda::DirectJobOf(jobs.data(), static_cast<int>(jobs.size()), g, j);
      const cuda::DirectJob& job = jobs[j];
      const int64_t b = g - job.first_block;
      ASSERT_GE(b, 0);
      ASSERT_LT(b, cuda::QuantJobBlocks(job.out));
      switch (job.src_dtype) {
        case cuda::kFp8SrcFloat32:
          DirectBlock<cuda::kFp8SrcFloat32, kPer>(job, b, threads);
          break;
        case cuda::kFp8SrcBfloat16:
          DirectBlock<cuda::kFp8SrcBfloat16, kPer>(job, b, threads);
          break;
        case cuda::kFp8SrcFloat16:
          DirectBlock<cuda::kFp8SrcFloat16, kPer>(job, b, threads);
          break;
        default:
          FAIL() << "source dtype " << job.src_dtype;
      }
    }
  }
}

// How the emulation runs the direct kernel: the kernel's own shape (every
// block held), or small thread blocks that read most blocks twice.
enum class DirectShape { kKernel, kSmall, kStreaming };

}  // namespace testing
}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_QUANT_DIRECT_EMULATION_H_
