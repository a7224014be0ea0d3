// The direct quant kernel (quant_kernels.cu, DirectKernel) run on the CPU
// thread by thread through fp8_math.h's functions, as the kernel runs them:
// for quant_steps_test, which compares what it writes with the host data
// plane, and the receipts summed by jobs that carry one (DirectReceipt;
// receipt.out a host address here) with the host's receipt. Test only.
#ifndef WEIGHTSYNC_BACKENDS_CUDA_QUANT_DIRECT_EMULATION_H_
#define WEIGHTSYNC_BACKENDS_CUDA_QUANT_DIRECT_EMULATION_H_

#include <array>
#include <cstdint>
#include <vector>

#include "backends/cuda/fp8_direct_vec.h"
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
    // A job with a receipt: each thread's sum, added to *out (the
    // kernel's warp reduction and atomicAdd: a sum mod 2^64).
    uint64_t sum = 0;
    if (job.receipt.out == nullptr) {
      if (held) {
        cuda::DirectWritePart<kPer>(job, b, t, threads, amax, regs(t));
      } else {
        cuda::DirectWriteStream<kDtype>(job, b, t, threads, amax);
      }
    } else if (held) {
      cuda::DirectWritePart<kPer, true>(job, b, t, threads, amax, regs(t),
                                        &sum);
    } else {
      cuda::DirectWriteStream<kDtype, true>(job, b, t, threads, amax, &sum);
    }
    if (job.receipt.out != nullptr) *job.receipt.out += sum;
  }
}

// How many blocks the lean emulation ran (LeanBlock).
inline int64_t& LeanBlocksRun() {
  static int64_t n = 0;
  return n;
}

// How many of them were without inf or NaN (the finite path).
inline int64_t& LeanFiniteBlocksRun() {
  static int64_t n = 0;
  return n;
}

// How many blocks the vec emulation ran in 16-byte vectors (the rest took
// DirectBlock's walk): the test checks both ways ran.
inline int64_t& VecBlocksRun() {
  static int64_t n = 0;
  return n;
}

// One block as the vec and cvt kernels (quant_kernels.cu, VecBlock) run
// it, thread by thread: `threads` threads holding kPer vectors each (or
// reading the source twice), or DirectBlock's walk with kWalkPer elements
// a thread where the block is not laid out in aligned vectors. (cvt's
// hardware rounding is the GPU's only; here it is Fp8Encode.)
template <int kDtype, int kPer, int kWalkPer>
void VecBlock(const cuda::DirectJob& job, int64_t b, uint32_t threads) {
  int64_t r0, c0, h, w, i, j;
  cuda::QuantBlockOf(job.out, b, &r0, &c0, &h, &w, &i, &j);
  if (!cuda::VecBlockOk<kDtype>(job, c0, w)) {
    DirectBlock<kDtype, kWalkPer>(job, b, threads);
    return;
  }
  ++VecBlocksRun();
  const bool held = cuda::VecHeld<kDtype>(job, b, threads, kPer);
  std::vector<std::array<cuda::Fp8Raw16, kPer>> v(threads);
  auto regs = [&](uint32_t t) -> cuda::Fp8Raw16(&)[kPer] {
    return *reinterpret_cast<cuda::Fp8Raw16(*)[kPer]>(v[t].data());
  };
  float amax = 0.0f;
  for (uint32_t t = 0; t < threads; ++t) {
    const float part =
        held ? cuda::VecLoadPart<kDtype, kPer>(job, b, t, threads, regs(t))
             : cuda::VecAmaxStream<kDtype>(job, b, t, threads);
    amax = part > amax ? part : amax;
  }
  for (uint32_t t = 0; t < threads; ++t) {
    uint64_t sum = 0;  // as DirectBlock's
    if (job.receipt.out == nullptr) {
      if (held) {
        cuda::VecWritePart<kDtype, kPer, false>(job, b, t, threads, amax,
                                                regs(t));
      } else {
        cuda::VecWriteStream<kDtype, false, false>(job, b, t, threads, amax,
                                                   nullptr, false);
      }
    } else if (held) {
      cuda::VecWritePart<kDtype, kPer, false, true>(job, b, t, threads, amax,
                                                    regs(t), &sum);
    } else {
      cuda::VecWriteStream<kDtype, false, true>(job, b, t, threads, amax, &sum,
                                                false);
    }
    if (job.receipt.out != nullptr) *job.receipt.out += sum;
  }
}

// A batch of direct jobs as the kernel runs it: `grid` thread blocks, each
// taking blocks cta, cta + grid, ... of the batch. kVecPer > 0: the vec
// kernel's blocks (kVecPer vectors a thread, kPer elements in the walk).
template <int kPer, int kVecPer = 0>
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
          if constexpr (kVecPer > 0) {
            VecBlock<cuda::kFp8SrcFloat32, kVecPer, kPer>(job, b, threads);
          } else {
            DirectBlock<cuda::kFp8SrcFloat32, kPer>(job, b, threads);
          }
          break;
        case cuda::kFp8SrcBfloat16:
          if constexpr (kVecPer > 0) {
            VecBlock<cuda::kFp8SrcBfloat16, kVecPer, kPer>(job, b, threads);
          } else {
            DirectBlock<cuda::kFp8SrcBfloat16, kPer>(job, b, threads);
          }
          break;
        case cuda::kFp8SrcFloat16:
          if constexpr (kVecPer > 0) {
            VecBlock<cuda::kFp8SrcFloat16, kVecPer, kPer>(job, b, threads);
          } else {
            DirectBlock<cuda::kFp8SrcFloat16, kPer>(job, b, threads);
          }
          break;
        default:
          FAIL() << "source dtype " << job.src_dtype;
      }
    }
  }
}

