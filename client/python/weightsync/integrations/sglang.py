"""weightsync for SGLang: a custom weight loader that registers every
scheduler's (TP rank's) weights in place with its node's daemon, SGLang's
parameter layouts as segments, and a trainer-side shim in the shape of
SGLang's update_weights_from_tensor / _from_distributed flow.

SGLang has no worker extension; its supported hook into the TP workers is
a custom weight loader, `--custom-weight-loader <dotted.path>`: SGLang then
calls `<dotted.path>(model, named_tensors)` on every TP rank (in the
scheduler process, between forward passes) for
`update_weights_from_tensor(named_tensors, load_format=<dotted.path>)`.
Commands travel as tensor names:

    python -m sglang.launch_server --model Qwen/Qwen3-30B-A3B --tp 2 --ep 2 \\
        --custom-weight-loader weightsync.integrations.sglang.load_weights
    # scheduler environment: WEIGHTSYNC_TARGET, WEIGHTSYNC_ENGINE_PREFIX
    engine.update_weights_from_tensor(start_request(), load_format=LOADER)   # register, every rank

Trainer side: `WeightsyncUpdater(engine)` (or weightsync.Trainer directly)
sends Hugging Face names and shapes; the daemon writes the schedulers'
weights; the updater pauses SGLang around it, flushes the cache and sets
SGLang's weight_version.

Written against SGLang's source (see SGLANG_SOURCE). Only the GPU paths
import torch or SGLang, and only when called.
"""

import json
import os
import sys

from weightsync.integrations._common import (VOCAB_PADDING, StepGate, check_layout,
                                             open_trainer, send_in_pause, tp_layout, unwrap,
                                             vocab_shard)
from weightsync.layouts import config_value, model_dims, moe_layers

__all__ = ["SGLANG_SOURCE", "LOADER", "sglang_engine_layout", "sglang_local_experts",
           "load_weights", "start_request", "stop_request", "version_request",
           "weightsync_status", "WeightsyncUpdater", "vocab_shard"]

# What the layouts and the loader were written against (docs/integration.md, "SGLang").
SGLANG_SOURCE = (
    "SGLang main (2026): model_executor/model_runner.py @0005834c, its WeightUpdater "
    "(update_weights_from_tensor: load_format in custom_weight_loaders -> "
    "dynamic_import(load_format)(model, named_tensors); update_weights_from_distributed, "
    "init_weights_update_group), managers/scheduler_update_weights_mixin.py @018c910, "
    "Scheduler.pause_generation / continue_generation, layers/moe/fused_moe_triton/layer.py "
    "FusedMoE (moe_ep/moe_tp groups, contiguous expert blocks), "
    "layers/vocab_parallel_embedding.py (DEFAULT_VOCAB_PADDING_SIZE 64)")

LOADER = "weightsync.integrations.sglang.load_weights"
_PREFIX = "weightsync."


def sglang_local_experts(num_experts, moe_ep_rank, moe_ep_size):
    """Global ids of the experts an SGLang MoE-EP rank holds: the contiguous
    block num_experts / moe_ep_size (FusedMoE asserts it divides; no
    round-robin, EPLB's redundant experts not covered)."""
    if not 0 <= moe_ep_rank < moe_ep_size:
        raise ValueError(f"moe_ep_rank {moe_ep_rank} outside [0, {moe_ep_size})")
    if num_experts % moe_ep_size:
        raise ValueError(f"{num_experts} experts do not divide by ep_size {moe_ep_size} "
                         "(SGLang's FusedMoE requires it)")
    n = num_experts // moe_ep_size
    return list(range(moe_ep_rank * n, (moe_ep_rank + 1) * n))


