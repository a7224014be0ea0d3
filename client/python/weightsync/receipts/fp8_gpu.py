"""FP8 targets' receipts on the trainer's GPU in one fused Triton kernel:
for every written block of an FP8 parameter (block_rows x block_cols, or
1 x cols per row) it reads the sent source elements, widens them exactly
(integer bit operations: NaN keeps sign and payload), takes amax over the
finite |x|, d = amax / FMAX (correctly rounded: tl.math.div_rn), 1 where
that is 0, encodes q = x / d with weightsync.fp8.to_fp8's integer round to
nearest even and saturation (ported to int32 lanes), stores d or 1 / d,
and adds the receipt terms of the written FP8 bytes and of the block's
scale to one int64 sum, exactly weightsync.fp8.quantized_receipt (the
reference; the torch path runs it with torch ops where Triton is missing
or WEIGHTSYNC_FP8_TRITON=0). tests/gpu/check_fp8_triton_gpu.py checks it
against the numpy reference on a GPU.

The tables (built on the host by numpy, `plan`, tested in CI by
`emulate`, a numpy run of what the kernel does with them):

  block (int64 x 12): first piece, pieces, flat block index in the
    parameter's scale grid, salt32(parameter), salt32(scale parameter),
    mantissa bits, bias, largest finite encoding, NaN encoding, FMAX bits,
    reciprocal, 0
  piece (int64 x 6): source address of its first element, source row
    stride (elements), rows, cols, destination index of its first element,
    destination row stride (the parameter's cols)

A piece is one source rectangle inside one block (a segment cut at block
boundaries); a block has one or more (a segment not on block boundaries
shares a block with another). Only written elements are read and summed;
unwritten ones of a written block count as zeros in its amax, as in
fp8._image. Parameters the tables can't express exactly go to the torch
path (returned as `rest`): segments whose destination isn't a rectangle
of the parameter's [rows, cols] grid, overlapping segments, a block fed by
sources of different dtypes, sources that aren't contiguous float32 /
bfloat16 / float16 tensors or are shorter than the parameter.

Blocks of one piece of at most TILE_R x TILE_C elements whose indices
share their upper 32 bits (every block of a Llama/Qwen linear layer) take
the tile kernel: one program per block reads it in TILE_RB-row tiles
(16-byte vectors where the piece's address and row stride allow) twice:
the amax, then the terms. It divides by Fp8Divider's step (bfloat16 /
float16) or tl.math.div_rn, encodes by the hardware's round-to-nearest-even
conversion into the format (cvt satfinite; NaN and |q| >= FMAX take
to_fp8's answers explicitly, as the daemon's "cvt" kernel does) and sums
the terms with 32-bit keys in an int64 tile. Launches of whole tiles
(TILE_FULL) carry no masks; a block without inf or NaN (TILE_FINITE_FAST)
takes the conversion's bytes alone (its saturation is to_fp8's for finite
q); of a 16-bit source's whole aligned tiles the first read takes 32-bit
words, one bf16x2 / f16x2 max with NaN kept a word (TILE_PACKED; the
daemon's VecTop). One launch per (source dtype, format, aligned, whole).
The rest take the general kernel: one launch per source dtype, one program
per block, two passes over the block's pieces (amax, then encodings: the
second read comes from cache), to_fp8's rounding in integer lanes.
WEIGHTSYNC_FP8_TILE=0 sends every block to the general kernel.
"""

import collections
import os
import threading

import numpy as np

from weightsync import _xp
from weightsync.receipts import core, fp8

TILE = 2048
NUM_WARPS = 4
TILE_R = TILE_C = 128
TILE_RB = 8        # rows per step (TILE_R: the block held at once)
TILE_WARPS = 4
TILE_FAST_DIV = True   # Fp8Divider for bfloat16 / float16 sources
TILE_FULL = True       # launches of whole 128 x 128 tiles without masks
TILE_FINITE_FAST = True   # blocks without inf / NaN: the hardware encoding alone
TILE_PACKED = True     # 16-bit sources' first read in 32-bit words (bf16x2 / f16x2 max)
TCOLS = 10
_DTYPES = {"FLOAT32": 0, "BFLOAT16": 1, "FLOAT16": 2}
_ES = {"FLOAT32": 4, "BFLOAT16": 2, "FLOAT16": 2}
BCOLS, PCOLS = 12, 6
_PLANS = 8

