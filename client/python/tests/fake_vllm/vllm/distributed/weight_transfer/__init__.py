"""vllm.distributed.weight_transfer: the factories, as vLLM exports them."""

from vllm.distributed.weight_transfer.factory import (  # noqa: F401
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)
