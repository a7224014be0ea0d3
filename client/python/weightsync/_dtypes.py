"""The dtype spellings a user may pass where the client asks for a dtype
(Engine.register_host, Trainer.host_tensors): the wire's enum names
("FLOAT32", "BFLOAT16", ...) in any case, numpy's names and objects
("float32", "<f4", np.float32, np.dtype("float16")), torch's dtypes and
their names (torch.bfloat16, "torch.bfloat16") and the usual short forms
("bf16", "fp16", "fp32", "half"). Each maps to the wire's enum name.
"""

from weightsync._errors import UsageError

# The wire's dtypes (weightsync.v1.DType, without DTYPE_UNSPECIFIED).
WIRE = ("FLOAT32", "BFLOAT16", "FLOAT16", "FLOAT64", "INT64", "INT32", "INT16", "INT8",
        "UINT8", "BOOL", "FLOAT8_E4M3FN", "FLOAT8_E5M2")

_ALIASES = {
    "bf16": "BFLOAT16", "fp16": "FLOAT16", "half": "FLOAT16", "fp32": "FLOAT32",
    "single": "FLOAT32", "fp64": "FLOAT64", "double": "FLOAT64", "bool_": "BOOL",
    "e4m3": "FLOAT8_E4M3FN", "fp8_e4m3": "FLOAT8_E4M3FN", "e5m2": "FLOAT8_E5M2",
    "fp8_e5m2": "FLOAT8_E5M2",
}
_BY_LOWER = {w.lower(): w for w in WIRE}
_CACHE = {}


def _lookup(text):
    low = text.strip().lower()
    if low.startswith("torch."):
        low = low[len("torch."):]
    if low.startswith("numpy.") or low.startswith("np."):
        low = low.split(".", 1)[1]
    wire = _BY_LOWER.get(low) or _ALIASES.get(low)
    if wire is None:
        try:  # numpy's own strings: "<f4", "f2", "i8", "float16", ...
            import numpy as np
            from weightsync._tensors import wire_dtype
            dt = np.dtype(text.strip())
            wire = wire_dtype(dt) if dt.byteorder in "=|<" else None
        except (TypeError, ValueError):
            wire = None
    return wire


def wire_name(dtype, what=""):
    """The weightsync.v1.DType enum name of `dtype` (any spelling above).
    UsageError (a ValueError) naming `what` and the accepted spellings
    otherwise."""
    key = dtype if isinstance(dtype, str) else (type(dtype), str(dtype))
    try:
        return _CACHE[key]
    except (KeyError, TypeError):
        pass
    wire = None
    if isinstance(dtype, str):
        wire = _lookup(dtype)
    else:
        text = str(dtype)   # torch.float32 -> "torch.float32"
        if text.startswith("torch."):
            wire = _lookup(text)
        else:
            try:
                import numpy as np
                from weightsync._tensors import wire_dtype
                wire = wire_dtype(np.dtype(dtype))
            except TypeError:
                wire = None
    if wire is None:
        where = f"{what}: " if what else ""
        raise UsageError(f"{where}dtype {dtype!r} is not supported; use one of "
                         f"{', '.join(WIRE)} (numpy or torch spellings such as 'float32', "
                         "np.float16 or torch.bfloat16 work too)")
    if len(_CACHE) < 1024:
        _CACHE[key] = wire
    return wire


_WIRE_SET = frozenset(WIRE)


def normalise_params(params):
    """`params` [(name, dtype, shape)] with every dtype as its wire enum
    name; the list itself when they all are already (one pass over the
    distinct dtypes, none per parameter)."""
    params = params if isinstance(params, (list, tuple)) else list(params)
    if not params:
        return params
    try:
        dtypes = [p[1] for p in params]
    except (TypeError, IndexError):
        raise UsageError("parameters are (name, dtype, shape) triples") from None
    try:
        distinct = set(dtypes)
    except TypeError:
        distinct = None
    if distinct is not None and distinct <= _WIRE_SET:
        return params
    names = [p[0] for p in params]
    if distinct is not None:
        first = dict(zip(reversed(dtypes), reversed(names)))   # a name per dtype
        wire = {d: wire_name(d, f"parameter '{first[d]}'") for d in distinct}
        return [(n, wire[d], p[2]) for n, d, p in zip(names, dtypes, params)]
    return [(n, wire_name(d, f"parameter '{n}'"), p[2]) for n, d, p in zip(names, dtypes, params)]
