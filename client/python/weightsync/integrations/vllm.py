"""weightsync for vLLM: a worker extension, vLLM's parameter layouts as
segments, and a trainer-side shim in the shape of vLLM's weight-transfer API.

Engine side (every vLLM worker registers its weights in place with its
node's daemon):

    vllm serve Qwen/Qwen3-30B-A3B --tensor-parallel-size 2 --enable-expert-parallel \\
        --worker-extension-cls weightsync.integrations.vllm.WeightsyncWorkerExtension
    # then, once the engine is up (LLM / AsyncLLM):
    llm.collective_rpc("weightsync_start")               # WEIGHTSYNC_TARGET: the daemon
    llm.collective_rpc("weightsync_version")             # [version of each worker]

Trainer side: plain Hugging Face names and shapes, `weightsync.Trainer`
(or `WeightsyncTrainer.trainer_send_weights`, shaped like vLLM's
`WeightTransferEngine.trainer_send_weights`).

Written against vLLM's source (see VLLM_SOURCE): QKVParallelLinear,
MergedColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding /
ParallelLMHead, FusedMoE (w13_weight / w2_weight, expert parallelism) and
the Llama / Qwen3 / Qwen3-MoE `load_weights` name mappings. Only this
module's GPU paths import torch or vLLM, and only when called.
"""

import os

from weightsync.integrations._common import (VOCAB_PADDING, MODEL_TYPES, StepGate,  # noqa: F401
                                             check_layout as _check_layout, open_trainer,
                                             send_in_pause, tp_layout, unwrap, vocab_shard)
from weightsync.layouts import config_value, model_dims, moe_layers

__all__ = ["VLLM_SOURCE", "vllm_engine_layout", "vocab_shard", "local_experts",
           "check_layout", "WeightsyncWorkerExtension", "WeightsyncTrainer"]

# What the layouts and the extension were written against (docs/integration.md, "vLLM").
VLLM_SOURCE = (
    "vLLM main as of the weight-transfer API (docs v0.16-v0.29; the seeds' "
    "WeightTransferEngine.trainer_send_weights): v1/worker/worker_base.py @0243225, "
    "distributed/weight_transfer/base.py @02f250b, fused_moe/layer.py @c439a13, "
    "models/qwen3_moe.py @002456d, vocab_parallel_embedding.py (pad_vocab_size, "
    "vocab_range_from_global_vocab_size; same rule in every version read)")

def local_experts(num_experts, ep_rank, ep_size, placement="linear"):
    """Global ids of the experts rank `ep_rank` holds, in local order
    (vLLM's determine_expert_map): "linear" gives each rank a contiguous
    block, the first num_experts % ep_size ranks one more; "round_robin"
    gives rank r experts r, r + ep_size, ... (vLLM falls back to linear for
    models without expert groups, Qwen3-MoE among them)."""
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank {ep_rank} outside [0, {ep_size})")
    if placement == "round_robin":
        return list(range(ep_rank, num_experts, ep_size))
    if placement != "linear":
        raise ValueError(f"unknown expert placement {placement!r}")
    base, rem = divmod(num_experts, ep_size)
    count = base + (1 if ep_rank < rem else 0)
    start = ep_rank * base + min(ep_rank, rem)
    return list(range(start, start + count))


def vllm_engine_layout(config, tp_rank=0, tp_size=1, ep_rank=0, ep_size=1, dtype="BFLOAT16",
                       expert_placement="linear"):
    """(params, segments) of one vLLM worker of a Llama, Qwen3 or Qwen3-MoE
    model: params [(vLLM parameter name, dtype, shape)] and segments
    {name: [Segment dicts]} filling
    them from Hugging Face checkpoint tensors exactly as vLLM's
    load_weights places them. Parameters without segments are the
    checkpoint tensor of the same name (norms, the MoE router).

    `config` is the Hugging Face config (object or dict). tp_rank/tp_size:
    the attention and dense-MLP tensor parallelism. ep_size > 1 means
    `--enable-expert-parallel`: each rank holds whole experts
    (local_experts) and FusedMoE's own TP is 1; else every rank holds all
    experts, sharded like the dense MLP. Pipeline-parallel workers hold a
    subset of the layers: keep the entries they hold.

        qkv_proj  [(H/tp + 2 KV/tp) * hd, hidden]   q, k, v row blocks (KV heads
                  replicated when tp > num_key_value_heads)
        o_proj    [hidden, H/tp * hd]               column block
        gate_up_proj [2 I/tp, hidden]               gate rows, then up rows
        down_proj [hidden, I/tp]                    column block
        embed_tokens, lm_head [pad64(V)/tp, hidden] row block, padding unwritten
        experts.w13_weight [E_local, 2 I'/tp', hidden]  per local expert: gate, up
        experts.w2_weight  [E_local, hidden, I'/tp']    per local expert: down columns
    """
    experts, mtp_rank, mtp = None, None, None
    if ep_size > 1 and moe_layers(config):
        experts, mtp_rank, mtp = local_experts(model_dims(config)["experts"], ep_rank, ep_size,
                                               expert_placement), 0, 1
        if not experts:
            raise ValueError(f"ep rank {ep_rank} of {ep_size} holds no experts")
    return tp_layout(config, tp_rank, tp_size, experts, mtp_rank, mtp, dtype, VOCAB_PADDING)


