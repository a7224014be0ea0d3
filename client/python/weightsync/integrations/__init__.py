"""Drop-in adapters for inference engines.

weightsync.integrations.vllm: a vLLM worker extension
(`--worker-extension-cls weightsync.integrations.vllm.WeightsyncWorkerExtension`),
vLLM's parameter layouts as weightsync segments, and a trainer-side shim in
the shape of vLLM's weight-transfer API. Importing these modules needs
neither torch nor vLLM; their GPU paths import them when called.
"""
