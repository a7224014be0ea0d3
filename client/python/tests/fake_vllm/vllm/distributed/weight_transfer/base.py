"""The shape of vllm/distributed/weight_transfer/base.py: the dataclass
bases, the worker-side WeightTransferEngine, the trainer-side
TrainerWeightTransferEngine and the client protocol, with vLLM's method
names and signatures. Torch-free: update_weights does not synchronize a
device, WeightSource's tensors are whatever the test yields."""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

TInitInfo = TypeVar("TInitInfo", bound="WeightTransferInitInfo")
TUpdateInfo = TypeVar("TUpdateInfo", bound="WeightTransferUpdateInfo")
TTrainerInitInfo = TypeVar("TTrainerInitInfo", bound="TrainerInitInfo")


@dataclass
class WeightTransferInitInfo(ABC):  # noqa: B024
    pass


@dataclass
class WeightTransferUpdateInfo(ABC):  # noqa: B024
    pass


@dataclass
class TrainerInitInfo:
    backend: ClassVar[str]
    rank: int = field(kw_only=True)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not getattr(cls, "backend", None):
            raise TypeError(f"{cls.__name__} must set a class-level `backend` string")

    @property
    def is_sender(self):
        return self.rank == 0


class WeightSource(ABC):
    @abstractmethod
    def metadata(self):
        raise NotImplementedError

    @abstractmethod
    def __iter__(self):
        raise NotImplementedError


class WeightTransferEngine(ABC, Generic[TInitInfo, TUpdateInfo]):
    init_info_cls: type
    update_info_cls: type
    supports_draft_weight_update: bool = True
    defers_processing: bool = False

    def __init__(self, config, vllm_config, device, model):
        self.config = config
        self.vllm_config = vllm_config
        self.parallel_config = vllm_config.parallel_config
        self.model_config = vllm_config.model_config
        self.device = device
        self.model = model
        self._default_model_config = self.model_config
        self._default_model = model

    def drain_pending(self):
        pass

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
            raise ValueError(f"Invalid init_info for {self.__class__.__name__}: {e}") from e

    def parse_update_info(self, update_dict):
        try:
            return self.update_info_cls(**update_dict)
        except TypeError as e:
            raise ValueError(f"Invalid update_info for {self.__class__.__name__}: {e}") from e

    @abstractmethod
    def init_transfer_engine(self, init_info):
        raise NotImplementedError

    @abstractmethod
    def start_weight_update(self):
        raise NotImplementedError

    @abstractmethod
    def finish_weight_update(self):
        raise NotImplementedError

    def update_weights(self, update_info):
        self.receive_weights(self.parse_update_info(update_info))
        # vLLM: torch.accelerator.synchronize() here.

    @abstractmethod
    def receive_weights(self, update_info):
        raise NotImplementedError

    @abstractmethod
    def shutdown(self):
        raise NotImplementedError


@runtime_checkable
class VLLMWeightSyncClient(Protocol):
    def init_weight_transfer_engine(self, init_info: dict) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: Any) -> None: ...

    def finish_weight_update(self, weight_version: Any = None) -> None: ...


class TrainerWeightTransferEngine(ABC, Generic[TTrainerInitInfo]):
    init_info_cls: type

    def __init__(self, *, client, source=None, is_sender=True):
        self.is_sender = is_sender
        self.client = client
        self.source = source

    @classmethod
    @abstractmethod
    def trainer_init(cls, init_info, *, client, source=None):
        raise NotImplementedError

    @abstractmethod
    def send_weights(self):
        raise NotImplementedError

    def shutdown(self):
        pass
