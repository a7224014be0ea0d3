#include "backends/host/host_data_plane.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "daemon/core/bus_guard.h"
#include "glog/logging.h"

namespace weightsync {

void ScatterChunk(const CopyPlan& plan, const std::vector<CopyOp>& ops,
                  const uint8_t* chunk, const std::atomic<bool>* lost) {
  for (const CopyOp& op : ops) {
    if (lost != nullptr && lost[op.engine].load(std::memory_order_relaxed)) {
      continue;
    }
    const MappedRegion& region = *plan.engines[op.engine]->regions[op.region];
    uint8_t* base = region.data();
    // A region whose owner shrank it fails (bus_guard.h); Finish drops the
    // engine.
    GuardedAccess(region, [&] {
      for (int64_t r = 0; r < op.rows; ++r) {
        ConvertElements(chunk + op.src_offset + r * op.src_stride, op.src_dtype,
                        base + op.dst_offset + r * op.dst_stride, op.dst_dtype,
                        op.cols);
      }
    });
  }
}

absl::Status ApplySparsePatch(const CopyPlan& plan, const SparsePatch& patch,
                              const uint8_t* payload,
                              const std::atomic<bool>* lost) {
  std::vector<int64_t> index(patch.nnz);
  if (patch.index_bytes == 4) {
    std::vector<uint32_t> narrow(patch.nnz);
    std::memcpy(narrow.data(), payload, patch.nnz * sizeof(uint32_t));
    std::copy(narrow.begin(), narrow.end(), index.begin());
  } else {
    std::memcpy(index.data(), payload, patch.nnz * sizeof(int64_t));
  }
  for (int64_t i : index) {
    if (i < 0 || i >= patch.numel) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", patch.name, "': sparse index ", i,
                       " is outside [0, ", patch.numel, ")"));
    }
  }
  const uint8_t* values = payload + patch.nnz * patch.index_bytes;
  const int64_t ses = ElementSize(patch.dtype);
  for (const SparsePatch::Use& u : patch.uses) {
    if (lost != nullptr && lost[u.engine].load(std::memory_order_relaxed)) {
      continue;
    }
    const MappedRegion& region = *plan.engines[u.engine]->regions[u.region];
    uint8_t* base = region.data() + u.param_offset;
    const int64_t des = ElementSize(u.dtype);
    GuardedAccess(region, [&] {
      for (int64_t k = 0; k < patch.nnz; ++k) {
        int64_t dst;
        if (u.implicit) {
          dst = index[k];
        } else {
          const int64_t r = index[k] / patch.cols, c = index[k] % patch.cols;
          if (r < u.row_begin || r >= u.row_begin + u.row_count ||
              c < u.col_begin || c >= u.col_begin + u.col_count) {
            continue;  // this use's block does not hold that element
          }
          dst = u.dest_offset + (r - u.row_begin) * u.dest_row_stride +
                (c - u.col_begin);
        }
        ConvertElements(values + k * ses, patch.dtype, base + dst * des,
                        u.dtype, 1);
      }
    });
  }
  return absl::OkStatus();
}

