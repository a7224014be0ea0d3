"""The few array operations that differ between numpy and torch, so that the
GPU helpers (weightsync.sparse.diff on torch tensors, the GPU receipts in
weightsync.receipts) are written once with operators both share (`+ * ^ &
>> <<`, comparisons, slicing, `.view(dtype)`, `.reshape`, fancy indexing)
and run on torch CUDA tensors on a GPU and on numpy arrays in CI, where the
numpy run is checked bit for bit against the host implementations.

Integers are int64 everywhere (torch has no uint64 arithmetic): wrapping
two's-complement + and * give the bits of uint64 arithmetic mod 2^64, and a
right shift is made logical by masking (`shr`).
"""

MASK32 = (1 << 32) - 1
MASK64 = (1 << 64) - 1


def signed64(value):
    """A uint64 constant as the int64 with the same bits."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def shr(x, s):
    """Logical right shift of int64 bits by a constant 0 < s < 64."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def is_torch(x):
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "element_size")


def ops_for(x):
    return TorchOps() if is_torch(x) else NumpyOps()


class NumpyOps:
    name = "numpy"

    def __init__(self):
        import numpy as np
        self._np = np
        self.int64, self.int32, self.uint8 = np.int64, np.int32, np.uint8
        # An integer dtype of each element width, for views of raw bits.
        self._ints = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}

    def int_dtype(self, width):
        return self._ints[width]

    def itemsize(self, x):
        return x.itemsize

    def flat(self, x):
        return self._np.ascontiguousarray(x).reshape(-1)

    def contiguous(self, x):
        return self._np.ascontiguousarray(x)

    def arange(self, n, like=None):
        return self._np.arange(n, dtype=self._np.int64)

    def where(self, cond, a, b):
        return self._np.where(cond, a, b)

    def count(self, mask):
        return int(self._np.count_nonzero(mask))

    def nonzero(self, mask):
        """Positions of the true elements of a 1-D mask, increasing, int64."""
        return self._np.flatnonzero(mask).astype(self._np.int64)

    def cat(self, parts):
        return self._np.concatenate(parts)

    def to_int64(self, x):
        return x.astype(self._np.int64)

    def to_int(self, scalar):
        return int(scalar)

    def f16_to_f32_bits(self, h):
        """float16 bits (int64 in [0, 2^16)) widened to float32 bits."""
        np = self._np
        with np.errstate(all="ignore"):
            return (h.astype(np.uint16).view(np.float16).astype(np.float32)
                    .view(np.uint32).astype(np.int64))

    def f32_to_f16_bits(self, u):
        """float32 bits (int64 in [0, 2^32)) to float16 bits, round to
        nearest even (NaN lanes: the caller decides)."""
        np = self._np
        with np.errstate(all="ignore"):
            return (u.astype(np.uint32).view(np.float32).astype(np.float16)
                    .view(np.uint16).astype(np.int64))

    # Float32 work (weightsync.fp8's quantisation): IEEE float32 division
    # and comparisons are the same in both; these are what is spelt apart.
    def f32_bits(self, x):
        """float32 bits of a float32 array as int64 in [0, 2^32)."""
        return self._np.ascontiguousarray(x, self._np.float32).view(self._np.uint32).astype(
            self._np.int64)

    def f32_from_bits(self, u):
        """float32 array of int64 lanes holding float32 bits."""
        return u.astype(self._np.uint32).view(self._np.float32)

    def zeros(self, shape, kind, like=None):
        """Zeros of `kind` ("float32", "bool", "int64") where `like` is."""
        return self._np.zeros(shape, {"float32": self._np.float32, "bool": bool,
                                      "int64": self._np.int64}[kind])

    def full_like(self, x, value):
        return self._np.full_like(x, value)

    def clip(self, x, lo, hi=None):
        return self._np.clip(x, lo, hi) if hi is not None else self._np.maximum(x, lo)

    def amax_blocks(self, x4):
        """Max over axes 1 and 3 of a 4-D array (blocks of a padded grid)."""
        return x4.max(axis=(1, 3))

    def to_uint8(self, x):
        return x.astype(self._np.uint8)

    def errstate(self):
        return self._np.errstate(all="ignore")


class TorchOps:
    name = "torch"

    def __init__(self):
        import torch
        self._t = torch
        self.int64, self.int32, self.uint8 = torch.int64, torch.int32, torch.uint8
        self._ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

    def int_dtype(self, width):
        return self._ints[width]

    def itemsize(self, x):
        return x.element_size()

    def flat(self, x):
        return x.detach().contiguous().reshape(-1)

    def contiguous(self, x):
        y = x.contiguous()
        # A tensor of one element counts as contiguous whatever its stride
        # (a one-element patch's every-other-int32 index view has stride 2),
        # but .view() as a dtype of another size needs a last stride of 1.
        if y.dim() and y.stride(-1) != 1:
            y = self._t.empty(y.shape, dtype=y.dtype, device=y.device).copy_(y)
        return y

    def arange(self, n, like=None):
        return self._t.arange(n, dtype=self._t.int64,
                              device=like.device if like is not None else None)

    def where(self, cond, a, b):
        return self._t.where(cond, a, b)

    def count(self, mask):
        return int(self._t.count_nonzero(mask))

    def nonzero(self, mask):
        # Row-major order: increasing for a 1-D mask.
        return self._t.nonzero(mask).reshape(-1)

    def cat(self, parts):
        return self._t.cat(parts)

    def to_int64(self, x):
        return x.to(self._t.int64)

    def to_int(self, scalar):
        return int(scalar)

    def f16_to_f32_bits(self, h):
        t = self._t
        h16 = ((h ^ 0x8000) - 0x8000).to(t.int16)   # the same 16 bits, signed
        return h16.view(t.float16).to(t.float32).view(t.int32).to(t.int64) & MASK32

    def f32_to_f16_bits(self, u):
        t = self._t
        u32 = ((u ^ 0x80000000) - 0x80000000).to(t.int32)   # the same 32 bits, signed
        return u32.view(t.float32).to(t.float16).view(t.int16).to(t.int64) & 0xFFFF

    def f32_bits(self, x):
        t = self._t
        return x.contiguous().view(t.int32).to(t.int64) & MASK32

    def f32_from_bits(self, u):
        t = self._t
        return ((u ^ 0x80000000) - 0x80000000).to(t.int32).view(t.float32)

    def zeros(self, shape, kind, like=None):
        t = self._t
        return t.zeros(shape, dtype={"float32": t.float32, "bool": t.bool,
                                     "int64": t.int64}[kind],
                       device=like.device if like is not None else None)

    def full_like(self, x, value):
        # A tensor, never a Python scalar operand: CUDA divides by a CPU
        # scalar as a multiplication by its reciprocal (not IEEE division).
        return self._t.full_like(x, value)

    def clip(self, x, lo, hi=None):
        return self._t.clamp(x, min=lo, max=hi)

    def amax_blocks(self, x4):
        return x4.amax(dim=(1, 3))

    def to_uint8(self, x):
        return x.to(self._t.uint8)

    def errstate(self):
        import contextlib
        return contextlib.nullcontext()
