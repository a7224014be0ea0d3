"""weightsync as a backend of vLLM's weight-transfer API: code written for
vLLM's native "nccl" / "ipc" backends switches by naming "weightsync".

    pip install weightsync            # registers the backend in every vLLM process
                                      # (entry point vllm.general_plugins -> register)
    vllm serve MODEL --weight-transfer-config '{"backend": "weightsync"}'
    # or LLM(..., weight_transfer_config=WeightTransferConfig(backend="weightsync"))

Worker side (WeightsyncWeightTransferEngine, what vLLM's
WeightTransferEngineFactory creates in each worker): init_transfer_engine
registers the worker's parameters in place with its node's daemon (the
worker extension's registration: vLLM's layouts, checked against the
model). update_weights receives no bytes: the daemon writes straight into
the parameters; the call parks the worker (no forward pass runs while a
worker is inside a weight-transfer RPC) and returns once the daemon
announced the new version and resumed it. The daemon's pause waits for
that park, so the trainer's update and the workers' update_weights run
concurrently, as with vLLM's NCCL backend.

Trainer side, both shapes vLLM has had:
  * WeightsyncTrainerWeightTransferEngine (vLLM's TrainerWeightTransferEngine):
    trainer_init(WeightsyncTrainerInitInfo(rank=...), client=..., source=...),
    then send_weights() per round: start_weight_update, update_weights on a
    thread while weightsync.Trainer.update sends, finish_weight_update.
  * WeightsyncWeightTransferEngine.trainer_init(init_info) and
    .trainer_send_weights(iterator, trainer_args) (static, vLLM's earlier
    API and the seeds' examples): a weightsync.Trainer, then Trainer.update.

What vLLM's interface carries that means nothing here (NCCL addresses,
ranks, packing, IPC handles, tensor metadata) is accepted and ignored:
docs/integration.md, "vLLM weight-transfer backend", has the table.

Importing this module imports neither vLLM nor torch. register() subclasses
vLLM's base classes and registers them under "weightsync"; without vLLM it
registers nothing and says so.
"""

import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

from weightsync.integrations._common import open_trainer, send_in_pause
from weightsync.integrations.vllm import WorkerSeams

__all__ = ["BACKEND", "VLLM_TRANSFER_SOURCE", "register", "WeightsyncInitInfo",
           "WeightsyncUpdateInfo", "WeightsyncTrainerSendWeightsArgs",
           "WeightsyncTrainerInitInfo", "WeightsyncWeightTransferEngine",
           "WeightsyncTrainerWeightTransferEngine"]

BACKEND = "weightsync"

# What this module mirrors (docs/integration.md, "vLLM weight-transfer backend").
VLLM_TRANSFER_SOURCE = (
    "vLLM main, vllm/distributed/weight_transfer/: base.py as of the Base Classes docs "
    "(docs.vllm.ai/en/latest/training/weight_transfer/base, lastmod 2026-09-23: "
    "TrainerInitInfo.backend ClassVar, trainer_init(init_info, *, client, source=None), "
    "no static trainer_send_weights) and base.py @02f250b (static trainer_send_weights "
    "next to TrainerWeightTransferEngine); factory.py @047c993 (WeightTransferEngineFactory, "
    "WeightTransferTrainerFactory); v1/worker/gpu_worker.py (init_weight_transfer_engine, "
    "start_weight_update / update_weights / finish_weight_update); "
    "nccl_engine.py @04b06ef (trainer_init / trainer_send_weights static, "
    "NCCLTrainerSendWeightsArgs)")

# Fields of vLLM's NCCL / IPC init and update infos: accepted, ignored.
_NCCL_INIT = ("master_address", "master_port", "rank_offset", "world_size", "packed",
              "packed_buffer_size_bytes", "packed_num_buffers")


@dataclass
class WeightsyncInitInfo:
    """Worker-side init info (vLLM's WeightTransferInitInfo): what
    init_weight_transfer_engine(init_info) carries to every worker."""
    target: Optional[str] = None        # the node's daemon; default $WEIGHTSYNC_TARGET, else
    #                                     the default socket
    engine_id: Optional[str] = None     # default $WEIGHTSYNC_ENGINE_PREFIX(vllm).dp<d>.pp<p>.tp<t>
    version: int = 0                    # the version of the weights loaded now
    trainer_uids: list = field(default_factory=list)
    park_timeout: float = 8.0           # how long the daemon's pause waits for the worker to
    #                                     enter update_weights before refusing
    # vLLM's NCCL fields: ignored (weightsync's group, if any, is the
    # trainer's init_nccl with the daemon; workers are no ranks of it).
    master_address: Optional[str] = None
    master_port: Optional[int] = None
    rank_offset: Optional[int] = None
    world_size: Optional[int] = None
    packed: Optional[bool] = None
    packed_buffer_size_bytes: Optional[int] = None
    packed_num_buffers: Optional[int] = None