def sglang_engine_layout(config, tp_rank=0, tp_size=1, ep_size=1, dtype="BFLOAT16",
                         moe_ep_rank=None, moe_tp_rank=None):
    """(params, segments) of one SGLang TP rank of a Llama, Qwen3 or
    Qwen3-MoE model, filling SGLang's parameters from Hugging Face
    checkpoint tensors as its load_weights places them.

    Dense parts are vLLM's (_common.tp_layout: qkv_proj, gate_up_proj,
    row-parallel o_proj/down_proj, vocab padded to 64 then split over TP,
    tied lm_head absent). The difference is MoE: SGLang's `--ep-size` splits
    the TP group, moe_tp_size = tp_size / ep_size, moe_ep_rank = tp_rank //
    moe_tp_size and moe_tp_rank = tp_rank % moe_tp_size (initialize_model_parallel);
    a rank holds the contiguous block of E / ep_size experts, each sharded
    over moe_tp. ep_size = 1: all experts, TP-sharded (as vLLM without EP);
    ep_size = tp_size: whole experts (as vLLM's linear EP).
    moe_ep_rank / moe_tp_rank override the derived ranks."""
    if tp_size % ep_size:
        raise ValueError(f"tp_size {tp_size} does not divide by ep_size {ep_size}")
    moe_tp_size = tp_size // ep_size
    if moe_ep_rank is None:
        moe_ep_rank = tp_rank // moe_tp_size
    if moe_tp_rank is None:
        moe_tp_rank = tp_rank % moe_tp_size
    experts = None
    if moe_layers(config):
        experts = sglang_local_experts(model_dims(config)["experts"], moe_ep_rank, ep_size)
    return tp_layout(config, tp_rank, tp_size, experts, moe_tp_rank, moe_tp_size, dtype,
                     VOCAB_PADDING)


# Requests for update_weights_from_tensor(..., load_format=LOADER): the
# command is the tensor's name (arguments as JSON after a colon), the tensor
# an empty placeholder SGLang moves to the device and we ignore.

class _Placeholder:
    """Stands in for an empty tensor where torch is absent (tests)."""
    shape = (0,)

    def to(self, *args, **kwargs):
        return self


def _placeholder():
    try:
        import torch
    except ImportError:
        return _Placeholder()
    return torch.empty(0)


def _request(command, **args):
    name = _PREFIX + command + (":" + json.dumps(args, sort_keys=True) if args else "")
    return [(name, _placeholder())]


def start_request(engine_id_prefix=None, target=None, version=0, trainer_uids=()):
    """named_tensors that make every TP rank register its weights with the
    daemon (`target`, default $WEIGHTSYNC_TARGET) under
    `<prefix>.dp<d>.pp<p>.tp<t>` (prefix default $WEIGHTSYNC_ENGINE_PREFIX,
    else "sglang"), `version` being that of the loaded weights."""
    args = {"version": int(version)}
    if engine_id_prefix:
        args["prefix"] = engine_id_prefix
    if target:
        args["target"] = target
    if trainer_uids:
        args["trainer_uids"] = list(trainer_uids)
    return _request("start", **args)


def stop_request():
    """named_tensors that make every TP rank end its control stream."""
    return _request("stop")


def version_request(version, timeout=10.0):
    """named_tensors that check every TP rank holds `version` (waiting up to
    `timeout` s for the daemon's notice); the call fails if one does not."""
    return _request("version", version=int(version), timeout=float(timeout))


# Per scheduler process: {id(model): _Registration}
_REGISTRATIONS = {}


