// Probe kernels for gpu_kernels_bench's fp8 section: where the direct FP8
// kernel's time goes (bench/fp8_probe.cu). Not the product's kernels: they
// handle only what the bench feeds them (bfloat16 sources, blocks of
// whole aligned 16-byte vectors held in registers) and exist to measure
// what loading ahead and a cheaper division would buy.
#ifndef WEIGHTSYNC_BENCH_FP8_PROBE_H_
#define WEIGHTSYNC_BENCH_FP8_PROBE_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/fp8_math.h"

namespace weightsync {
namespace bench {

// variant: bit 0 loads the thread block's next FP8 block before working on
// the current one; bit 1 divides by a Markstein step (x * r, one residual
// FMA, one correcting FMA; r = 1 / d rounded, once per block) instead of
// __fdiv_rn; bit 2 multiplies by r only (no correction: a lower bound on
// the division's cost, not exact); bit 3 the lean kernel's quotient
// (Fp8Divider) in the probe's loop, bit 4 the lean kernel's per-thread
// write (VecWritePart) in it (bits 3 and 4 ignore bit 0). threads: 256 or
// 512.
cudaError_t Fp8Probe(int variant, int threads, const cuda::DirectJob* jobs,
                     int n, int64_t total_blocks, cudaStream_t stream);

// The hardware's saturating conversion (cvt.rn.satfinite, what the cvt
// and lean kernels encode with) against fp8_math.h's Fp8Encode for every
// finite float32 bit pattern, e4m3fn and e5m2: bad[0], bad[1] get the
// number of patterns whose bytes differ in each format, bad[2] the first
// such pattern (device memory; the caller zeroes it).
cudaError_t Fp8SatfiniteCheck(unsigned long long* bad, cudaStream_t stream);

}  // namespace bench
}  // namespace weightsync

#endif  // WEIGHTSYNC_BENCH_FP8_PROBE_H_