def check_layout(params, named_tensors, partial=False):
    """_common.check_layout for a vLLM worker (see there)."""
    return _check_layout(params, named_tensors, partial, engine="vLLM")


class WorkerSeams:
    """What the worker extension and the weight-transfer backend
    (vllm_transfer.WeightsyncWeightTransferEngine) share: reading a vLLM
    worker's ranks and dtype and registering its parameters in place. Uses
    `parallel_config`, `model_config` and `device`, which vLLM's Worker and
    its WeightTransferEngine both have."""

    def _weightsync_open(self, model, engine_id, target, version, trainer_uids):
        """A weightsync.Engine holding `model`'s parameters (registered in
        place, laid out by vllm_engine_layout and checked against the
        model), its control stream not yet open."""
        import weightsync
        ranks = self._weightsync_parallel()
        held = dict(model.named_parameters())
        params, segments = vllm_engine_layout(
            self.model_config.hf_config, ranks["tp_rank"], ranks["tp_size"],
            ranks["ep_rank"], ranks["ep_size"], dtype=self._weightsync_dtype(),
            expert_placement=ranks["expert_placement"])
        params = check_layout(params, held, partial=ranks["pp_size"] > 1)
        if engine_id is None:
            prefix = os.environ.get("WEIGHTSYNC_ENGINE_PREFIX", "vllm")
            engine_id = f"{prefix}.dp{ranks['dp_rank']}.pp{ranks['pp_rank']}.tp{ranks['tp_rank']}"
        engine = weightsync.Engine(engine_id, target or os.environ.get("WEIGHTSYNC_TARGET"),
                                   trainer_uids=trainer_uids)
        try:
            self._weightsync_register(engine, [(n, held[n]) for n, _, _ in params],
                                      params, segments, version)
        except BaseException:
            engine.close()
            raise
        return engine

    # The seams: what a test (or a CPU engine) replaces.

    def _weightsync_register(self, engine, named, params, segments, version):
        """Registers the worker's tensors in place (CUDA IPC)."""
        engine.register_torch(named, version=version, segments=segments)

    def _weightsync_drain(self):
        import torch
        torch.cuda.synchronize(self.device)

    def _weightsync_dtype(self):
        from weightsync._gpu import TORCH_DTYPES
        return TORCH_DTYPES[str(self.model_config.dtype)]

    def _weightsync_parallel(self):
        """This worker's ranks, from vLLM's parallel state. Expert
        parallelism as FusedMoE sees it: the EP group when
        --enable-expert-parallel, else none (experts TP-sharded)."""
        from vllm.distributed import parallel_state as ps
        pc = self.parallel_config
        ep = getattr(pc, "enable_expert_parallel", False)
        placement = getattr(pc, "expert_placement_strategy", "linear") or "linear"
        config = self.model_config.hf_config
        if placement == "round_robin" and (config_value(config, "n_group", None) or 1) <= 1:
            placement = "linear"   # vLLM's fallback without expert groups
        pp = ps.get_pp_group()
        return {"tp_rank": ps.get_tensor_model_parallel_rank(),
                "tp_size": ps.get_tensor_model_parallel_world_size(),
                "ep_rank": ps.get_ep_group().rank_in_group if ep else 0,
                "ep_size": ps.get_ep_group().world_size if ep else 1,
                "pp_rank": pp.rank_in_group, "pp_size": pp.world_size,
                "dp_rank": getattr(pc, "data_parallel_rank", 0) or 0,
                "expert_placement": placement}