class _Registration:
    """One TP rank's weights registered with the daemon. The seams a test (or
    a CPU engine) replaces: register, drain, dtype, parallel."""

    def __init__(self, model, runner):
        self.model, self.runner = model, runner
        self.engine, self.gate, self.events = None, None, []

    def start(self, prefix=None, target=None, version=0, trainer_uids=()):
        import weightsync
        ranks = self.parallel()
        held = dict(self.model.named_parameters())
        config = self.config()
        params, segments = sglang_engine_layout(
            config, ranks["tp_rank"], ranks["tp_size"], ranks["ep_size"],
            dtype=self.dtype(held), moe_ep_rank=ranks["moe_ep_rank"],
            moe_tp_rank=ranks["moe_tp_rank"])
        params = check_layout(params, held, partial=ranks["pp_size"] > 1, engine="SGLang")
        prefix = prefix or os.environ.get("WEIGHTSYNC_ENGINE_PREFIX", "sglang")
        engine_id = f"{prefix}.dp{ranks['dp_rank']}.pp{ranks['pp_rank']}.tp{ranks['tp_rank']}"
        engine = weightsync.Engine(engine_id, target or os.environ.get("WEIGHTSYNC_TARGET"),
                                   trainer_uids=tuple(trainer_uids))
        try:
            self.register(engine, [(n, held[n]) for n, _, _ in params], params, segments,
                          version)
            self.gate = StepGate(drain=self.drain,
                                  hint="TP > 1: pause_generation(mode='in_place') first")
            if self.runner is not None:
                self.runner.forward = self.gate.wrap(self.runner.forward)
            engine.start(on_pause=self.on_pause, on_resume=self.on_resume,
                         on_new_version=lambda v: self.events.append(("version", v)),
                         on_dirty=lambda r: self.events.append(("dirty", r)))
        except BaseException:
            if self.runner is not None:
                unwrap(self.runner, "forward")
            engine.close()
            raise
        self.engine = engine
        return engine_id

    def stop(self):
        if self.engine is not None:
            self.gate.on_resume()
            if self.runner is not None:
                unwrap(self.runner, "forward")
            self.engine.close()
            self.engine = None

    def on_pause(self, mode):
        self.gate.on_pause(mode)
        self.events.append(("pause", mode))

    def on_resume(self):
        self.events.append(("resume",))
        self.gate.on_resume()

    def status(self):
        e = self.engine
        if e is None:
            return None
        return {"engine_id": e.engine_id, "version": e.version, "paused": e.paused,
                "dirty": e.dirty}

    # Seams.

    def config(self):
        mc = getattr(self.runner, "model_config", None)
        return getattr(mc, "hf_config", None) or self.model.config

    def register(self, engine, named, params, segments, version):
        """Registers the rank's tensors in place (CUDA IPC)."""
        engine.register_torch(named, version=version, segments=segments)

    def drain(self):
        import torch
        torch.cuda.synchronize()

    def dtype(self, held):
        from weightsync._gpu import TORCH_DTYPES
        return TORCH_DTYPES[str(next(iter(held.values())).dtype)]

    def parallel(self):
        """This rank's TP / MoE-EP / MoE-TP / PP ranks from SGLang's
        parallel state (sglang.srt.distributed)."""
        from sglang.srt import distributed as sd
        pp = sd.get_pp_group()
        return {"tp_rank": sd.get_tensor_model_parallel_rank(),
                "tp_size": sd.get_tensor_model_parallel_world_size(),
                "ep_size": sd.get_moe_expert_parallel_world_size(),
                "moe_ep_rank": sd.get_moe_expert_parallel_rank(),
                "moe_tp_rank": sd.get_moe_tensor_parallel_rank(),
                "pp_rank": pp.rank_in_group, "pp_size": pp.world_size,
                "dp_rank": getattr(self.runner, "dp_rank", None) or 0}


# What _registration builds; a test replaces it with a host-backend subclass.
Registration = _Registration


def _find_runner(model):
    """SGLang's ModelRunner of `model`, from the caller's frames: the custom
    loader is called by WeightUpdater.update_weights_from_tensor (which has
    get_model_runner) or, in older SGLang, ModelRunner.update_weights_from_tensor
    itself. None if neither is on the stack (then no step gate)."""
    f = sys._getframe(1)
    while f is not None:
        obj = f.f_locals.get("self")
        if obj is not None:
            get = getattr(obj, "get_model_runner", None)
            if callable(get):
                return get()
            if getattr(obj, "model", None) is model and callable(getattr(obj, "forward", None)):
                return obj
            runner = getattr(obj, "model_runner", None)
            if getattr(runner, "model", None) is model:
                return runner
        f = f.f_back
    return None


def load_weights(model, named_tensors):
    """SGLang custom weight loader (`--custom-weight-loader
    weightsync.integrations.sglang.load_weights`). Names starting with
    "weightsync." are commands (start_request, stop_request,
    version_request); any other tensor goes to model.load_weights, so the
    same load_format still accepts ordinary updates."""
    ordinary = []
    for name, tensor in named_tensors:
        if not name.startswith(_PREFIX):
            ordinary.append((name, tensor))
            continue
        command, _, raw = name[len(_PREFIX):].partition(":")
        args = json.loads(raw) if raw else {}
        reg = _REGISTRATIONS.get(id(model))
        if command == "start":
            if reg is not None and reg.engine is not None:
                raise RuntimeError(f"weightsync already started as {reg.engine.engine_id}")
            reg = Registration(model, _find_runner(model))
            reg.start(args.get("prefix"), args.get("target"), args.get("version", 0),
                      args.get("trainer_uids", ()))
            _REGISTRATIONS[id(model)] = reg
        elif command == "stop":
            if reg is not None:
                reg.stop()
                _REGISTRATIONS.pop(id(model), None)
        elif command == "version":
            if reg is None or reg.engine is None:
                raise RuntimeError("weightsync not started on this rank")
            want = args["version"]
            if reg.engine.version != want:
                reg.engine.wait_for_version(want, timeout=args.get("timeout", 10.0))
            if reg.engine.version != want:
                raise RuntimeError(f"{reg.engine.engine_id} holds version "
                                   f"{reg.engine.version}, not {want}")
        else:
            raise ValueError(f"unknown weightsync command {command!r}")
    if ordinary:
        model.load_weights(ordinary)