namespace {

// Copies `op` of chunk `index` from the source's tensors, touching only
// `from` (every tensor it reads must be placed there) and the op's engine
// region. INTERNAL if a byte it reads is no tensor's. Pieces placed in
// another source region are skipped, the highest such region in
// *other_region: the caller's pass for that region copies them.
absl::Status CopyOpFromSource(const CopyPlan& plan, const CopyOp& op,
                              int64_t index, const Source& source, int32_t from,
                              int32_t* other_region) {
  const ChunkPlan& chunks = plan.chunks;
  const std::vector<int64_t>& starts = chunks.tensor_offsets;
  uint8_t* base = plan.engines[op.engine]->regions[op.region]->data();
  const int64_t ss = ElementSize(op.src_dtype);
  const int64_t ds = ElementSize(op.dst_dtype);
  const bool flat = op.rows == 1 || (op.src_stride == op.cols * ss &&
                                     op.dst_stride == op.cols * ds);
  const int64_t extent =
      flat ? 0 : (op.rows - 1) * op.src_stride + op.cols * ss;
  int64_t packed = chunks.chunks[index].offset + op.src_offset;
  int64_t dst = op.dst_offset;
  int64_t left = flat ? op.rows * op.cols : 1;
  // Pieces of other regions are left for a second pass (*other_region).
  while (left > 0) {
    const int64_t t = std::upper_bound(starts.begin(), starts.end(), packed) -
                      starts.begin() - 1;
    const int64_t end = t < 0 ? 0 : starts[t] + chunks.payload_bytes[t];
    if (t < 0 || packed >= end || (!flat && packed + extent > end)) {
      return absl::InternalError(absl::StrCat(
          "a copy of chunk ", index, " reads packed bytes at ", packed,
          " that no tensor of the registered source '", source.id, "' holds"));
    }
    const Source::Placement& p = source.placements[t];
    const int64_t n = flat ? std::min(left, (end - packed) / ss) : 0;
    if (p.region != from) {
      *other_region = std::max(*other_region, p.region);
    } else {
      const uint8_t* src =
          source.regions[from]->data() + p.offset + (packed - starts[t]);
      if (flat) {
        ConvertElements(src, op.src_dtype, base + dst, op.dst_dtype, n);
      } else {
        for (int64_t r = 0; r < op.rows; ++r) {
          ConvertElements(src + r * op.src_stride, op.src_dtype,
                          base + op.dst_offset + r * op.dst_stride,
                          op.dst_dtype, op.cols);
        }
      }
    }
    if (!flat) break;
    packed += n * ss;
    dst += n * ds;
    left -= n;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ScatterFromSource(const CopyPlan& plan, int64_t index,
                               const Source& source,
                               const std::atomic<bool>* lost) {
  // The ops read bytes of the packed stream; a registered source has no
  // packed stream, so each byte is read where its tensor lives (the copy
  // plan joins ops that are contiguous in the stream and in the engine,
  // across tensors: such an op is cut back into one copy per tensor). The
  // SIGBUS window (bus_guard.h) arms one source region and one engine region
  // for a run of ops: one window per chunk for a trainer with one region.
  const std::vector<CopyOp>& ops = plan.ops_by_chunk[index];
  for (int32_t from = 0; from < static_cast<int32_t>(source.regions.size());
       ++from) {
    const MappedRegion& src_region = *source.regions[from];
    bool more = false;  // a piece of another source region was seen
    absl::Status bad;
    for (size_t i = 0; i < ops.size() && bad.ok();) {
      const CopyOp& first = ops[i];
      if (lost != nullptr &&
          lost[first.engine].load(std::memory_order_relaxed)) {
        ++i;
        continue;
      }
      const MappedRegion& to =
          *plan.engines[first.engine]->regions[first.region];
      size_t end = i + 1;
      while (end < ops.size() && ops[end].engine == first.engine &&
             ops[end].region == first.region) {
        ++end;
      }
      // An engine region that faults is dropped at Finish, as in
      // ScatterChunk; a source region that faults fails the update.
      GuardedAccess(src_region, to, [&] {
        for (size_t k = i; k < end && bad.ok(); ++k) {
          int32_t other = from;
          bad = CopyOpFromSource(plan, ops[k], index, source, from, &other);
          more |= other > from;
        }
      });
      if (src_region.faulted()) {
        return absl::DataLossError(absl::StrCat(
            "chunk ", index, ": allocation ", from, " of source '", source.id,
            "' shrank under the daemon (the trainer truncated its shared "
            "memory); register the source again"));
      }
      i = end;
    }
    if (!bad.ok()) return bad;
    if (!more) break;  // no piece lies in a later region
  }
  return absl::OkStatus();
}

HostDataPlane::HostDataPlane(Options options)
    : options_(std::move(options)), worker_([this] { Run(); }) {}

HostDataPlane::~HostDataPlane() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  worker_.join();
}

absl::Status HostDataPlane::Begin(std::shared_ptr<const CopyPlan> plan,
                                  const v1::StartWeightUpdateRequest&) {
  const int64_t staging =
      std::max(2, options_.staging_buffers) * plan->chunks.chunk_bytes;
  if (staging > options_.staging_budget) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "host staging of ", std::max(2, options_.staging_buffers), " x ",
        plan->chunks.chunk_bytes, " bytes exceeds the budget of ",
        options_.staging_budget, "; use a smaller chunk_bytes"));
  }
  // FP8 targets: the rows of blocks the uses of one tensor hold at once
  // (quant_scatter.h) come out of the same budget.
  if (staging + plan->quant_band_bytes > options_.staging_budget) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "host staging of ", staging, " bytes and ", plan->quant_band_bytes,
        " bytes of FP8 targets' rows of blocks (float32) exceed the budget "
        "of ",
        options_.staging_budget, "; use a smaller chunk_bytes"));
  }
  for (const auto& engine : plan->engines) {
    for (const auto& region : engine->regions) {
      if (region->data() == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("engine '", engine->engine_id,
                         "' registered GPU memory (", region->device_uuid(),
                         "); the host backend writes host shared memory only"));
      }
    }
  }
  absl::MutexLock lock(&mu_);
  if (busy_ || !queue_.empty()) {
    return absl::FailedPreconditionError("host data plane is still busy");
  }
  lost_size_ = plan->engines.size();
  // Value-initialised (new T[n]()): no engine lost.
  lost_ = std::make_unique<std::atomic<bool>[]>(lost_size_);
  assembly_.assign(plan->sparse.size(), std::string());
  assembled_.assign(plan->sparse.size(), 0);
  quant_.Reset(*plan);
  error_ = absl::OkStatus();
  plan_ = std::move(plan);
  source_ = nullptr;
  submitted_ = written_ = 0;
  return absl::OkStatus();
}

