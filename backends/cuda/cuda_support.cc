#include "backends/cuda/cuda_support.h"

#include <dlfcn.h>

#include "absl/strings/str_cat.h"

#if WEIGHTSYNC_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace weightsync {

bool BuiltWithCuda() { return WEIGHTSYNC_HAS_CUDA != 0; }

std::string CudaBuildInfo() {
#if WEIGHTSYNC_HAS_CUDA
  const std::string built =
      absl::StrCat("built with CUDA ", CUDART_VERSION / 1000, ".",
                   (CUDART_VERSION % 1000) / 10);
  const std::string soname =
      absl::StrCat("libcudart.so.", CUDART_VERSION / 1000);
  void* lib = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return absl::StrCat(built, "; CUDA runtime not found");
  using CountFn = int (*)(int*);
  auto count = reinterpret_cast<CountFn>(dlsym(lib, "cudaGetDeviceCount"));
  int n = 0;
  if (count == nullptr || count(&n) != 0 || n == 0) {
    return absl::StrCat(built, "; no GPU visible (GPU backends unavailable)");
  }
  return absl::StrCat(built, "; ", n, " GPU(s) visible");
#else
  return "built without CUDA";
#endif
}

int NcclVersionCode() {
#if WEIGHTSYNC_HAS_CUDA
  void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return 0;
  using VersionFn = int (*)(int*);
  auto get = reinterpret_cast<VersionFn>(dlsym(lib, "ncclGetVersion"));
  int v = 0;
  if (get == nullptr || get(&v) != 0) v = 0;
  dlclose(lib);
  return v;
#else
  return 0;
#endif
}

}  // namespace weightsync
