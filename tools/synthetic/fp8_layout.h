// FP8 engines of the synthetic model (docs/protocol.md, "FP8 targets"): the
// C++ counterpart of weightsync.layouts.llama_fp8_engine_layout. The linear
// layers that FP8 checkpoints (DeepSeek-V3, Qwen3-FP8) quantise, i.e. the
// attention and MLP projections (q/k/v or fused qkv, o_proj, gate/up or
// fused gate_up, down_proj), become FP8 weights, each with
// a float32 "<name>_scale_inv" parameter (the dequantisation multiplier
// amax / FMAX per block); embeddings, lm_head and norms keep the engine's
// dtype. And the reference of what such an engine holds after an update.
#ifndef WEIGHTSYNC_TOOLS_SYNTHETIC_FP8_LAYOUT_H_
#define WEIGHTSYNC_TOOLS_SYNTHETIC_FP8_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tools/synthetic/synthetic_model.h"
#include "weightsync/v1/types.pb.h"

namespace weightsync::synthetic {

// True for the parameter names EngineParameters gives the linear layers.
bool IsFp8Linear(const std::string& name);

// EngineParameters with the linear layers as `format` weights quantised in
// `block` x `block` blocks (0: one scale per row, scales [rows, 1]), scales
// in "<name>_scale_inv" (float32 [ceil(rows / block), ceil(cols / block)]).
// INVALID_ARGUMENT naming the parameter where a tensor-parallel shard would
// cut a block (the daemon refuses such a registration).
absl::StatusOr<std::vector<v1::Parameter>> Fp8EngineParameters(
    const ModelConfig& m, Layout layout, int rank, int size, v1::DType dtype,
    v1::DType format, int64_t block);

// The bytes every parameter of `params` must hold once `checkpoint` is
// installed into memory that started zeroed: ExpectedParameter for plain
// parameters; for an FP8 target, its values assembled by ExpectedParameter
// as float32 and quantised (common/fp8.h), and its scales.
std::vector<std::vector<uint8_t>> ExpectedFp8Engine(
    const std::vector<v1::Parameter>& params, const CheckpointData& checkpoint);

}  // namespace weightsync::synthetic

#endif  // WEIGHTSYNC_TOOLS_SYNTHETIC_FP8_LAYOUT_H_