@dataclass
class WeightsyncUpdateInfo:
    """Worker-side update info (vLLM's WeightTransferUpdateInfo): what
    update_weights(update_info) carries. Per round only the version."""
    version: Optional[int] = None       # wait for this version (default: any newer than held)
    timeout: float = 120.0              # seconds for the update to arrive (not counted while
    #                                     the daemon holds the worker paused mid-update)
    # vLLM's NCCL / IPC per-round metadata: ignored (the daemon knows the
    # tensors from the trainer's manifest and writes them itself).
    names: Optional[list] = None
    dtype_names: Optional[list] = None
    shapes: Optional[list] = None
    packed: Optional[bool] = None
    packed_buffer_size_bytes: Optional[int] = None
    packed_num_buffers: Optional[int] = None
    ipc_handles: Any = None
    ipc_handles_pickled: Optional[str] = None
    tensor_sizes: Optional[list] = None
    is_checkpoint_format: bool = True   # always: weightsync takes checkpoint names and places
    #                                     them with the layouts' segments


@dataclass
class WeightsyncTrainerSendWeightsArgs:
    """trainer_args of the static trainer_send_weights, shaped like vLLM's
    NCCLTrainerSendWeightsArgs (a dict with these keys works too)."""
    group: Any = None                   # what trainer_init returned: a weightsync.Trainer
    src: int = 0                        # ignored (the trainer is the only sender)
    post_iter_func: Optional[Callable] = None   # (name, tensor) -> tensor, as vLLM's
    packed: bool = False                # ignored: chunking is chunk_bytes
    stream: Any = None                  # ignored
    packed_buffer_size_bytes: Optional[int] = None   # ignored
    packed_num_buffers: Optional[int] = None         # ignored
    # weightsync's own:
    trainer: Any = None                 # same as group (WeightsyncTrainer's key)
    version: Optional[int] = None       # default: above every engine's version
    pause: Optional[Callable] = None    # vLLM's scheduler pause, around the update
    resume: Optional[Callable] = None
    chunk_bytes: int = 0
    mode: str = "streaming"
    verify: bool = True
    engine_ids: tuple = ()


@dataclass
class WeightsyncTrainerInitInfo:
    """Trainer-side init info (vLLM's TrainerInitInfo): `backend` selects
    this engine in WeightTransferTrainerFactory; rank 0 sends."""
    backend: ClassVar[str] = BACKEND
    target: Any = None                  # daemon address(es); default the node's socket
    transport: str = "ipc"              # "ipc" | "nccl" | "host": Trainer.init_<transport>()
    timeout: float = 30.0
    chunk_bytes: int = 0
    mode: str = "streaming"
    verify: bool = True
    receive_timeout: float = 120.0      # the workers' update_weights timeout
    worker_init_info: dict = field(default_factory=dict)   # sent to init_weight_transfer_engine
    # vLLM's NCCL fields: ignored.
    master_address: Optional[str] = None
    master_port: Optional[int] = None
    world_size: Optional[int] = None
    packed: Optional[bool] = None
    packed_buffer_size_bytes: Optional[int] = None
    packed_num_buffers: Optional[int] = None
    rank: int = field(kw_only=True)    # this trainer process's rank; 0 sends

    @property
    def is_sender(self):
        return self.rank == 0


def _args(obj, cls):
    """`obj` (dict, dataclass or object) as `cls`; unknown keys are an error."""
    if isinstance(obj, cls):
        return obj
    d = dict(obj or {}) if obj is None or isinstance(obj, dict) else dict(vars(obj))
    try:
        return cls(**d)
    except TypeError as e:
        raise ValueError(f"invalid {cls.__name__}: {e}") from e


def _next_version(trainer):
    """One above every engine's version on every daemon of `trainer`."""
    return max((e.version for s in trainer.statuses() for e in s.engines), default=0) + 1


def _materialize(tensor):
    full = getattr(tensor, "full_tensor", None)   # FSDP DTensor: vLLM's materialize_full_tensor
    return full() if callable(full) else tensor


