"""Segment mappings from Hugging Face Llama/Qwen checkpoints to an engine
layout with fused qkv and gate_up and tensor-parallel shards (vLLM-style).

A trainer sends plain Hugging Face names and shapes; each engine rank
registers its own parameters with these segments and the daemon assembles
them on the way in. Segment semantics: docs/protocol.md. The same layout
as the C++ tools/synthetic model, so both can be checked against each other.

    params, segments = llama_engine_layout(model.config, tp_rank=r, tp_size=2,
                                           dtype="BFLOAT16")
    weights = engine.register_host(params, segments=segments)

FP8 engines (docs/protocol.md, "FP8 targets"): the linear layers hold
float8 weights with one float32 scale per 128 x 128 block, which the daemon
computes from the bf16/fp32 tensors the trainer sends:

    params, segments, quant = llama_fp8_engine_layout(model.config, tp_rank=r,
                                                      tp_size=2)
    weights = engine.register_host(params, segments=segments, quantization=quant)
"""

__all__ = ["llama_engine_layout", "llama_fp8_engine_layout", "checkpoint_shapes",
           "moe_layers", "FP8_LINEAR"]


def config_value(config, name, default=None):
    """`name` of a Hugging Face config (an object or a dict), else `default`."""
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def model_dims(config):
    """The sizes of a Hugging Face config the layouts use (vocab, hidden,
    inter, layers, heads, ...)."""
    hidden = config_value(config, "hidden_size")
    heads = config_value(config, "num_attention_heads")
    return {
        "vocab": config_value(config, "vocab_size"),
        "hidden": hidden,
        "inter": config_value(config, "intermediate_size"),
        "layers": config_value(config, "num_hidden_layers"),
        "heads": heads,
        "kv_heads": config_value(config, "num_key_value_heads", heads),
        "head_dim": config_value(config, "head_dim", None) or hidden // heads,
        "tied": bool(config_value(config, "tie_word_embeddings", False)),
        "qk_norm": bool(config_value(config, "qk_norm",
                             config_value(config, "model_type") in ("qwen3", "qwen3_moe"))),
        # Mixture of experts (Qwen3-MoE's config names; 0 experts: dense).
        "experts": config_value(config, "num_experts", 0) or 0,
        "moe_inter": config_value(config, "moe_intermediate_size"),
    }


def moe_layers(config):
    """Indices of the layers whose MLP is a mixture of experts, by
    Qwen3-MoE's rule (Hugging Face's and vLLM's Qwen3MoeDecoderLayer): not
    in `mlp_only_layers`, and (index + 1) a multiple of
    `decoder_sparse_step`. Empty for a dense config."""
    d = model_dims(config)
    if not d["experts"]:
        return set()
    step = config_value(config, "decoder_sparse_step", 1) or 1
    only = set(config_value(config, "mlp_only_layers", None) or ())
    return {l for l in range(d["layers"]) if l not in only and (l + 1) % step == 0}


def checkpoint_shapes(config):
    """[(name, shape)] of the Hugging Face checkpoint, in model order."""
    d = model_dims(config)
    H, q, kv = d["hidden"], d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    moe = moe_layers(config)
    out = [("model.embed_tokens.weight", (d["vocab"], H))]
    for l in range(d["layers"]):
        p = f"model.layers.{l}."
        out += [(p + "input_layernorm.weight", (H,)),
                (p + "self_attn.q_proj.weight", (q, H)),
                (p + "self_attn.k_proj.weight", (kv, H)),
                (p + "self_attn.v_proj.weight", (kv, H)),
                (p + "self_attn.o_proj.weight", (H, q))]
        if d["qk_norm"]:
            out += [(p + "self_attn.q_norm.weight", (d["head_dim"],)),
                    (p + "self_attn.k_norm.weight", (d["head_dim"],))]
        out.append((p + "post_attention_layernorm.weight", (H,)))
        if l in moe:
            E, I = d["experts"], d["moe_inter"]
            out.append((p + "mlp.gate.weight", (E, H)))   # the router
            for e in range(E):
                x = f"{p}mlp.experts.{e}."
                out += [(x + "gate_proj.weight", (I, H)), (x + "up_proj.weight", (I, H)),
                        (x + "down_proj.weight", (H, I))]
            continue
        out += [(p + "mlp.gate_proj.weight", (d["inter"], H)),
                (p + "mlp.up_proj.weight", (d["inter"], H)),
                (p + "mlp.down_proj.weight", (H, d["inter"]))]
    out.append(("model.norm.weight", (H,)))
    if not d["tied"]:
        out.append(("lm_head.weight", (d["vocab"], H)))
    return out


