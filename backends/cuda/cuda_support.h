// What this build and this machine offer for the GPU backends. The CPU
// build never needs the CUDA toolkit at run time: the runtime library is
// looked up with dlopen, only to describe the machine.
#ifndef WEIGHTSYNC_BACKENDS_CUDA_CUDA_SUPPORT_H_
#define WEIGHTSYNC_BACKENDS_CUDA_CUDA_SUPPORT_H_

#include <string>

namespace weightsync {

// True if the GPU backends were compiled in.
bool BuiltWithCuda();

// One line for logs and GetStatus: "built without CUDA", or
// "built with CUDA 13.0; 2 GPUs visible" / "...; no GPU visible".
std::string CudaBuildInfo();

// ncclGetVersion of the libnccl.so.2 this machine's loader finds (the one
// the GPU worker loads), e.g. 22809 for 2.28.9; 0 without CUDA or NCCL.
// Looked up with dlopen: loading NCCL initialises no CUDA.
int NcclVersionCode();

}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_CUDA_SUPPORT_H_
