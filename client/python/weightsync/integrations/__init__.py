"""Drop-in adapters for inference engines.

weightsync.integrations.vllm: a vLLM worker extension
(`--worker-extension-cls weightsync.integrations.vllm.WeightsyncWorkerExtension`),
vLLM's parameter layouts as weightsync segments, and a trainer-side shim in
the shape of vLLM's weight-transfer API.

weightsync.integrations.vllm_transfer: the "weightsync" backend of vLLM's
weight-transfer API (`--weight-transfer-config '{"backend": "weightsync"}'`),
registered in vLLM's factories by register() (the package's
vllm.general_plugins entry point calls it in every vLLM process).

weightsync.integrations.sglang: an SGLang custom weight loader
(`--custom-weight-loader weightsync.integrations.sglang.load_weights`) that
registers every TP rank in place, SGLang's layouts, and a trainer shim
shaped like SGLang's update_weights_from_tensor / _from_distributed.

weightsync.integrations._common: what both share. Importing these modules
needs neither torch nor vLLM/SGLang; their GPU paths import them when called.
"""