def weightsync_status(model=None):
    """{engine_id, version, paused, dirty} of this process's registration
    (of `model`, or the only one), None if not started. In-process; across
    processes use SGLang's weight_version (set by WeightsyncUpdater) or the
    daemon's status."""
    if model is not None:
        reg = _REGISTRATIONS.get(id(model))
    else:
        reg = next(iter(_REGISTRATIONS.values()), None) if len(_REGISTRATIONS) == 1 else None
    return None if reg is None else reg.status()


class WeightsyncUpdater:
    """Trainer side, in the shape of SGLang's engine API
    (init_weights_update_group, update_weights_from_distributed,
    update_weights_from_tensor, each returning (success, message)), sending
    through the node's daemon instead of a NCCL group or CUDA IPC handles.

    `engine`: the SGLang Engine (or anything with its methods, e.g. an HTTP
    client): pause_generation(mode) / continue_generation() around each
    update (needed with TP > 1: every rank must stop at the same step) and
    update_weights_from_tensor(version_request(v), load_format=LOADER,
    flush_cache=..., weight_version=str(v)) after it, still paused, which
    checks every rank holds the version and sets SGLang's weight_version
    (/get_weight_version, meta_info["weight_version"]). flush_cache=True
    also drops the radix cache (KV computed with the old weights), but
    SGLang asserts the scheduler is idle for it: use it with
    pause_mode="abort" (or an idle engine), not with "in_place", which
    keeps the running requests. Without `engine`, only the daemon update.
    """

    def __init__(self, engine=None, target=None, backend="ipc", timeout=30.0, version=0,
                 pause_mode="in_place", trainer=None):
        self.engine, self.pause_mode = engine, pause_mode
        self.target, self.backend, self.timeout = target, backend, timeout
        self.version = version      # the last version sent (0: as loaded)
        self.trainer = trainer

    def init_weights_update_group(self, master_address=None, master_port=None, rank_offset=None,
                                  world_size=None, group_name=None, backend=None):
        """Opens the trainer on the daemon (SGLang's NCCL group arguments are
        accepted and ignored: the daemon has the routes)."""
        if self.trainer is None:
            self.trainer = open_trainer(self.target, self.backend, self.timeout)
        return True, "weightsync trainer ready"

    def destroy_weights_update_group(self, group_name=None):
        if self.trainer is not None:
            self.trainer.close()
            self.trainer = None
        return True, "weightsync trainer closed"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=False,
                                   weight_version=None, **update):
        """Sends (name, tensor) pairs (Hugging Face names) as one version:
        int(weight_version) if it is an integer, else the last + 1. Extra
        keywords go to Trainer.update (chunk_bytes, mode, verify,
        engine_ids). Returns (success, message); raises on a daemon error."""
        if load_format not in (None, LOADER):
            raise ValueError(f"load_format {load_format!r}: weightsync writes engine layouts")
        self.init_weights_update_group()
        version = self._next(weight_version)
        named = list(named_tensors)
        if self.engine is None:
            result = send_in_pause(self.trainer, named, version, **update)
        else:
            self.engine.pause_generation(mode=self.pause_mode)
            try:
                result = self.trainer.update(named, version=version, **update)
                self.engine.update_weights_from_tensor(
                    version_request(version), load_format=LOADER, flush_cache=flush_cache,
                    weight_version=str(version))
            finally:
                self.engine.continue_generation()
        self.version = result.version
        return True, f"weightsync version {result.version}"

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name=None,
                                        flush_cache=False, weight_version=None, tensors=None,
                                        **update):
        """SGLang's update_weights_from_distributed(names, dtypes, shapes)
        with the tensors the trainer would have broadcast (`tensors`, in
        the order of `names`); dtypes and shapes are checked against them."""
        if tensors is None or len(tensors) != len(names):
            raise ValueError("tensors: one per name (what the trainer would broadcast)")
        for n, dt, shape, t in zip(names, dtypes, shapes, tensors):
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{n}: tensor {tuple(t.shape)}, declared {tuple(shape)}")
            if str(dt).replace("torch.", "") != str(t.dtype).replace("torch.", ""):
                raise ValueError(f"{n}: tensor {t.dtype}, declared {dt}")
        return self.update_weights_from_tensor(list(zip(names, tensors)), None, flush_cache,
                                               weight_version, **update)

    def _next(self, weight_version):
        if weight_version is not None:
            try:
                return int(weight_version)
            except (TypeError, ValueError):
                pass
        return self.version + 1
