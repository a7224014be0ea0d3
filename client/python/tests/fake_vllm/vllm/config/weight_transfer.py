"""vllm/config/weight_transfer.py's WeightTransferConfig: the backend name,
checked against WeightTransferEngineFactory's registry when a worker
creates its engine (vLLM: Literal["nccl", "ipc", ...] | str)."""

from dataclasses import dataclass


@dataclass
class WeightTransferConfig:
    backend: str = "nccl"
