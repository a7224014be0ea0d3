// libFuzzer target over what an update does on the host backend, from
// fuzz-chosen requests: an engine registration (parameters, allocations,
// segments: validated by BuildEngineLayout), a manifest (dense and sparse
// tensors: PlanChunks, BuildCopyPlan's checks and segment mapping), then
// every chunk of the packed stream, filled with fuzz bytes, scattered into
// engine memory (ScatterChunk) and every sparse payload applied
// (ApplySparsePatch, whose indices are fuzz bytes too). Engine memory is
// heap regions of exactly the registered size, so a write the validation
// should have prevented is an AddressSanitizer report. Invariants of the
// chunk plan are checked as well. Built with --config=fuzz (clang);
// docs/reliability.md says how to run it.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "backends/host/host_data_plane.h"
#include "common/chunk_planner.h"
#include "daemon/core/copy_plan.h"
#include "daemon/core/engine_layout.h"
#include "tests/fuzz/fuzz_memory.h"

namespace weightsync::fuzz {
namespace {

constexpr v1::DType kDtypes[] = {v1::FLOAT32, v1::BFLOAT16, v1::FLOAT16,
                                 v1::INT32,   v1::UINT8,    v1::FLOAT64};

v1::DType PickDtype(FuzzedDataProvider& in) {
  return kDtypes[in.ConsumeIntegralInRange<int>(0, 5)];
}

void AddShape(FuzzedDataProvider& in,
              google::protobuf::RepeatedField<int64_t>* s) {
  const int rank = in.ConsumeIntegralInRange<int>(0, 3);
  for (int d = 0; d < rank; ++d) {
    s->Add(in.ConsumeIntegralInRange<int64_t>(0, 48));
  }
}

int64_t SmallInt(FuzzedDataProvider& in) {
  // Mostly small and valid-looking, sometimes negative or huge.
  switch (in.ConsumeIntegralInRange<int>(0, 9)) {
    case 0:
      return in.ConsumeIntegral<int64_t>();
    case 1:
      return -in.ConsumeIntegralInRange<int64_t>(0, 64);
    default:
      return in.ConsumeIntegralInRange<int64_t>(0, 48);
  }
}

v1::RegisterEngineRequest Registration(FuzzedDataProvider& in) {
  v1::RegisterEngineRequest r;
  r.set_engine_id("e");
  const int allocations = in.ConsumeIntegralInRange<int>(1, 2);
  for (int a = 0; a < allocations; ++a) {
    v1::Allocation* al = r.add_allocations();
    al->set_kind(v1::MEMORY_HOST_SHM);
    al->set_handle(absl::StrCat("/fuzz-", a));
    al->set_size(in.ConsumeIntegralInRange<int64_t>(0, 1 << 18));
    al->set_device_uuid("host");
  }
  const int params = in.ConsumeIntegralInRange<int>(1, 6);
  for (int p = 0; p < params; ++p) {
    v1::Parameter* pa = r.add_parameters();
    pa->set_name(in.ConsumeBool() ? absl::StrCat("t", p)
                                  : absl::StrCat("p", p));
    pa->set_dtype(PickDtype(in));
    AddShape(in, pa->mutable_shape());
    pa->set_allocation(in.ConsumeIntegralInRange<int>(0, allocations));
    pa->set_offset(in.ConsumeIntegralInRange<int64_t>(0, 1 << 18) &
                   ~int64_t{7});
    const int segments = in.ConsumeIntegralInRange<int>(0, 3);
    for (int s = 0; s < segments; ++s) {
      v1::Segment* sg = pa->add_segments();
      sg->set_source(absl::StrCat("t", in.ConsumeIntegralInRange<int>(0, 5)));
      if (in.ConsumeBool()) AddShape(in, sg->mutable_source_shape());
      sg->set_row_begin(SmallInt(in));
      sg->set_row_count(SmallInt(in));
      sg->set_col_begin(SmallInt(in));
      sg->set_col_count(SmallInt(in));
      sg->set_dest_offset(SmallInt(in));
      sg->set_dest_row_stride(SmallInt(in));
    }
  }
  return r;
}

Manifest ManifestOf(FuzzedDataProvider& in) {
  Manifest m;
  const int tensors = in.ConsumeIntegralInRange<int>(1, 6);
  for (int t = 0; t < tensors; ++t) {
    v1::TensorSpec* s = m.Add();
    s->set_name(in.ConsumeBool() ? absl::StrCat("t", t) : absl::StrCat("p", t));
    s->set_dtype(PickDtype(in));
    AddShape(in, s->mutable_shape());
    if (in.ConsumeIntegralInRange<int>(0, 3) == 0) {
      s->set_sparse_nnz(SmallInt(in));
      s->set_sparse_index_bytes(in.ConsumeBool() ? 4 : 8);
    }
  }
  return m;
}

// The chunk plan covers the packed stream exactly, in order, each chunk at
// most chunk_bytes, each piece inside its chunk and tensor.
void CheckChunkPlan(const ChunkPlan& plan) {
  int64_t at = 0;
  for (const Chunk& c : plan.chunks) {
    if (c.offset != at || c.size <= 0 || c.size > plan.chunk_bytes) abort();
    for (const Piece& p : c.pieces) {
      if (p.chunk_offset < 0 || p.length < 0 ||
          p.chunk_offset + p.length > c.size || p.tensor_offset < 0) {
        abort();
      }
    }
    at += c.size;
  }
  if (at != plan.total_bytes) abort();
}

}  // namespace
}  // namespace weightsync::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace weightsync;  // NOLINT
  FuzzedDataProvider in(data, size);
  fuzz::BoundedHeapMapper mapper;
  const v1::RegisterEngineRequest reg = fuzz::Registration(in);
  auto layout = BuildEngineLayout(reg, mapper);
  if (!layout.ok()) return 0;
  const Manifest manifest = fuzz::ManifestOf(in);
  const int64_t chunk_bytes = 256 * in.ConsumeIntegralInRange<int64_t>(1, 64);
  auto chunks = PlanChunks(manifest, chunk_bytes);
  if (chunks.ok()) fuzz::CheckChunkPlan(*chunks);
  auto plan = BuildCopyPlan(manifest, chunk_bytes, {*layout});
  if (!plan.ok()) return 0;
  fuzz::CheckChunkPlan((*plan)->chunks);
  // The packed stream: the rest of the input, repeated.
  const std::vector<uint8_t> rest = in.ConsumeRemainingBytes<uint8_t>();
  std::vector<uint8_t> stream((*plan)->chunks.total_bytes);
  for (size_t i = 0; i < stream.size() && !rest.empty(); ++i) {
    stream[i] = rest[i % rest.size()];
  }
  for (size_t k = 0; k < (*plan)->chunks.chunks.size(); ++k) {
    ScatterChunk(**plan, (*plan)->ops_by_chunk[k],
                 stream.data() + (*plan)->chunks.chunks[k].offset, nullptr);
  }
  for (const SparsePatch& patch : (*plan)->sparse) {
    const uint8_t* payload =
        stream.data() + (*plan)->chunks.tensor_offsets[patch.tensor];
    ApplySparsePatch(**plan, patch, payload, nullptr).IgnoreError();
  }
  return 0;
}
