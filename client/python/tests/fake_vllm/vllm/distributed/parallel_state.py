"""The rank getters of vllm/distributed/parallel_state.py that the worker
extension's registration reads. vLLM keeps them per process; the test runs
several workers in one process and sets RANKS before each one registers."""

import types

RANKS = {"tp": (0, 1), "ep": (0, 1), "pp": (0, 1)}


def _group(rank, size):
    return types.SimpleNamespace(rank_in_group=rank, world_size=size)


def get_tensor_model_parallel_rank():
    return RANKS["tp"][0]


def get_tensor_model_parallel_world_size():
    return RANKS["tp"][1]


def get_ep_group():
    return _group(*RANKS["ep"])


def get_pp_group():
    return _group(*RANKS["pp"])
