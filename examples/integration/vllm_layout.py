"""Engine layouts for a vLLM-style Llama/Qwen worker, built on
weightsync.layouts, with the two things a real vLLM (or SGLang) rank needs
on top of it (docs/integration.md, "Tensor parallelism and fused
parameters"):

* vLLM's vocabulary padding: vLLM pads the whole vocabulary to a multiple
  of 64 rows and splits that evenly over the TP ranks;
  layouts.llama_engine_layout pads each rank's shard to a multiple of 64.
  The two agree only when pad64(vocab) / tp_size is itself a multiple of
  64 (not for Qwen's 151936 rows at TP 4 or 8, nor Llama 3's 128256 at
  TP 8), so the vocab entries are rebuilt here with vLLM's rule.
* q/k/v biases (Qwen2-style attention), which layouts does not describe.

And a check of the layout against the tensors the engine actually holds,
so a mismatch fails at start-up with a clear message instead of at the
first update.

Plain Python; no torch needed (check_against takes anything with .shape).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "client", "python"))
from weightsync import layouts  # noqa: E402

VLLM_VOCAB_PADDING = 64   # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def _get(config, name, default=None):
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name,
                                                                             default)


def vllm_vocab_shard_rows(vocab, tp_size, pad=VLLM_VOCAB_PADDING):
    """Rows of one rank's embed_tokens / lm_head shard in vLLM: the whole
    vocabulary padded to a multiple of `pad`, then split evenly."""
    padded = -(-vocab // pad) * pad
    if padded % tp_size:
        raise ValueError(f"padded vocab {padded} does not divide by tp_size {tp_size}")
    return padded // tp_size


def vllm_llama_layout(config, tp_rank=0, tp_size=1, dtype="BFLOAT16", qkv_bias=False):
    """(params, segments) as layouts.llama_engine_layout, with vLLM's vocab
    padding and, if qkv_bias, segments for qkv_proj.bias."""
    params, segments = layouts.llama_engine_layout(config, tp_rank, tp_size, dtype)
    vocab, hidden = _get(config, "vocab_size"), _get(config, "hidden_size")
    rows = vllm_vocab_shard_rows(vocab, tp_size)
    begin = tp_rank * rows
    count = min(rows, vocab - begin)
    if count <= 0:
        raise ValueError(f"rank {tp_rank} holds only vocab padding; register its embedding "
                         "without weightsync or use fewer ranks")
    for i, (name, dt, shape) in enumerate(params):
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            params[i] = (name, dt, (rows, hidden))
            segments[name] = [{"source": name, "source_shape": [vocab, hidden],
                               "row_begin": begin, "row_count": count,
                               "col_begin": 0, "col_count": hidden,
                               "dest_offset": 0, "dest_row_stride": 0}]
    if qkv_bias:
        heads = _get(config, "num_attention_heads")
        kv_heads = _get(config, "num_key_value_heads", heads)
        head_dim = _get(config, "head_dim", None) or hidden // heads
        q, kv = heads * head_dim, kv_heads * head_dim
        qs, kvs = q // tp_size, kv // tp_size
        for layer in range(_get(config, "num_hidden_layers")):
            p = f"model.layers.{layer}.self_attn."
            name = p + "qkv_proj.bias"
            params.append((name, dtype, (qs + 2 * kvs,)))
            # A 1-D tensor is a [n, 1] matrix: a shard is a row block.
            segments[name] = [
                _bias(p + "q_proj.bias", q, tp_rank * qs, qs, 0),
                _bias(p + "k_proj.bias", kv, tp_rank * kvs, kvs, qs),
                _bias(p + "v_proj.bias", kv, tp_rank * kvs, kvs, qs + kvs)]
    return params, segments


def _bias(source, n, begin, count, dest):
    return {"source": source, "source_shape": [n], "row_begin": begin, "row_count": count,
            "col_begin": 0, "col_count": 1, "dest_offset": dest, "dest_row_stride": 0}


def check_against(params, named_tensors):
    """Raises ValueError listing every registered parameter whose layout
    shape differs from the engine's tensor, and every layout entry the
    engine lacks. Returns {name: tensor} of the engine's tensors."""
    held = dict(named_tensors)
    problems = []
    for name, _, shape in params:
        if name not in held:
            problems.append(f"{name}: in the layout, not in the engine")
        elif tuple(held[name].shape) != tuple(shape):
            problems.append(f"{name}: engine {tuple(held[name].shape)}, layout {tuple(shape)}")
    if problems:
        raise ValueError("engine layout does not match the model:\n  " + "\n  ".join(problems))
    return held