def segment(source, shape, rows, cols, dest_offset=0, stride=0):
    """A Segment dict: rows/cols are (begin, count) of the source matrix."""
    return {"source": source, "source_shape": list(shape),
            "row_begin": rows[0], "row_count": rows[1],
            "col_begin": cols[0], "col_count": cols[1],
            "dest_offset": dest_offset, "dest_row_stride": stride}


def llama_engine_layout(config, tp_rank=0, tp_size=1, dtype="BFLOAT16", vocab_pad=64):
    """(params, segments) for rank `tp_rank` of `tp_size`.

    params: [(name, dtype, shape)] for Engine.register_host.
    segments: {name: [segment dicts]}; parameters not in it are the
    checkpoint tensor of the same name (replicated norms).
    Column-parallel: qkv_proj (q, k, v row shards stacked), gate_up_proj;
    row-parallel: o_proj, down_proj (column shards); vocab-parallel:
    embed_tokens, lm_head, each shard padded to a multiple of `vocab_pad`
    rows (padding rows are never written)."""
    d = model_dims(config)
    if d["experts"]:
        raise ValueError("a mixture-of-experts config: use "
                         "weightsync.integrations.vllm.vllm_engine_layout")
    H, I = d["hidden"], d["inter"]
    q, kv = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    for what, n in (("attention heads", d["heads"]), ("kv heads", d["kv_heads"]),
                    ("intermediate size", I)):
        if n % tp_size:
            raise ValueError(f"{what} ({n}) do not divide by tp_size {tp_size}")
    qs, kvs, is_ = q // tp_size, kv // tp_size, I // tp_size
    per_rank = -(-d["vocab"] // tp_size)           # ceil
    vs = -(-per_rank // vocab_pad) * vocab_pad      # padded shard rows
    v0 = tp_rank * vs
    vrows = min(vs, d["vocab"] - v0)
    if vrows <= 0:
        raise ValueError(f"rank {tp_rank} of {tp_size} gets no vocab rows "
                         f"({d['vocab']} rows, shards of {vs})")
    params, segments = [], {}

    def vocab(name):
        params.append((name, dtype, (vs, H)))
        segments[name] = [segment(name, (d["vocab"], H), (v0, vrows), (0, H))]

    vocab("model.embed_tokens.weight")
    for l in range(d["layers"]):
        p = f"model.layers.{l}."
        params.append((p + "input_layernorm.weight", dtype, (H,)))
        name = p + "self_attn.qkv_proj.weight"
        params.append((name, dtype, (qs + 2 * kvs, H)))
        segments[name] = [
            segment(p + "self_attn.q_proj.weight", (q, H), (tp_rank * qs, qs), (0, H)),
            segment(p + "self_attn.k_proj.weight", (kv, H), (tp_rank * kvs, kvs), (0, H), qs * H),
            segment(p + "self_attn.v_proj.weight", (kv, H), (tp_rank * kvs, kvs), (0, H),
                   (qs + kvs) * H)]
        name = p + "self_attn.o_proj.weight"
        params.append((name, dtype, (H, qs)))
        segments[name] = [segment(name, (H, q), (0, H), (tp_rank * qs, qs), 0, qs)]
        if d["qk_norm"]:
            params.append((p + "self_attn.q_norm.weight", dtype, (d["head_dim"],)))
            params.append((p + "self_attn.k_norm.weight", dtype, (d["head_dim"],)))
        params.append((p + "post_attention_layernorm.weight", dtype, (H,)))
        name = p + "mlp.gate_up_proj.weight"
        params.append((name, dtype, (2 * is_, H)))
        segments[name] = [
            segment(p + "mlp.gate_proj.weight", (I, H), (tp_rank * is_, is_), (0, H)),
            segment(p + "mlp.up_proj.weight", (I, H), (tp_rank * is_, is_), (0, H), is_ * H)]
        name = p + "mlp.down_proj.weight"
        params.append((name, dtype, (H, is_)))
        segments[name] = [segment(name, (H, I), (0, H), (tp_rank * is_, is_), 0, is_)]
    params.append(("model.norm.weight", dtype, (H,)))
    if not d["tied"]:
        vocab("lm_head.weight")
    return params, segments


# The parameters of llama_engine_layout that FP8 checkpoints (DeepSeek-V3,
# Qwen3-FP8) quantise: the attention and MLP projections. Embeddings,
# lm_head and norms stay in the engine's dtype.
FP8_LINEAR = ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
              "mlp.gate_up_proj.weight", "mlp.down_proj.weight")


def _segment_rect(cols, seg):
    """(r0, r1, c0, c1) a segment writes in a parameter of `cols` columns,
    or None where that is no rectangle (daemon/core/quant_layout.cc)."""
    stride = seg["dest_row_stride"] or seg["col_count"]
    r0, c0 = divmod(seg["dest_offset"], cols)
    if stride == cols and c0 + seg["col_count"] <= cols:
        return r0, r0 + seg["row_count"], c0, c0 + seg["col_count"]
    if seg["row_count"] != 1 and stride != seg["col_count"]:
        return None
    n = seg["row_count"] * seg["col_count"]
    if c0 + n <= cols:
        return r0, r0 + 1, c0, c0 + n
    if c0 == 0 and n % cols == 0:
        return r0, r0 + n // cols, 0, cols
    return None


def _check_blocks(name, shape, segs, br, bc):
    rows, cols = shape
    for i, seg in enumerate(segs):
        rect = _segment_rect(cols, seg)
        if rect is None:
            raise ValueError(f"{name}: segment {i} ({seg['source']}) is no rectangle of the "
                             f"parameter, so it can't be quantised in blocks")
        r0, r1, c0, c1 = rect
        if (r0 % br or c0 % bc or (r1 % br and r1 != rows) or (c1 % bc and c1 != cols)):
            raise ValueError(
                f"{name}: segment {i} ({seg['source']}) writes rows [{r0}, {r1}) x cols "
                f"[{c0}, {c1}), which cuts a {br} x {bc} block: with this tensor-parallel "
                f"size every shard must start and end on multiples of the block size")


def llama_fp8_engine_layout(config, tp_rank=0, tp_size=1, dtype="BFLOAT16",
                            fp8="FLOAT8_E4M3FN", block=(128, 128), vocab_pad=64,
                            scale_suffix="_scale_inv"):
    """(params, segments, quantization) of an FP8 engine: llama_engine_layout
    with the linear layers (FP8_LINEAR: fused qkv and gate_up, o_proj,
    down_proj) as `fp8` weights, each with a float32 scale parameter named
    weight name + `scale_suffix` (DeepSeek-V3 / Qwen3-FP8 checkpoints'
    "weight_scale_inv": the dequantisation multiplier amax / FMAX) of shape
    [ceil(rows / 128), ceil(cols / 128)], or [rows, 1] with block=None (one
    scale per output row). Norms, embeddings and lm_head stay `dtype`.
    quantization maps a weight's name to weightsync.v1.Quantization fields
    (Engine.register_host(..., quantization=)). ValueError if a
    tensor-parallel shard would cut a block (e.g. 64 KV rows a rank)."""
    from weightsync.receipts.fp8 import quantization_fields
    params, segments = llama_engine_layout(config, tp_rank, tp_size, dtype, vocab_pad)
    out, quant = [], {}
    for name, dt, shape in params:
        if not name.endswith(FP8_LINEAR):
            out.append((name, dt, shape))
            continue
        rows, cols = shape
        br, bc = (1, cols) if block is None else block
        _check_blocks(name, shape, segments[name], br, bc)
        scale = name + scale_suffix
        out.append((name, fp8, shape))
        out.append((scale, "FLOAT32",
                    (rows, 1) if block is None else (-(-rows // br), -(-cols // bc))))
        quant[name] = quantization_fields(fp8, scale, block)
    return out, segments, quant