class WeightsyncWorkerExtension(WorkerSeams):
    """Mixed into vLLM's GPU worker by `--worker-extension-cls
    weightsync.integrations.vllm.WeightsyncWorkerExtension` (vLLM appends
    it to the worker class's bases in WorkerWrapperBase.init_worker and
    refuses any attribute the worker already has: every name here starts
    with weightsync_ / _weightsync_). Call its methods on every worker with
    `collective_rpc("weightsync_start")` etc.

    Uses from the worker: `model_runner.model` (its named_parameters()),
    `model_runner.execute_model` (wrapped by the step gate), `model_config`
    (.hf_config, .dtype), `parallel_config` (.enable_expert_parallel,
    .expert_placement_strategy, .data_parallel_rank), `device`; and from
    vllm.distributed.parallel_state the TP, PP and EP groups.

    Pause/resume: the daemon's pause notice closes a gate around
    `model_runner.execute_model`; it is acknowledged once the running step
    returned and the device is synchronized, and resume opens it. In keep
    mode requests stay scheduled and continue on the new weights. With
    TP > 1 the ranks must stop at the same step: pause vLLM's scheduler
    first (AsyncLLM.pause_generation(mode="keep") or HTTP /pause) and
    resume it after the update; WeightsyncTrainer does so when given
    `pause`/`resume` callables. After a new version, reset the prefix cache
    (LLM.reset_prefix_cache()): it holds KV computed with the old weights.
    """

    def weightsync_start(self, engine_id=None, target=None, version=0, trainer_uids=()):
        """Registers this worker's parameters in place with the daemon at
        `target` (default $WEIGHTSYNC_TARGET, else the node's default
        socket) under `engine_id` (default
        $WEIGHTSYNC_ENGINE_PREFIX (vllm) .dp<d>.pp<p>.tp<t>), with the
        segments of vllm_engine_layout, and opens the control stream.
        `version`: that of the loaded weights. Returns the engine id."""
        if getattr(self, "_weightsync_engine", None) is not None:
            raise RuntimeError(f"weightsync already started as {self._weightsync_engine.engine_id}")
        engine = self._weightsync_open(self.model_runner.model, engine_id, target, version,
                                       trainer_uids)
        try:
            gate = StepGate(drain=self._weightsync_drain,
                             hint="TP > 1: pause vLLM's scheduler first")
            runner = self.model_runner
            runner.execute_model = gate.wrap(runner.execute_model)
            self._weightsync_gate = gate
            self._weightsync_events = []
            engine.start(on_pause=self._weightsync_on_pause, on_resume=self._weightsync_on_resume,
                         on_new_version=self._weightsync_on_new_version,
                         on_dirty=self._weightsync_on_dirty)
        except BaseException:
            self._weightsync_unwrap()
            engine.close()
            raise
        self._weightsync_engine = engine
        return engine.engine_id

    def weightsync_version(self):
        """The weight version this worker holds (0: as loaded), None if not started."""
        engine = getattr(self, "_weightsync_engine", None)
        return None if engine is None else engine.version

    def weightsync_status(self):
        """{engine_id, version, paused, dirty} of this worker, None if not started."""
        engine = getattr(self, "_weightsync_engine", None)
        if engine is None:
            return None
        return {"engine_id": engine.engine_id, "version": engine.version,
                "paused": engine.paused, "dirty": engine.dirty}

    def weightsync_stop(self):
        """Ends the control stream (the daemon forgets this worker) and
        removes the step gate."""
        engine = getattr(self, "_weightsync_engine", None)
        if engine is not None:
            self._weightsync_gate.on_resume()
            self._weightsync_unwrap()
            engine.close()
            self._weightsync_engine = None

    # Hooks, on the engine's control thread.

    def _weightsync_on_pause(self, mode):
        self._weightsync_gate.on_pause(mode)
        self._weightsync_events.append(("pause", mode))

    def _weightsync_on_resume(self):
        self._weightsync_events.append(("resume",))
        self._weightsync_gate.on_resume()

    def _weightsync_on_new_version(self, version):
        self._weightsync_events.append(("version", version))

    def _weightsync_on_dirty(self, reason):
        # The gate stays closed: the daemon keeps a dirty engine paused.
        self._weightsync_events.append(("dirty", reason))

    def _weightsync_unwrap(self):
        runner = getattr(self, "model_runner", None)
        if runner is not None:
            unwrap(runner, "execute_model")


class WeightsyncTrainer:
    """Trainer side in the shape of vLLM's weight-transfer API
    (`EngineClass.trainer_init(init_info)`, then
    `EngineClass.trainer_send_weights(iterator, trainer_args)` each step),
    so code written for vLLM's NCCL/IPC backends switches by naming this
    class. The weights go through the local daemon to every registered
    vLLM worker; vLLM's own start/update/finish_weight_update calls are not
    needed (the daemon pauses, writes and resumes the workers)."""

    @staticmethod
    def trainer_init(init_info=None):
        """init_info: {"target": daemon address (default: the node's
        socket), "backend": "host" | "nccl" | "ipc" (default "ipc"),
        "timeout": seconds}. Returns the weightsync.Trainer to pass as
        trainer_args["trainer"]."""
        info = dict(init_info or {})
        return open_trainer(info.get("target"), info.get("backend", "ipc"),
                            info.get("timeout", 30.0))

    @staticmethod
    def trainer_send_weights(iterator, trainer_args):
        """Sends every (name, tensor) of `iterator` (Hugging Face names, as
        model.named_parameters() gives them) as one weight version.
        trainer_args (dict or object): "trainer" (from trainer_init),
        "version" (int, above the workers' current one); optional "pause" /
        "resume" (callables: vLLM's scheduler pause, needed with TP > 1,
        e.g. lambda: llm.pause_generation(mode="keep")), and any
        Trainer.update keyword (chunk_bytes, mode, verify, engine_ids).
        Returns the daemon's FinishWeightUpdateResponse."""
        args = dict(trainer_args) if isinstance(trainer_args, dict) else dict(vars(trainer_args))
        trainer, version = args.pop("trainer"), args.pop("version")
        pause, resume = args.pop("pause", None), args.pop("resume", None)
        return send_in_pause(trainer, iterator, version, pause, resume, **args)