_kernel = None
_checked = None
_plans = collections.OrderedDict()
_lock = threading.Lock()


def enabled():
    """Triton importable and WEIGHTSYNC_FP8_TRITON not "0"."""
    global _checked
    if os.environ.get("WEIGHTSYNC_FP8_TRITON", "1") == "0":
        return False
    if _checked is None:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401 - the kernel's module
            _checked = True
        except Exception:  # noqa: BLE001 - any import failure: no Triton
            _checked = False
    return _checked


# --- Tables (numpy; CI) ---------------------------------------------------

def _numel(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _rects(p, meta, rows, cols):
    """[(dtype, source address of the first element, source row stride,
    first row, first col, rows, cols)] of the rectangles of p's [rows,
    cols] grid that sent sources write, or None where that isn't exact
    (module docstring). meta: {name: (dtype, shape, address, ok)}."""
    out = []
    segments = list(p.segments)
    if not segments:
        if p.name not in meta:
            return out
        dtype, shape, addr, ok = meta[p.name]
        if not ok or dtype not in _DTYPES or _numel(shape) < rows * cols:
            return None
        if rows * cols:
            out.append((dtype, addr, cols, 0, 0, rows, cols))
        return out
    for s in segments:
        if s.source not in meta:
            continue
        dtype, shape, addr, ok = meta[s.source]
        if not ok or dtype not in _DTYPES:
            return None
        rc, cc = int(s.row_count), int(s.col_count)
        if rc * cc == 0:
            continue
        shape = list(shape)
        scols = _numel(shape[1:])
        srows = int(shape[0]) if shape else 1
        if s.row_begin + rc > srows or s.col_begin + cc > scols:
            return None
        stride = s.dest_row_stride or cc
        r0, c0 = divmod(int(s.dest_offset), cols)
        if c0 + cc > cols or r0 + rc > rows or (rc > 1 and stride != cols):
            return None
        out.append((dtype, addr + (s.row_begin * scols + s.col_begin) * _ES[dtype], scols,
                    r0, c0, rc, cc))
    for i, a in enumerate(out):
        for b in out[:i]:
            if (a[3] < b[3] + b[5] and b[3] < a[3] + a[5]
                    and a[4] < b[4] + b[6] and b[4] < a[4] + a[6]):
                return None
    return out


def _pieces(rects, br, bc, cols):
    """(dtype codes, piece rows [n, 6], block ids) of rectangles cut at
    block boundaries."""
    gc = -(-cols // bc)
    codes, tables, ids = [], [], []
    for dtype, addr, sstride, r0, c0, rc, cc in rects:
        bi = np.arange(r0 // br, (r0 + rc - 1) // br + 1, dtype=np.int64)
        bj = np.arange(c0 // bc, (c0 + cc - 1) // bc + 1, dtype=np.int64)
        i, j = (a.reshape(-1) for a in np.meshgrid(bi, bj, indexing="ij"))
        rlo, rhi = np.maximum(r0, i * br), np.minimum(r0 + rc, (i + 1) * br)
        clo, chi = np.maximum(c0, j * bc), np.minimum(c0 + cc, (j + 1) * bc)
        t = np.empty((i.size, PCOLS), np.int64)
        t[:, 0] = addr + ((rlo - r0) * sstride + (clo - c0)) * _ES[dtype]
        t[:, 1] = sstride
        t[:, 2] = rhi - rlo
        t[:, 3] = chi - clo
        t[:, 4] = rlo * cols + clo
        t[:, 5] = cols
        tables.append(t)
        ids.append(i * gc + j)
        codes.append(np.full(i.size, _DTYPES[dtype], np.int64))
    return np.concatenate(codes), np.concatenate(tables), np.concatenate(ids)


def plan(quantized, meta):
    """({dtype: (block table [b, 12], piece table [n, 6])}, checksum-free
    counts (parameters, bytes), rest) of quantised parameters whose sources
    `meta` describes ({name: (dtype, shape, address, ok)}; ok: contiguous
    elements of that dtype at address). rest: the parameters the tables
    can't express (module docstring), for the torch path."""
    from weightsync.receipts.core import salt32
    per = {}
    params = nbytes = 0
    rest = []
    for p in quantized:
        if not any(n in meta for n in fp8.sources(p)):
            continue
        br, bc, rows, cols = fp8.block_shape(p)
        rects = _rects(p, meta, rows, cols)
        if rects is None:
            rest.append(p)
            continue
        if not rects:
            continue
        codes, pieces, ids = _pieces(rects, br, bc, cols)
        order = np.argsort(ids, kind="stable")
        codes, pieces, ids = codes[order], pieces[order], ids[order]
        uniq, first, count = np.unique(ids, return_index=True, return_counts=True)
        block_code = codes[first]
        if not np.array_equal(np.repeat(block_code, count), codes):
            rest.append(p)   # a block fed by two source dtypes
            continue
        qz = p.quantization
        fmt = fp8.enum_name("DType", qz.format)
        reciprocal = fp8.enum_name("ScaleForm", qz.scale_form) == "SCALE_FORM_RECIPROCAL"
        mb, bias, max_bits, nan_bits, fmax_bits = fp8.SPEC[fmt]
        params += 2
        nbytes += int((pieces[:, 2] * pieces[:, 3]).sum()) + 4 * int(uniq.size)
        for code in np.unique(block_code).tolist():
            sel = block_code == code
            psel = np.repeat(sel, count)
            b = np.zeros((int(sel.sum()), BCOLS), np.int64)
            cnt = count[sel]
            b[:, 0] = np.cumsum(cnt) - cnt
            b[:, 1] = cnt
            b[:, 2] = uniq[sel]
            b[:, 3] = salt32(p.name)
            b[:, 4] = salt32(qz.scale_parameter)
            b[:, 5:11] = (mb, bias, max_bits, nan_bits, fmax_bits, int(reciprocal))
            per.setdefault(code, []).append((b, pieces[psel]))
    tables = {}
    for code, parts in per.items():
        blocks, pieces, base = [], [], 0
        for b, pc in parts:
            b = b.copy()
            b[:, 0] += base
            base += pc.shape[0]
            blocks.append(b)
            pieces.append(pc)
        tables[code] = (np.concatenate(blocks), np.concatenate(pieces))
    return tables, (params, nbytes), rest


def emulate(tables, memory):
    """The kernel's sum (int, mod 2^64) over `tables` in numpy, reading
    sources from `memory` ({base address: flat uint8 array}; a piece's
    address lies in one). What CI checks the tables by."""
    code_dtype = {v: k for k, v in _DTYPES.items()}
    bases = sorted(memory)
    total = 0

    def read(addr, dtype, n):
        base = max(b for b in bases if b <= addr)
        off = addr - base
        return memory[base][off:off + n * _ES[dtype]]

    for code, (blocks, pieces) in tables.items():
        dtype = code_dtype[code]
        for b in blocks:
            vals, idxs = [], []
            for k in range(b[0], b[0] + b[1]):
                addr, sstride, pr, pc, dest, dstride = (int(v) for v in pieces[k])
                for r in range(pr):
                    raw = read(addr + r * sstride * _ES[dtype], dtype, pc)
                    vals.append(core.to_float32(np.ascontiguousarray(raw), dtype))
                    idxs.append(dest + r * dstride + np.arange(pc, dtype=np.int64))
            x = np.concatenate(vals)
            index = np.concatenate(idxs)
            mb, bias, max_bits, nan_bits, fmax_bits, rec = (int(v) for v in b[5:11])
            fmt = next(f for f, s in fp8.SPEC.items() if s[0] == mb and s[1] == bias)
            with np.errstate(all="ignore"):
                mag = np.abs(x)
                mag = np.where(mag < np.float32(np.inf), mag, np.float32(0))
                amax = np.float32(max(mag.max(), np.float32(0)))
                d = np.float32(amax / np.float32(fp8.FMAX[fmt]))
                d = np.float32(1) if d == 0 else d
                q = np.where(x != x, x, x / d).astype(np.float32)
                stored = np.float32(np.float32(1) / d) if rec else d
            enc = fp8.to_fp8(q, fmt).astype(np.int64)
            total += fp8.terms_sum(_xp.NumpyOps(), enc, index, int(b[3]))
            sb = np.array([stored], np.float32).view(np.uint32).astype(np.int64)
            total += fp8.terms_sum(_xp.NumpyOps(), sb, np.array([int(b[2])], np.int64),
                                    int(b[4]))
    return total & 0xFFFFFFFFFFFFFFFF


def split(tables, tile_r=TILE_R, tile_c=TILE_C):
    """`plan`'s tables split between the two kernels: ({(dtype code, e5m2,
    aligned): tile rows [n, TCOLS]}, {dtype code: (blocks, pieces)} for the
    general kernel). A tile row: source address, source row stride,
    rows, cols, destination index, destination row stride (the piece's),
    then flat scale index, salt32(parameter), salt32(scale parameter),
    reciprocal (the block's). Tile blocks: one piece of at most tile_r x
    tile_c whose first and last destination index share their upper 32
    bits; aligned: the piece's address and row stride in whole 16-byte
    vectors."""
    tiles, general = {}, {}
    code_es = {_DTYPES[k]: v for k, v in _ES.items()}
    for code, (blocks, pieces) in tables.items():
        one = blocks[:, 1] == 1
        pc = pieces[blocks[:, 0]]
        last = pc[:, 4] + (pc[:, 2] - 1) * pc[:, 5] + pc[:, 3] - 1
        fast = (one & (pc[:, 2] <= tile_r) & (pc[:, 3] <= tile_c)
                & ((pc[:, 4] >> 32) == (last >> 32)))
        if os.environ.get("WEIGHTSYNC_FP8_TILE", "1") == "0":
            fast[:] = False
        es = code_es[code]
        aligned = (pc[:, 0] % 16 == 0) & ((pc[:, 1] * es) % 16 == 0)
        e5m2 = blocks[:, 5] == fp8.SPEC["FLOAT8_E5M2"][0]
        for e in (False, True):
            for a in (False, True):
                sel = fast & (e5m2 == e) & (aligned == a)
                if not sel.any():
                    continue
                t = np.empty((int(sel.sum()), TCOLS), np.int64)
                t[:, 0:6] = pc[sel]
                t[:, 6:9] = blocks[sel][:, 2:5]
                t[:, 9] = blocks[sel][:, 10]
                tiles[(code, e, a)] = t
        if (~fast).any():
            general[code] = (blocks[~fast], pieces)
    return tiles, general


def unsplit(tiles, general):
    """`plan`-form tables of `split`'s output (each tile row back as a block
    of one piece), for `emulate`: what CI checks the split by."""
    out = {}
    for code, (blocks, pieces) in general.items():
        out[code] = [blocks.copy()], [pieces]
    for (code, e5m2, _), t in sorted(tiles.items()):
        blocks_l, pieces_l = out.setdefault(code, ([], []))
        base = sum(p.shape[0] for p in pieces_l)
        spec = fp8.SPEC["FLOAT8_E5M2" if e5m2 else "FLOAT8_E4M3FN"]
        b = np.zeros((t.shape[0], BCOLS), np.int64)
        b[:, 0] = base + np.arange(t.shape[0])
        b[:, 1] = 1
        b[:, 2:5] = t[:, 6:9]
        b[:, 5:10] = spec
        b[:, 10] = t[:, 9]
        blocks_l.append(b)
        pieces_l.append(t[:, 0:6])
    merged = {}
    for code, (blocks_l, pieces_l) in out.items():
        # The general blocks index the whole piece table of their code,
        # which comes first.
        merged[code] = (np.concatenate(blocks_l), np.concatenate(pieces_l))
    return merged


# --- Kernel (Triton; the GPU) ----------------------------------------------

def _build():
    """The kernels (compiled by Triton at their first launch)."""
    from weightsync.receipts import fp8_gpu_kernels
    return fp8_gpu_kernels.fp8_receipt_kernel, fp8_gpu_kernels.fp8_tile_kernel


def _meta(sent, names):
    meta = {}
    for name in names:
        if name not in sent:
            continue
        dtype, shape, t = sent[name][:3]
        ok = bool(t.is_contiguous()) and dtype in _DTYPES
        meta[name] = (dtype, tuple(int(d) for d in shape), int(t.data_ptr()), ok)
    return meta


def _device_plan(quantized, sent):
    """(device, [(dtype code, blocks, pieces)] on the device, counts, rest),
    kept by the parameters' identity and the sources' (name, dtype,
    address, shape)."""
    import torch
    names = sorted({n for p in quantized for n in fp8.sources(p) if n in sent})
    key = (tuple(id(p) for p in quantized),
           tuple((n, sent[n][0], sent[n][2].data_ptr(), tuple(sent[n][1])) for n in names))
    with _lock:
        got = _plans.get(key)
        if got is not None:
            _plans.move_to_end(key)
            return got[1]
    device = sent[names[0]][2].device
    tables, counts, rest = plan(quantized, _meta(sent, names))
    tiles, general = split(tables)
    launches = [(code, None, torch.from_numpy(b).to(device), torch.from_numpy(pc).to(device))
                for code, (b, pc) in sorted(general.items())]
    for (code, e5m2, aligned), t in sorted(tiles.items()):
        # Whole tiles (every Llama/Qwen block) in a launch without masks.
        full = ((t[:, 2] == TILE_R) & (t[:, 3] == TILE_C)) if TILE_FULL else np.zeros(
            t.shape[0], bool)
        for f in (True, False):
            if (full == f).any():
                launches.append((code, (e5m2, aligned, f),
                                 torch.from_numpy(np.ascontiguousarray(t[full == f])).to(device),
                                 None))
    value = (device, launches, counts, rest)
    with _lock:
        _plans[key] = (quantized, value)   # the parameters held: their ids are in the key
        while len(_plans) > _PLANS:
            _plans.popitem(last=False)
    return value


def quantized_receipt_gpu(quantized, sent):
    """(checksum, parameters, bytes, rest): weightsync.fp8.quantized_receipt
    of the quantised parameters whose sent sources are CUDA tensors of one
    device, by the fused kernel, except `rest` (module docstring), which
    the caller sums with the torch path. Runs on the current stream and
    waits for it."""
    global _kernel
    if not any(n in sent for p in quantized for n in fp8.sources(p)):
        return 0, 0, 0, []
    if _kernel is None:
        _kernel = _build()
    device, launches, (params, nbytes), rest = _device_plan(list(quantized), sent)
    out = _launch(device, launches)
    total = int(out.item()) & 0xFFFFFFFFFFFFFFFF
    return total, params, nbytes, rest


def _launch(device, launches):
    """Starts `launches` (_device_plan's) on the current stream; the device
    int64 their sums go to."""
    import torch
    import triton.language as tl
    out = torch.zeros(1, dtype=torch.int64, device=device)
    raw = {0: tl.uint32, 1: tl.uint16, 2: tl.uint16}
    general, tile = _kernel
    for code, tile_of, blocks, pieces in launches:
        if tile_of is None:
            general[(blocks.shape[0],)](blocks, pieces, out, SRC=code, RAW=raw[code],
                                        TILE=TILE, num_warps=NUM_WARPS)
        else:
            e5m2, aligned, full = tile_of
            _, _, max_bits, nan_bits, fmax_bits = fp8.SPEC[
                "FLOAT8_E5M2" if e5m2 else "FLOAT8_E4M3FN"]
            tile[(blocks.shape[0],)](blocks, out, SRC=code, RAW=raw[code], E5M2=e5m2,
                                     FMAX_BITS=fmax_bits, MAX_BITS=max_bits, NAN_BITS=nan_bits,
                                     VEC=(4 if code == 0 else 8) if aligned else 1,
                                     C=TILE_C, RB=TILE_RB,
                                     FAST_DIV=TILE_FAST_DIV and code != 0,
                                     FULL=full, FINITE_FAST=TILE_FINITE_FAST,
                                     PACKED=(TILE_PACKED and full and aligned and code != 0
                                             and TILE_FINITE_FAST),
                                     num_warps=TILE_WARPS)
    return out


def prepared_receipt_gpu(quantized, sent):
    """quantized_receipt_gpu's plan, for a caller that keys it by the
    sources' placement itself (Trainer: the registered source's number and
    the engine's layout id) and so builds nothing per tensor on later
    updates: a handle for start_prepared, or None where the kernels would
    not cover every parameter fed by `sent` (sources off the GPU, on two
    devices, or `rest`): the caller takes the general path then."""
    global _kernel
    if not enabled():
        return None
    names = {n for p in quantized for n in fp8.sources(p) if n in sent}
    if not names:
        return None
    feeds = [sent[n][2] for n in names]
    if not all(getattr(t, "is_cuda", False) for t in feeds) or len(
            {t.device for t in feeds}) != 1:
        return None
    if _kernel is None:
        _kernel = _build()
    device, launches, counts, rest = _device_plan(list(quantized), sent)
    return None if rest else (device, launches, counts)


def start_prepared(handle):
    """Starts a prepared_receipt_gpu handle's kernels on the current stream;
    returns a function that waits for them and gives (checksum, parameters,
    bytes), as quantized_receipt_gpu would."""
    device, launches, (params, nbytes) = handle
    out = _launch(device, launches)
    return lambda: (int(out.item()) & 0xFFFFFFFFFFFFFFFF, params, nbytes)


def _pow2(n):
    return 1 << max(0, int(n) - 1).bit_length()


def quantize_gpu(raw, dtype, block_rows, block_cols, fmt, reciprocal):
    """(payload, encodings, stored scales) of `raw`, a contiguous 2-D
    float32 / bfloat16 / float16 CUDA tensor, quantised on its device
    (current stream): weightsync.receipts.fp8.quantize bit for bit, a
    block a program. Per row: block_rows=1, block_cols=cols. The payload
    is FP8 on the wire's (docs/protocol.md): the uint8 encodings, zeros to
    a multiple of 4, the float32 scales; the encodings ([rows, cols]) and
    the scales ([ceil(rows / block_rows), ceil(cols / block_cols)]) are
    views of it."""
    return quantize_gpu_many([(raw, dtype, block_rows, block_cols, fmt, reciprocal)])[0]


def quantize_gpu_many(items):
    """[quantize_gpu(*item)] of many (raw, dtype, block_rows, block_cols,
    fmt, reciprocal) at once: the tensors of one device, source dtype and
    form whose blocks fp8_wire_tile_kernel takes go in one launch over a
    table of them (one Python launch a tensor cost ~80 us: more than the
    kernel), their payloads in one allocation, each at a multiple of 256
    bytes; the others one fp8_wire_kernel launch each."""
    import torch
    from weightsync.receipts import fp8_gpu_kernels
    out = [None] * len(items)
    groups = collections.OrderedDict()
    for i, (raw, dtype, br, bc, fmt, rec) in enumerate(items):
        tiled = WIRE_TILE and _tiled(br, bc)
        key = (raw.device, dtype, br, bc, fmt, bool(rec)) if tiled else i
        groups.setdefault(key, []).append(i)
    for key, members in groups.items():
        sizes = []
        for i in members:
            rows, cols = (int(d) for d in items[i][0].shape)
            n, br, bc = rows * cols, items[i][2], items[i][3]
            sizes.append((rows, cols, n, -n % 4, -(-rows // br), -(-cols // bc)))
        offsets, total = [], 0
        for rows, cols, n, pad, gr, gc in sizes:
            offsets.append(total)
            total += (n + pad + 4 * gr * gc + 255) // 256 * 256
        raw0, dtype, br, bc, fmt, rec = items[members[0]]
        buf = torch.empty(max(total, 1), dtype=torch.uint8, device=raw0.device)
        views = []
        for i, (rows, cols, n, pad, gr, gc), off in zip(members, sizes, offsets):
            payload = buf[off:off + n + pad + 4 * gr * gc]
            if pad:
                payload[n:n + pad] = 0
            views.append((payload, payload[:n].view(rows, cols),
                          payload[n + pad:].view(torch.float32).view(gr, gc)))
            out[i] = views[-1]
        code = _DTYPES[dtype]
        mb, bias, max_bits, nan_bits, fmax_bits = fp8.SPEC[fmt]
        with torch.cuda.device(raw0.device):
            if isinstance(key, tuple):
                _launch_tiles([items[i][0] for i in members], sizes, views, code, fmt, rec, br,
                              bc, max_bits, nan_bits, fmax_bits)
            elif sizes[0][2]:
                rows, cols, n, pad, gr, gc = sizes[0]
                c = min(1024, _pow2(bc))
                bits = raw0.view(torch.int32 if code == 0 else torch.int16)
                fp8_gpu_kernels.fp8_wire_kernel[(gr * gc,)](
                    bits, views[0][1], views[0][2], rows, cols, br, bc, gc, mb, bias,
                    max_bits, nan_bits, fmax_bits, SRC=code, REC=bool(rec),
                    RB=max(1, min(_pow2(br), 4096 // c)), C=c, num_warps=NUM_WARPS)
    return out


def _launch_tiles(raws, sizes, views, code, fmt, rec, br, bc, max_bits, nan_bits,
                  fmax_bits):
    """One fp8_wire_tile_kernel launch over the tensors `raws` (sizes and
    payload views as quantize_gpu_many made them)."""
    import torch
    from weightsync.receipts import fp8_gpu_kernels
    tab, first = [], 0
    for raw, (rows, cols, n, pad, gr, gc), (_, enc, scales) in zip(raws, sizes, views):
        if n:
            tab.append([raw.data_ptr(), rows, cols, gc, enc.data_ptr(), scales.data_ptr(),
                        first, 0])
            first += gr * gc
    if not tab:
        return
    table = torch.from_numpy(np.array(tab, dtype=np.int64)).to(raws[0].device)
    fp8_gpu_kernels.fp8_wire_tile_kernel[(first,)](
        table, len(tab), SRC=code, E5M2=fmt == "FLOAT8_E5M2", FMAX_BITS=fmax_bits,
        MAX_BITS=max_bits, NAN_BITS=nan_bits, REC=bool(rec), BR=br, BC=bc,
        RB=min(br, WIRE_RB), FAST_DIV=TILE_FAST_DIV and code != 0,
        STEPS=max(0, len(tab) - 1).bit_length(), num_warps=WIRE_WARPS)
    # `table` may go now: the caching allocator hands its memory only to
    # work queued after this launch on the same stream.


# FP8 on the wire: blocks of powers of two up to 256 columns take
# fp8_wire_tile_kernel; False: every block fp8_wire_kernel.
WIRE_TILE = os.environ.get("WEIGHTSYNC_FP8_TILE", "1") != "0"
WIRE_RB = 8          # rows of a tile (bench/wire_kernel_tune.py, bench/RESULTS.md)
WIRE_WARPS = 4


def _tiled(block_rows, block_cols):
    return (block_cols <= 256 and block_rows & (block_rows - 1) == 0
            and block_cols & (block_cols - 1) == 0)
