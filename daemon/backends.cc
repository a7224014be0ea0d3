#include "daemon/backends.h"

#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "backends/cuda/cuda_support.h"
#include "backends/host/shm_memory.h"
#include "glog/logging.h"

namespace weightsync {
namespace {

absl::Status NoGpu(const std::string& what) {
  return absl::UnimplementedError(
      absl::StrCat(what,
                   " needs the GPU worker, which this daemon does not "
                   "have (",
                   CudaBuildInfo(),
                   "); use host shared memory and the host "
                   "backend"));
}

class Mapper : public MemoryMapper {
 public:
  explicit Mapper(std::shared_ptr<GpuWorkerSupervisor> gpu)
      : gpu_(std::move(gpu)) {}
  absl::StatusOr<std::shared_ptr<MappedRegion>> Open(
      const v1::Allocation& allocation) override {
    switch (allocation.kind()) {
      case v1::MEMORY_HOST_SHM:
        return shm_.Open(allocation);
      case v1::MEMORY_CUDA_IPC:
      case v1::MEMORY_CUDA_VMM:
        if (gpu_ == nullptr) return NoGpu("CUDA IPC memory");
        return GpuMapper(gpu_).Open(allocation);
      default:
        return absl::InvalidArgumentError("unknown memory kind");
    }
  }
  absl::StatusOr<v1::Receipt> DeviceReceipt(
      const EngineLayout& engine,
      const absl::flat_hash_set<std::string>& sources,
      absl::Time deadline) override {
    if (gpu_ == nullptr) return NoGpu("GPU memory");
    return GpuMapper(gpu_).DeviceReceipt(engine, sources, deadline);
  }

 private:
  ShmMapper shm_;
  const std::shared_ptr<GpuWorkerSupervisor> gpu_;
};

class Factory : public DataPlaneFactory {
 public:
  Factory(HostDataPlane::Options host, std::shared_ptr<GpuWorkerSupervisor> gpu)
      : host_(host), gpu_(std::move(gpu)) {}
  absl::StatusOr<std::shared_ptr<DataPlane>> Create(
      const v1::InitWeightTransferRequest& request) override {
    switch (request.backend()) {
      case v1::BACKEND_HOST:
        return std::make_shared<HostDataPlane>(host_);
      case v1::BACKEND_NCCL: {
        if (gpu_ == nullptr) return NoGpu("the nccl backend");
        if (request.nccl_unique_id().size() != 128) {
          return absl::InvalidArgumentError(absl::StrCat(
              "nccl_unique_id must be the 128 bytes of an ncclUniqueId, not ",
              request.nccl_unique_id().size()));
        }
        if (request.world_size() < 2 || request.rank_offset() < 1) {
          return absl::InvalidArgumentError(
              "the nccl backend needs world_size >= 2 and rank_offset >= 1 "
              "(rank 0 is the trainer)");
        }
        worker::v1::InitGroupRequest init;
        init.set_nccl_unique_id(request.nccl_unique_id());
        init.set_world_size(request.world_size());
        init.set_rank(request.rank_offset());
        init.set_device(gpu_->options().device);
        init.set_timeout_ms(request.timeout_ms());
        absl::Status s = gpu_->InitGroup(init);
        if (!s.ok()) return s;
        return std::make_shared<GpuDataPlane>(gpu_, v1::BACKEND_NCCL);
      }
      case v1::BACKEND_IPC:
        if (gpu_ == nullptr) return NoGpu("the ipc backend");
        return std::make_shared<GpuDataPlane>(gpu_, v1::BACKEND_IPC);
      default:
        return absl::InvalidArgumentError("unknown backend");
    }
  }
  int LocalWorldSize(v1::Backend) const override { return 1; }

 private:
  const HostDataPlane::Options host_;
  const std::shared_ptr<GpuWorkerSupervisor> gpu_;
};

}  // namespace

std::shared_ptr<MemoryMapper> MakeMemoryMapper(
    std::shared_ptr<GpuWorkerSupervisor> gpu) {
  return std::make_shared<Mapper>(std::move(gpu));
}

std::shared_ptr<DataPlaneFactory> MakeDataPlaneFactory(
    HostDataPlane::Options host_options,
    std::shared_ptr<GpuWorkerSupervisor> gpu) {
  return std::make_shared<Factory>(host_options, std::move(gpu));
}

namespace {

constexpr char kWorkerDirPrefix[] = "weightsync-worker.";

// True if `path` is a stale worker directory of this uid: its daemon's pid
// (the name's middle part) no longer runs, and it holds only worker.sock.
bool StaleWorkerDir(const std::string& path, const std::string& name) {
  std::vector<std::string> parts = absl::StrSplit(name, '.');
  pid_t pid = 0;
  if (parts.size() != 3 || !absl::SimpleAtoi(parts[1], &pid) || pid <= 0) {
    return false;  // not ours (older daemons used no pid: left alone)
  }
  struct stat st;
  if (lstat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) ||
      st.st_uid != geteuid()) {
    return false;
  }
  if (kill(pid, 0) == 0 || errno != ESRCH) return false;  // still running
  DIR* dir = opendir(path.c_str());
  if (dir == nullptr) return false;
  bool only_socket = true;
  while (dirent* e = readdir(dir)) {
    const std::string entry = e->d_name;
    if (entry == "." || entry == "..") continue;
    struct stat es;
    if (entry != "worker.sock" ||
        lstat((path + "/" + entry).c_str(), &es) != 0 ||
        !S_ISSOCK(es.st_mode)) {
      only_socket = false;
    }
  }
  closedir(dir);
  return only_socket;
}

}  // namespace

absl::StatusOr<std::string> MakeWorkerDir(const std::string& parent) {
  if (DIR* dir = opendir(parent.c_str())) {
    std::vector<std::string> stale;
    while (dirent* e = readdir(dir)) {
      const std::string name = e->d_name;
      if (name.rfind(kWorkerDirPrefix, 0) != 0) continue;
      const std::string path = parent + "/" + name;
      if (StaleWorkerDir(path, name)) stale.push_back(path);
    }
    closedir(dir);
    for (const std::string& path : stale) {
      unlink((path + "/worker.sock").c_str());
      if (rmdir(path.c_str()) == 0) {
        LOG(INFO) << "removed " << path
                  << ", left by a GPU worker whose daemon is gone";
      }
    }
  }
  std::string tmpl =
      absl::StrCat(parent, "/", kWorkerDirPrefix, getpid(), ".XXXXXX");
  if (mkdtemp(tmpl.data()) == nullptr) {
    return absl::InternalError(
        absl::StrCat("can't create a private directory for the GPU worker in ",
                     parent, ": ", std::strerror(errno)));
  }
  return tmpl;
}

}  // namespace weightsync
