"""Tensors as bytes: numpy arrays (and CPU torch tensors) <-> weightsync dtypes."""

import numpy as np

# numpy dtype name -> weightsync.v1.DType enum name
_NUMPY = {
    "float32": "FLOAT32", "float16": "FLOAT16", "float64": "FLOAT64",
    "int64": "INT64", "int32": "INT32", "int16": "INT16", "int8": "INT8",
    "uint8": "UINT8", "bool": "BOOL",
}
_TORCH = {
    "torch.float32": "FLOAT32", "torch.bfloat16": "BFLOAT16", "torch.float16": "FLOAT16",
    "torch.float64": "FLOAT64", "torch.int64": "INT64", "torch.int32": "INT32",
    "torch.int16": "INT16", "torch.int8": "INT8", "torch.uint8": "UINT8", "torch.bool": "BOOL",
}
# weightsync dtype -> numpy dtype used to hold its bytes (bf16 as uint16)
STORAGE = {
    "FLOAT32": np.float32, "FLOAT16": np.float16, "BFLOAT16": np.uint16,
    "FLOAT64": np.float64, "INT64": np.int64, "INT32": np.int32, "INT16": np.int16,
    "INT8": np.int8, "UINT8": np.uint8, "BOOL": np.bool_,
}


def describe(name, tensor):
    """(dtype enum name, shape tuple, flat uint8 view of the bytes)."""
    dtype = str(getattr(tensor, "dtype", ""))
    if dtype.startswith("torch."):
        if dtype not in _TORCH:
            raise ValueError(f"tensor '{name}': dtype {dtype} is not supported")
        if tensor.device.type != "cpu":
            raise ValueError(f"tensor '{name}': on {tensor.device}; the host "
                             "backend sends CPU tensors")
        import torch  # only when the caller already uses torch
        t = tensor.detach().contiguous()
        raw = t.view(torch.uint8) if t.element_size() == 1 else t.view(-1).view(torch.uint8)
        return _TORCH[dtype], tuple(t.shape), raw.numpy().reshape(-1)
    array = np.ascontiguousarray(tensor)
    if array.dtype.name not in _NUMPY:
        raise ValueError(f"tensor '{name}': dtype {array.dtype} is not supported")
    return _NUMPY[array.dtype.name], tuple(array.shape), array.reshape(-1).view(np.uint8)
