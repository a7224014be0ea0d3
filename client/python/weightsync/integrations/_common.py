"""What the vLLM and SGLang adapters share: the tensor-parallel layout of
Llama / Qwen3 / Qwen3-MoE (both engines fuse and shard the same way: their
linear layers and VocabParallelEmbedding come from the same code), the
check of a layout against the tensors a worker holds, the step gate, and
the trainer-side send inside the engine's own pause. No torch, no engine
imports."""

import threading

from weightsync.layouts import segment, config_value, model_dims, moe_layers

VOCAB_PADDING = 64          # DEFAULT_VOCAB_PADDING_SIZE in vLLM and SGLang
MODEL_TYPES = ("llama", "qwen3", "qwen3_moe")


def vocab_shard(vocab, tp_rank, tp_size, pad=VOCAB_PADDING):
    """(rows, begin, count) of a rank's embed_tokens / lm_head
    (VocabParallelEmbedding without LoRA-added tokens): the whole vocabulary
    padded to a multiple of `pad`, split evenly over the TP ranks. The rank
    holds `rows` rows; checkpoint rows [begin, begin + count) fill the first
    `count`, the rest is padding that is never written."""
    padded = -(-vocab // pad) * pad
    if padded % tp_size:
        raise ValueError(f"padded vocab {padded} does not divide by tp_size {tp_size}")
    rows = padded // tp_size
    begin = tp_rank * rows
    count = min(rows, vocab - begin)
    if count <= 0:
        raise ValueError(f"rank {tp_rank} of {tp_size} holds only vocab padding "
                         f"({vocab} rows, shards of {rows}): use fewer ranks")
    return rows, begin, count


def _attention_shards(d, tp_rank, tp_size):
    """(q rows, kv rows, kv rank, q, kv) of one TP rank's QKVParallelLinear:
    query heads split; KV heads split, or replicated when fewer than ranks."""
    hd, heads, kv_heads = d["head_dim"], d["heads"], d["kv_heads"]
    if heads % tp_size:
        raise ValueError(f"attention heads ({heads}) do not divide by tp_size {tp_size}")
    qs = heads // tp_size * hd
    if kv_heads >= tp_size:   # QKVParallelLinear: KV heads split, or replicated
        if kv_heads % tp_size:
            raise ValueError(f"kv heads ({kv_heads}) do not divide by tp_size {tp_size}")
        kvs, kv_rank = kv_heads // tp_size * hd, tp_rank
    else:
        if tp_size % kv_heads:
            raise ValueError(f"tp_size {tp_size} is not a multiple of kv heads ({kv_heads})")
        kvs, kv_rank = hd, tp_rank // (tp_size // kv_heads)
    return qs, kvs, kv_rank, heads * hd, kv_heads * hd


def _expert_shards(d, experts, mtp_rank, mtp):
    """(experts held, MoE TP rank, rows of an expert's shard): `experts`
    global ids in local order (None: all), sharded over `mtp` ranks."""
    E, MI = d["experts"], d["moe_inter"]
    experts = list(range(E)) if experts is None else list(experts)
    if MI % mtp:
        raise ValueError(f"moe_intermediate_size ({MI}) does not divide by {mtp}")
    if not experts:
        raise ValueError(f"this rank holds no experts ({E})")
    return experts, mtp_rank, MI // mtp


def _expert_segments(x, experts, MI, H, mtp_rank, mis):
    """Segments of FusedMoE's w13_weight and w2_weight: each local expert's
    gate and up rows (shard `mtp_rank` of `mis` rows), its down columns."""
    w13, w2 = [], []
    for j, e in enumerate(experts):
        src = f"{x}{e}."
        w13 += [segment(src + "gate_proj.weight", (MI, H), (mtp_rank * mis, mis), (0, H),
                        j * 2 * mis * H),
                segment(src + "up_proj.weight", (MI, H), (mtp_rank * mis, mis), (0, H),
                        (j * 2 + 1) * mis * H)]
        w2.append(segment(src + "down_proj.weight", (H, MI), (0, H),
                          (mtp_rank * mis, mis), j * H * mis, mis))
    return w13, w2


def tp_layout(config, tp_rank, tp_size, experts=None, moe_tp_rank=None, moe_tp_size=None,
              dtype="BFLOAT16", vocab_pad=VOCAB_PADDING):
    """(params, segments) of one tensor-parallel rank, fused and sharded the
    way vLLM and SGLang load Hugging Face checkpoints (QKVParallelLinear,
    MergedColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding /
    ParallelLMHead, FusedMoE w13_weight / w2_weight). The engine-specific
    part is which experts a rank holds and how they are sharded:
    `experts` (global ids in local order; default all) and
    moe_tp_rank / moe_tp_size (default the attention TP)."""
    d = model_dims(config)
    model_type = config_value(config, "model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r}: layouts cover {', '.join(MODEL_TYPES)}")
    if config_value(config, "attention_bias", False) or config_value(config, "mlp_bias", False):
        raise ValueError("attention/MLP biases are not covered by this layout")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside [0, {tp_size})")
    H, hd, L = d["hidden"], d["head_dim"], d["layers"]
    qs, kvs, kv_rank, q, kv = _attention_shards(d, tp_rank, tp_size)
    moe = moe_layers(config)
    if moe:
        E, MI = d["experts"], d["moe_inter"]
        experts, mtp_rank, mis = _expert_shards(
            d, experts, tp_rank if moe_tp_rank is None else moe_tp_rank,
            tp_size if moe_tp_size is None else moe_tp_size)
    params, segments = [], {}

    def add(name, shape, segs=None):
        params.append((name, dtype, tuple(shape)))
        if segs:
            segments[name] = segs

    def vocab(name):
        rows, begin, count = vocab_shard(d["vocab"], tp_rank, tp_size, vocab_pad)
        add(name, (rows, H), [segment(name, (d["vocab"], H), (begin, count), (0, H))])

    def mlp(p, inter):   # MergedColumnParallelLinear + RowParallelLinear
        if inter % tp_size:
            raise ValueError(f"intermediate size ({inter}) does not divide by tp_size {tp_size}")
        s = inter // tp_size
        add(p + "mlp.gate_up_proj.weight", (2 * s, H), [
            segment(p + "mlp.gate_proj.weight", (inter, H), (tp_rank * s, s), (0, H)),
            segment(p + "mlp.up_proj.weight", (inter, H), (tp_rank * s, s), (0, H), s * H)])
        add(p + "mlp.down_proj.weight", (H, s),
            [segment(p + "mlp.down_proj.weight", (H, inter), (0, H), (tp_rank * s, s), 0, s)])

    vocab("model.embed_tokens.weight")
    for l in range(L):
        p = f"model.layers.{l}."
        a = p + "self_attn."
        add(a + "qkv_proj.weight", (qs + 2 * kvs, H), [
            segment(a + "q_proj.weight", (q, H), (tp_rank * qs, qs), (0, H)),
            segment(a + "k_proj.weight", (kv, H), (kv_rank * kvs, kvs), (0, H), qs * H),
            segment(a + "v_proj.weight", (kv, H), (kv_rank * kvs, kvs), (0, H), (qs + kvs) * H)])
        add(a + "o_proj.weight", (H, qs),
            [segment(a + "o_proj.weight", (H, q), (0, H), (tp_rank * qs, qs), 0, qs)])
        if d["qk_norm"]:
            add(a + "q_norm.weight", (hd,))
            add(a + "k_norm.weight", (hd,))
        if l in moe:
            x = p + "mlp.experts."
            w13, w2 = _expert_segments(x, experts, MI, H, mtp_rank, mis)
            # Qwen3MoeSparseMoeBlock registers the router (ReplicatedLinear)
            # after the experts.
            add(x + "w13_weight", (len(experts), 2 * mis, H), w13)
            add(x + "w2_weight", (len(experts), H, mis), w2)
            add(p + "mlp.gate.weight", (E, H))
        else:
            mlp(p, d["inter"])
        add(p + "input_layernorm.weight", (H,))
        add(p + "post_attention_layernorm.weight", (H,))
    add("model.norm.weight", (H,))
    if not d["tied"]:     # tied: lm_head *is* embed_tokens, no parameter of its own
        vocab("lm_head.weight")
    return params, segments


def check_layout(params, named_tensors, partial=False, engine="engine"):
    """Compares a layout with the tensors a worker holds ({name: tensor} or
    pairs; anything with .shape). Raises ValueError listing every layout
    entry the worker lacks or holds in another shape, and every worker
    parameter the layout leaves out (it would never be updated). With
    `partial` (pipeline parallelism), entries the worker lacks are dropped
    instead. Returns the params the worker holds, in layout order."""
    held = dict(named_tensors)
    names = {n for n, _, _ in params}
    problems, kept = [], []
    for name, dt, shape in params:
        if name not in held:
            if not partial:
                problems.append(f"{name}: in the layout, not in the worker")
        elif tuple(held[name].shape) != tuple(shape):
            problems.append(f"{name}: worker {tuple(held[name].shape)}, layout {tuple(shape)}")
        else:
            kept.append((name, dt, shape))
    problems += [f"{n}: in the worker, not in the layout (never updated)"
                 for n in held if n not in names]
    if problems:
        raise ValueError(f"{engine} layout does not match the worker's parameters:\n  "
                         + "\n  ".join(problems))
    return kept


class StepGate:
    """Closes between forward passes: on_pause returns once no step runs
    (then `drain` synchronizes the device, so no queued kernel still reads
    the weights); steps wait while closed. As docs/integration.md 1.4.
    `hint`: what to do when a step does not finish (a TP peer waiting in
    its all-reduce for a rank already parked at its gate)."""

    def __init__(self, drain=None, timeout=8.0, hint="TP > 1: pause the engine's scheduler first"):
        self.drain, self.timeout, self.hint = drain, timeout, hint
        self.cv = threading.Condition()
        self.paused = False
        self.running = 0

    def on_pause(self, mode):
        with self.cv:
            self.paused = True
            if not self.cv.wait_for(lambda: self.running == 0, timeout=self.timeout):
                self.paused = False
                self.cv.notify_all()
                raise RuntimeError(f"a forward pass did not finish in {self.timeout} s "
                                   f"({self.hint})")
        if self.drain is not None:
            self.drain()

    def on_resume(self):
        with self.cv:
            self.paused = False
            self.cv.notify_all()

    def wrap(self, fn):
        def gated(*args, **kwargs):
            with self.cv:
                self.cv.wait_for(lambda: not self.paused)
                self.running += 1
            try:
                return fn(*args, **kwargs)
            finally:
                with self.cv:
                    self.running -= 1
                    self.cv.notify_all()
        gated.__wrapped__ = fn
        return gated


def unwrap(obj, attr):
    """Removes a StepGate.wrap from obj.attr, if there is one."""
    fn = getattr(obj, attr, None)
    if fn is not None and hasattr(fn, "__wrapped__"):
        setattr(obj, attr, fn.__wrapped__)


def send_in_pause(trainer, named, version, pause=None, resume=None, **update):
    """trainer.update(named, version, **update) between the engine's own
    pause() and resume() (either may be None); resume runs even when the
    update fails. Returns the FinishWeightUpdateResponse."""
    named = list(named)
    if pause is not None:
        pause()
    try:
        return trainer.update(named, version=version, **update)
    finally:
        if resume is not None:
            resume()


def open_trainer(target=None, backend="ipc", timeout=30.0):
    """A weightsync.Trainer on the local daemon, its data path initialized
    ("host", "nccl" or "ipc")."""
    import weightsync
    trainer = weightsync.Trainer(target, timeout=timeout)
    try:
        {"host": trainer.init_host, "nccl": trainer.init_nccl,
         "ipc": trainer.init_ipc}[backend]()
    except BaseException:
        trainer.close()
        raise
    return trainer