def _legacy_trainer_info(init_info):
    info = dict(init_info or {}) if not hasattr(init_info, "__dict__") else dict(vars(init_info))
    transport = info.pop("transport", None)
    if transport is None and info.get("backend") in ("host", "nccl", "ipc"):
        transport = info.pop("backend")       # WeightsyncTrainer.trainer_init's key
    info.pop("backend", None)
    for k in _NCCL_INIT:
        info.pop(k, None)
    unknown = set(info) - {"target", "timeout"}
    if unknown:
        raise ValueError(f"trainer_init: unknown keys {sorted(unknown)}")
    return info.get("target"), transport or "ipc", info.get("timeout", 30.0)


class WeightsyncWeightTransferEngine(WorkerSeams):
    """vLLM's WeightTransferEngine for the "weightsync" backend (register()
    makes the subclass of vLLM's base that the factory creates). One per
    worker: init_transfer_engine registers the worker's parameters in place
    with its node's daemon; update_weights parks the worker until the daemon
    has written and announced a newer version and resumed it."""

    init_info_cls = WeightsyncInitInfo
    update_info_cls = WeightsyncUpdateInfo
    _weightsync_backend = True
    supports_draft_weight_update = False   # only the target model is registered
    defers_processing = False

    def __init__(self, config, vllm_config, device=None, model=None):
        # vLLM's WeightTransferEngine.__init__, without importing it.
        self.config = config
        self.vllm_config = vllm_config
        self.parallel_config = vllm_config.parallel_config
        self.model_config = vllm_config.model_config
        self.device = device
        self.model = model
        self._default_model_config = self.model_config
        self._default_model = model
        self._ws_engine = None
        self._ws_cv = threading.Condition()
        self._ws_parked = False
        self._ws_paused = False
        self._ws_park_timeout = 8.0
        self._ws_target = None
        self._ws_dirty = None
        self._ws_aborted = False

    # vLLM's WeightTransferEngine: configuration.

    def set_weight_update_target(self, model, model_config):
        self.model = model
        self.model_config = model_config

    def reset_weight_update_target(self):
        self.model = self._default_model
        self.model_config = self._default_model_config

    def parse_init_info(self, init_dict):
        try:
            return self.init_info_cls(**init_dict)
        except TypeError as e:
            raise ValueError(f"Invalid init_info for {type(self).__name__}: {e}") from e

    def parse_update_info(self, update_dict):
        try:
            return self.update_info_cls(**update_dict)
        except TypeError as e:
            raise ValueError(f"Invalid update_info for {type(self).__name__}: {e}") from e

    # vLLM's WeightTransferEngine: the lifecycle.

    def init_transfer_engine(self, init_info):
        """Registers this worker's parameters with its node's daemon and
        opens the control stream (once; a later call, e.g. a restarted
        trainer's trainer_init, only updates park_timeout)."""
        self._ws_park_timeout = init_info.park_timeout
        if self._ws_engine is not None:
            return
        engine = self._weightsync_open(self.model, init_info.engine_id, init_info.target,
                                       init_info.version, init_info.trainer_uids)
        try:
            engine.start(on_pause=self._ws_on_pause, on_resume=self._ws_on_resume,
                         on_new_version=self._ws_notify, on_dirty=self._ws_on_dirty)
        except BaseException:
            engine.close()
            raise
        self._ws_engine = engine

    def start_weight_update(self):
        """Nothing to prepare: the daemon writes in place."""

    def finish_weight_update(self):
        """Nothing to finalize: no layerwise reload, no post-processing."""

    def drain_pending(self):
        """Nothing deferred: update_weights returns with the weights in place."""

    def update_weights(self, update_info):
        """vLLM's update_weights: parse, then receive_weights. No device
        sync after it: the daemon synchronized before its new-version notice."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info):
        """Parks this worker until its engine holds update_info.version
        (default: a version above the one held now) and is resumed. Raises
        if the update ended without that version (aborted, or the worker was
        left dirty) or none began within update_info.timeout."""
        engine = self._ws_engine
        if engine is None:
            raise RuntimeError("weightsync backend not initialized: call "
                               "init_weight_transfer_engine first")
        target = update_info.version if update_info.version is not None else engine.version + 1
        self._weightsync_drain()   # no kernel queued before the park still reads the weights
        deadline = time.monotonic() + update_info.timeout
        with self._ws_cv:
            self._ws_parked, self._ws_target = True, target
            self._ws_dirty, self._ws_aborted = None, False
            self._ws_cv.notify_all()
            try:
                while True:
                    if engine.version >= target and not self._ws_paused:
                        return
                    if self._ws_aborted:
                        raise RuntimeError(
                            f"weightsync: the update ended without version {target} "
                            f"(the worker holds version {engine.version}, unchanged)")
                    left = deadline - time.monotonic()
                    if left <= 0 and (not self._ws_paused or self._ws_dirty is not None):
                        if self._ws_dirty is not None:
                            raise RuntimeError(
                                f"weightsync: the update failed mid-write and left this "
                                f"worker dirty ({self._ws_dirty}); the daemon rewrites it "
                                f"with the next update: send it again")
                        raise TimeoutError(
                            f"weightsync: no update to version {target} within "
                            f"{update_info.timeout} s (the worker holds {engine.version})")
                    self._ws_cv.wait(max(0.01, min(left, 1.0)) if left > 0 else 1.0)
            finally:
                self._ws_parked = False

    def shutdown(self):
        engine, self._ws_engine = self._ws_engine, None
        if engine is not None:
            engine.close()

    # weightsync's own.

    @property
    def weight_version(self):
        """The version this worker holds (None before init_transfer_engine)."""
        return None if self._ws_engine is None else self._ws_engine.version

    def _ws_on_pause(self, mode):
        with self._ws_cv:
            if not self._ws_cv.wait_for(lambda: self._ws_parked, self._ws_park_timeout):
                raise RuntimeError(
                    f"the worker did not enter update_weights within {self._ws_park_timeout} s: "
                    "with the weightsync backend, call update_weights on the inference side "
                    "concurrently with the trainer's send (as vLLM's NCCL backend needs)")
            self._ws_paused = True

    def _ws_on_resume(self):
        with self._ws_cv:
            self._ws_paused = False
            engine = self._ws_engine
            if (self._ws_parked and engine is not None and engine.version < self._ws_target
                    and self._ws_dirty is None):
                self._ws_aborted = True
            self._ws_cv.notify_all()

    def _ws_on_dirty(self, reason):
        with self._ws_cv:
            self._ws_dirty = reason or "dirty"
            self._ws_cv.notify_all()

    def _ws_notify(self, version=None):
        with self._ws_cv:
            self._ws_cv.notify_all()

    # vLLM's earlier trainer side: static methods on the engine class.

    @staticmethod
    def trainer_init(init_info=None):
        """A weightsync.Trainer on the node's daemon, its data path
        initialized (what vLLM's NCCL trainer_init returns as the group).
        init_info (dict): "target", "transport" ("ipc" default, "nccl",
        "host"; "backend" is read the same way), "timeout"; NCCL's
        master_address / master_port / world_size are ignored."""
        return open_trainer(*_legacy_trainer_info(init_info))

    @staticmethod
    def trainer_send_weights(iterator, trainer_args):
        """Sends every (name, tensor) of `iterator` as one weight version
        through weightsync.Trainer.update (chunk_bytes, mode, verify,
        engine_ids; the defaults of Trainer.update). trainer_args: a dict
        or WeightsyncTrainerSendWeightsArgs; "group" (or "trainer") is what
        trainer_init returned. Returns the daemon's FinishWeightUpdateResponse.
        The workers must be in update_weights meanwhile (as with NCCL)."""
        a = _args(trainer_args, WeightsyncTrainerSendWeightsArgs)
        trainer = a.group if a.group is not None else a.trainer
        if trainer is None:
            raise ValueError("trainer_args needs 'group' (what trainer_init returned)")
        post = a.post_iter_func or (lambda item: item[1])
        named = [(item[0], _materialize(post(item))) for item in iterator]
        version = a.version if a.version is not None else _next_version(trainer)
        return send_in_pause(trainer, named, version, a.pause, a.resume,
                             chunk_bytes=a.chunk_bytes, mode=a.mode, verify=a.verify,
                             engine_ids=a.engine_ids)


class WeightsyncTrainerWeightTransferEngine:
    """vLLM's TrainerWeightTransferEngine for the "weightsync" backend:
    trainer_init once (rank 0 opens a weightsync.Trainer and calls the
    client's init_weight_transfer_engine), send_weights() each round."""

    init_info_cls = WeightsyncTrainerInitInfo
    _weightsync_backend = True

    def __init__(self, *, client, source=None, is_sender=True, init_info=None, trainer=None):
        self.client = client
        self.source = source
        self.is_sender = is_sender
        self.init_info = init_info
        self.trainer = trainer
        self.last_response = None

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None, config=None):
        """`config`: what an earlier vLLM passed (a WeightTransferConfig); unused."""
        info = _args(init_info, WeightsyncTrainerInitInfo)
        trainer = None
        if info.is_sender:
            trainer = open_trainer(info.target, info.transport, info.timeout)
            try:
                client.init_weight_transfer_engine(dict(info.worker_init_info))
            except BaseException:
                trainer.close()
                raise
        return cls(client=client, source=source, is_sender=info.is_sender, init_info=info,
                   trainer=trainer)

    def send_weights(self, weights=None):
        """One round: every (name, tensor) of `weights` (default the source
        given to trainer_init) as the next version. Non-sender ranks iterate
        (their collectives) and return. Returns the daemon's
        FinishWeightUpdateResponse on the sender."""
        pairs = self.source if weights is None else weights
        if pairs is None:
            raise ValueError("no weights: give trainer_init a source or send_weights weights")
        named = [(n, _materialize(t)) for n, t in pairs]
        if not self.is_sender:
            return None
        info = self.init_info
        version = _next_version(self.trainer)
        self.client.start_weight_update()
        failure = []

        def receive():
            try:
                self.client.update_weights({"version": version, "timeout": info.receive_timeout})
            except BaseException as e:   # noqa: BLE001 - raised below
                failure.append(e)
        worker = threading.Thread(target=receive, name="weightsync-update-weights", daemon=True)
        worker.start()
        # On failure the workers see the update end (the daemon resumes them)
        # and return; never join here, so the real error surfaces.
        response = self.trainer.update(named, version=version, chunk_bytes=info.chunk_bytes,
                                       mode=info.mode, verify=info.verify)
        worker.join()
        if failure:
            raise failure[0]
        self.client.finish_weight_update()
        self.last_response = response
        return response

    def shutdown(self):
        if self.trainer is not None:
            self.trainer.close()
            self.trainer = None


_REGISTERED = {}


def _subclass(ours, theirs):
    return type(ours.__name__, (ours, theirs),
                {"__module__": __name__, "__doc__": ours.__doc__, "__qualname__": ours.__name__})


def register():
    """Registers the "weightsync" backend with vLLM's factories
    (WeightTransferEngineFactory; WeightTransferTrainerFactory where vLLM
    has it), as subclasses of vLLM's WeightTransferEngine /
    TrainerWeightTransferEngine. Idempotent. vLLM calls it in each of its
    processes through the package's vllm.general_plugins entry point.
    Returns {"engine": class, "trainer": class or None}; without vLLM,
    warns and returns None."""
    if _REGISTERED:
        return dict(_REGISTERED)
    try:
        from vllm.distributed.weight_transfer import base, factory
    except ImportError as e:
        warnings.warn(
            f"vLLM is not importable here ({type(e).__name__}: {e}), so the '{BACKEND}' "
            "weight-transfer backend was not registered: call register() in a process that "
            "has vLLM (installing weightsync next to vLLM does it through the "
            "vllm.general_plugins entry point). weightsync.integrations.vllm_transfer's "
            "classes work without vLLM.", RuntimeWarning, stacklevel=2)
        return None
    out = {"engine": _register_one(factory.WeightTransferEngineFactory,
                                   WeightsyncWeightTransferEngine, base.WeightTransferEngine),
           "trainer": None}
    trainer_factory = getattr(factory, "WeightTransferTrainerFactory", None)
    trainer_base = getattr(base, "TrainerWeightTransferEngine", None)
    if trainer_factory is not None and trainer_base is not None:
        out["trainer"] = _register_one(trainer_factory, WeightsyncTrainerWeightTransferEngine,
                                       trainer_base)
    _REGISTERED.update(out)
    return dict(out)


def _register_one(registry, ours, theirs):
    cls = _subclass(ours, theirs)
    try:
        registry.register_engine(BACKEND, cls)
    except ValueError:
        # Registered before: by another import of this module (fine), or by
        # someone else (said so).
        existing = registry._registry[BACKEND]()
        if not getattr(existing, "_weightsync_backend", False):
            raise ValueError(f"vLLM's {registry.__name__} has '{BACKEND}' registered to "
                             f"{existing.__module__}.{existing.__qualname__}") from None
        return existing
    return cls
