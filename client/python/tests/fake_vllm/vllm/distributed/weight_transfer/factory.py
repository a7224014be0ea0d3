"""The shape of vllm/distributed/weight_transfer/factory.py: two registries
(worker engines, trainer engines), lazy (module path + class name) or direct
registration, a name registered twice refused, unknown names refused with
the registered ones listed. The built-in names are registered lazily, as in
vLLM; their modules do not exist here."""

import importlib

from vllm.distributed.weight_transfer.base import (TrainerWeightTransferEngine,  # noqa: F401
                                                   WeightTransferEngine)


def _register(registry, kind, name, module_path_or_cls, class_name):
    if name in registry:
        raise ValueError(f"Weight transfer {kind} '{name}' is already registered.")
    if isinstance(module_path_or_cls, str):
        if class_name is None:
            raise ValueError("class_name is required when registering with module path")
        path = module_path_or_cls

        def loader():
            return getattr(importlib.import_module(path), class_name)
        registry[name] = loader
    else:
        registry[name] = lambda: module_path_or_cls


class WeightTransferEngineFactory:
    _registry = {}

    @classmethod
    def register_engine(cls, name, module_path_or_cls, class_name=None):
        _register(cls._registry, "engine", name, module_path_or_cls, class_name)

    @classmethod
    def create_engine(cls, config, vllm_config, device, model):
        backend = config.backend
        if backend not in cls._registry:
            raise ValueError(f"Invalid weight transfer backend: {backend}. "
                             f"Available engines: {list(cls._registry)}")
        return cls._registry[backend]()(config, vllm_config, device, model)


class WeightTransferTrainerFactory:
    _registry = {}

    @classmethod
    def register_engine(cls, name, module_path_or_cls, class_name=None):
        _register(cls._registry, "trainer engine", name, module_path_or_cls, class_name)

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        backend = init_info.backend
        if backend not in cls._registry:
            raise ValueError(f"Invalid weight transfer backend: {backend}. "
                             f"Available trainer engines: {list(cls._registry)}")
        return cls._registry[backend]().trainer_init(init_info, client=client, source=source)


for _name, _module, _cls in (("nccl", "nccl_engine", "NCCLWeightTransferEngine"),
                             ("ipc", "ipc_engine", "IPCWeightTransferEngine"),
                             ("sparse_nccl", "sparse_nccl_engine",
                              "SparseNCCLWeightTransferEngine")):
    WeightTransferEngineFactory.register_engine(
        _name, "vllm.distributed.weight_transfer." + _module, _cls)
