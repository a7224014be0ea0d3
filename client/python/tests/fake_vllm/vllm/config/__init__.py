from vllm.config.weight_transfer import WeightTransferConfig  # noqa: F401
