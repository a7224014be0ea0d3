"""A stand-in for the parts of vLLM that weightsync's weight-transfer backend
touches, shaped like vLLM's source (vllm/distributed/weight_transfer/base.py
and factory.py, vllm/config/weight_transfer.py, the rank getters of
vllm/distributed/parallel_state.py; docs/integration.md names the commits),
written for client/python/tests/test_vllm_transfer.py. It is NOT vLLM: no
torch, no workers, no NCCL. Put its parent folder on sys.path to use it."""

FAKE = True