// One block as the lean kernel (quant_kernels.cu, LeanKernel) runs it:
// kVecThreads threads holding kVecPerThread vectors, Fp8Divider's
// quotients for bfloat16 and float16 (the job is DirectLeanOk); a block
// without inf or NaN (VecTopPart below inf) takes its amax from the top
// and writes without the specials' tests, any other takes VecAmaxHeld's.
template <int kDtype>
void LeanBlock(const cuda::DirectJob& job, int64_t b) {
  constexpr uint32_t kThreads = cuda::kVecThreads;
  constexpr int kPer = cuda::kVecPerThread;
  constexpr bool kDivider = kDtype != cuda::kFp8SrcFloat32;
  ++LeanBlocksRun();
  std::vector<std::array<cuda::Fp8Raw16, kPer>> v(kThreads);
  auto regs = [&](uint32_t t) -> cuda::Fp8Raw16(&)[kPer] {
    return *reinterpret_cast<cuda::Fp8Raw16(*)[kPer]>(v[t].data());
  };
  uint32_t top = 0;
  for (uint32_t t = 0; t < kThreads; ++t) {
    cuda::VecLoadPart<kDtype, kPer>(job, b, t, kThreads, regs(t));
    const uint32_t part =
        cuda::VecTopPart<kDtype, kPer>(job, b, t, kThreads, regs(t));
    top = part > top ? part : top;
  }
  const bool finite = top < cuda::VecInfBits<kDtype>();
  if (finite) ++LeanFiniteBlocksRun();
  float amax = cuda::VecWiden<kDtype>(top);
  if (!finite) {
    amax = 0.0f;
    for (uint32_t t = 0; t < kThreads; ++t) {
      const float part =
          cuda::VecAmaxHeld<kDtype, kPer>(job, b, t, kThreads, regs(t));
      amax = part > amax ? part : amax;
    }
  }
  for (uint32_t t = 0; t < kThreads; ++t) {
    uint64_t sum = 0;
    if (finite) {
      cuda::VecWritePart<kDtype, kPer, false, true, kDivider, true>(
          job, b, t, kThreads, amax, regs(t), &sum);
    } else {
      cuda::VecWritePart<kDtype, kPer, false, true, kDivider>(
          job, b, t, kThreads, amax, regs(t), &sum);
    }
    if (job.receipt.out != nullptr) *job.receipt.out += sum;
  }
}

// A batch as --fp8_direct_kernel=lean runs it (GpuWorker::
// SplitDirectBatches): the DirectLeanOk jobs by the lean kernel, one run
// per source dtype; the rest by the vec kernel's blocks.
inline void RunLeanBatch(const std::vector<cuda::DirectJob>& jobs) {
  std::vector<cuda::DirectJob> rest;
  for (int32_t dtype :
       {cuda::kFp8SrcFloat32, cuda::kFp8SrcBfloat16, cuda::kFp8SrcFloat16}) {
    for (const cuda::DirectJob& job : jobs) {
      if (job.src_dtype != dtype || !cuda::DirectLeanOk(job)) continue;
      for (int64_t b = 0; b < cuda::QuantJobBlocks(job.out); ++b) {
        if (dtype == cuda::kFp8SrcFloat32) {
          LeanBlock<cuda::kFp8SrcFloat32>(job, b);
        } else if (dtype == cuda::kFp8SrcBfloat16) {
          LeanBlock<cuda::kFp8SrcBfloat16>(job, b);
        } else {
          LeanBlock<cuda::kFp8SrcFloat16>(job, b);
        }
      }
    }
  }
  for (const cuda::DirectJob& job : jobs) {
    if (!cuda::DirectLeanOk(job)) rest.push_back(job);
  }
  if (!rest.empty()) {
    RunDirectBatch<cuda::kDirectPerThread, cuda::kVecPerThread>(
        rest, cuda::kVecThreads, 5);
  }
}

// How the emulation runs the direct kernel: the kernel's own shape (every
// block held), or small thread blocks that read most blocks twice; the vec
// kernel's own shape, or small (most blocks read twice); the lean split.
enum class DirectShape {
  kKernel,
  kSmall,
  kStreaming,
  kVec,
  kVecStreaming,
  kLean
};

// Every shape, for the tests that run them all.
inline constexpr DirectShape kAllDirectShapes[] = {
    DirectShape::kKernel, DirectShape::kSmall,        DirectShape::kStreaming,
    DirectShape::kVec,    DirectShape::kVecStreaming, DirectShape::kLean};

}  // namespace testing
}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_QUANT_DIRECT_EMULATION_H_