absl::Status HostDataPlane::BeginFromSource(
    std::shared_ptr<const CopyPlan> plan,
    const v1::StartWeightUpdateRequest& request, const Source& source) {
  for (size_t a = 0; a < source.regions.size(); ++a) {
    if (source.regions[a]->data() == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "source allocation ", a, " of '", source.id,
          "' is GPU memory; the host backend reads host shared memory only"));
    }
  }
  WS_RETURN_IF_ERROR(Begin(plan, request));
  absl::MutexLock lock(&mu_);
  source_ = &source;
  // Every chunk is queued at once; the owner thread copies each from the
  // trainer's memory when it gets to it.
  for (const Chunk& c : plan_->chunks.chunks) queue_.emplace_back(c.index, "");
  submitted_ = static_cast<int64_t>(queue_.size());
  return absl::OkStatus();
}

absl::Status HostDataPlane::SubmitChunk(int64_t index, std::string data,
                                        absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  if (plan_ == nullptr) {
    return absl::FailedPreconditionError("no update in progress");
  }
  const int in_flight = std::max(2, options_.staging_buffers);
  auto has_room = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return plan_ == nullptr ||
           static_cast<int>(queue_.size()) + (busy_ ? 1 : 0) < in_flight;
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&has_room), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "chunk ", index, ": no free staging buffer before the deadline"));
  }
  if (plan_ == nullptr) return absl::AbortedError("update aborted");
  queue_.emplace_back(index, std::move(data));
  ++submitted_;
  return absl::OkStatus();
}

absl::Status HostDataPlane::Drain(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return written_ == submitted_;
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&done), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "wrote ", written_, " of ", submitted_, " chunks before the deadline"));
  }
  plan_.reset();
  source_ = nullptr;
  return error_;  // a sparse patch or a source that could not apply
}

void HostDataPlane::Abort() {
  absl::MutexLock lock(&mu_);
  queue_.clear();
  plan_.reset();
  source_ = nullptr;
  auto idle = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !busy_; };
  mu_.Await(absl::Condition(&idle));
}

void HostDataPlane::MarkEngineLost(int engine) {
  absl::MutexLock lock(&mu_);
  if (lost_ != nullptr && engine >= 0 && engine < lost_size_) {
    lost_[engine] = true;
  }
}

int64_t HostDataPlane::staging_bytes() const {
  absl::MutexLock lock(&mu_);
  int64_t bytes = 0;
  for (const auto& [index, data] : queue_) bytes += data.size();
  return bytes;
}

int64_t HostDataPlane::chunks_written() const {
  absl::MutexLock lock(&mu_);
  return written_;
}

void HostDataPlane::Run() {
  absl::MutexLock lock(&mu_);
  while (true) {
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stop_ || !queue_.empty();
    };
    mu_.Await(absl::Condition(&ready));
    if (stop_) return;
    auto [index, data] = std::move(queue_.front());
    queue_.pop_front();
    std::shared_ptr<const CopyPlan> plan = plan_;
    const Source* source = source_;
    const std::atomic<bool>* lost = lost_.get();
    busy_ = true;
    mu_.Unlock();
    // The copy runs unlocked: the stream thread fills the next buffer.
    absl::Status patched;
    const auto* bytes = reinterpret_cast<const uint8_t*>(data.data());
    if (source != nullptr) {
      patched = ScatterFromSource(*plan, index, *source, lost);
    } else {
      ScatterChunk(*plan, plan->ops_by_chunk[index], bytes, lost);
    }
    if (!plan->quant.empty()) {
      absl::Status quantized = quant_.Feed(*plan, index, bytes, source, lost);
      if (patched.ok()) patched = quantized;
    }
    for (const auto& [si, piece] : plan->sparse_pieces_by_chunk[index]) {
      const SparsePatch& patch = plan->sparse[si];
      std::string& buf = assembly_[si];
      buf.resize(patch.payload_bytes);
      std::memcpy(&buf[piece.tensor_offset], bytes + piece.chunk_offset,
                  piece.length);
      assembled_[si] += piece.length;
      if (assembled_[si] == patch.payload_bytes) {
        absl::Status s = ApplySparsePatch(
            *plan, patch, reinterpret_cast<const uint8_t*>(buf.data()), lost);
        if (patched.ok()) patched = s;
        std::string().swap(buf);
      }
    }
    data.clear();
    data.shrink_to_fit();
    mu_.Lock();
    if (error_.ok()) error_ = patched;
    busy_ = false;
    ++written_;
  }
}

}  // namespace weightsync
