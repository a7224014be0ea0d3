// A synthetic Llama/Qwen-shaped model for demos, tests and benchmarks: its
// checkpoint tensors (Hugging Face names and shapes), deterministic contents
// per version, engine layouts (plain, or tensor-parallel with fused qkv and
// gate_up, row/column shards and padded vocab shards, all as segments), and
// a reference installer that computes, element by element and independently
// of the daemon's copy plan, what an engine parameter must hold.
#ifndef WEIGHTSYNC_TOOLS_SYNTHETIC_SYNTHETIC_MODEL_H_
#define WEIGHTSYNC_TOOLS_SYNTHETIC_SYNTHETIC_MODEL_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "weightsync/v1/types.pb.h"

namespace weightsync::synthetic {

struct ModelConfig {
  int64_t vocab = 0, hidden = 0, intermediate = 0, layers = 0;
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  // lm_head shares the embedding (no separate lm_head.weight tensor).
  bool tie_embeddings = false;
};

// "tiny" (tests, ~3 MB), "demo" (~0.4 GB in float32), "qwen3-1.7b",
// "qwen3-8b" (real shapes, for GPU benchmarks).
absl::StatusOr<ModelConfig> ModelByName(const std::string& name);

// Checkpoint tensors in Hugging Face order, all of `dtype`.
std::vector<v1::TensorSpec> Checkpoint(const ModelConfig& m, v1::DType dtype);

// Deterministic contents of `spec` for update `version` (payload bytes).
std::vector<uint8_t> Contents(const v1::TensorSpec& spec, int64_t version);

enum class Layout { kPlain, kTensorParallel };

// Engine parameters (no allocation/offset yet) of rank `rank` of `size`,
// stored as `dtype`. kPlain: each checkpoint tensor as itself (size 1).
// kTensorParallel: vLLM-style fused and sharded names, as segments.
std::vector<v1::Parameter> EngineParameters(const ModelConfig& m, Layout layout,
                                            int rank, int size,
                                            v1::DType dtype);

// The bytes `param` must hold once `checkpoint` (name -> (spec, bytes)) is
// installed into memory that started zeroed.
using CheckpointData =
    std::map<std::string, std::pair<v1::TensorSpec, std::vector<uint8_t>>>;
std::vector<uint8_t> ExpectedParameter(const v1::Parameter& param,
                                       const CheckpointData& checkpoint);

}  // namespace weightsync::synthetic

#endif  // WEIGHTSYNC_TOOLS_SYNTHETIC_SYNTHETIC_MODEL_H_
