"""Receipts of a GPU update (nccl, ipc): the expectation computed on the GPU
from the tensors as sent, on the current stream of their device (after the
work that produced them, before update() returns and they may change).

With a plan key (a registered source's registration number, which changes
whenever a tensor moves) and the engine's layout id, the Triton kernel's
tables are kept, so an update of a source already checked against that
layout builds nothing per tensor. An FP8 engine's plain parameters go
through the same kernel; its quantised ones through weightsync.receipts.fp8_gpu.
"""

import time


def partial_receipts(layouts, sent):
    """{layout key: checksum} of the tensors `sent` (torch, on the GPU) for
    each layout: one Triton launch per dtype pair over all of them, else
    torch int64 ops per layout (weightsync.receipts). Used by lazy updates,
    whose receipts are summed as tensors are made."""
    from weightsync import receipts
    from weightsync.receipts import gpu as receipts_gpu
    # FP8 layouts: their quantised part by weightsync.fp8 (the kernel has none).
    fp8 = {k: layout for k, layout in layouts.items() if receipts.has_fp8(layout)}
    out = {k: receipts.expected_receipt_arrays(layout, sent)[0] for k, layout in fp8.items()}
    rest = {k: layout for k, layout in layouts.items() if k not in fp8}
    if rest and receipts.all_cuda(sent) and receipts_gpu.available():
        gpu = receipts_gpu.expected_receipts_gpu(rest, sent, keep=False)
        out.update({k: v[0] for k, v in gpu.items()})
        return out
    out.update({k: receipts.expected_receipt_arrays(layout, sent)[0]
                for k, layout in rest.items()})
    return out


def _sent(manifest, flats):
    """sent() -> {name: (dtype, shape, elements)} of the tensors `flats` sent
    as `manifest` (sparse entries left out), built at the first call."""
    built = []

    def sent():
        if not built:
            from weightsync._gpu import elements
            built.append({m["name"]: (m["dtype"], m["shape"], elements(f, m["dtype"]))
                          for m, f in zip(manifest, flats) if not m.get("sparse_nnz")})
        return built[0]
    return sent


class GpuReceipts:
    """What a GPU sender keeps between updates to check receipts quickly:
    per layout id, whether it has FP8 targets and its (plain, quantised)
    split; per (plan key, layout id), weightsync.receipts.fp8_gpu's prepared
    kernel tables."""

    # early() computes the expectation beside the transfer; False: nothing
    # early, all after it (bench/python_bench.py's "late" rows, an A/B).
    EARLY = True

    def __init__(self):
        self._fp8 = {}       # layout_id -> whether it has FP8 targets
        self._split = {}     # layout_id -> (plain, quantised) parameters
        self._prepared = {}  # (plan_key, layout_id) -> prepared_receipt_gpu handle
        self._last_layout_ids = ()  # the engines' layouts at the last check

    def check(self, link, results, manifest, flats, plan_key=None, timings=None, early=None):
        """Checks `results` (link.check_receipts) against the expectation
        of the tensors `flats` sent as `manifest` (`early`: {layout id:
        expectation} already computed, see early()); adds the seconds it
        took to `timings` as receipts_s."""
        t = time.perf_counter()
        try:
            self._check(link, results, manifest, flats, plan_key, early or {})
        finally:
            self._last_layout_ids = tuple(sorted({
                r.layout_id for f in results for r in f.engines
                if r.layout_id and r.HasField("receipt")}))
            if timings is not None:
                timings["receipts_s"] = time.perf_counter() - t

    def early(self, link, manifest, flats, plan_key=None, timings=None):
        """{layout id: expectation} of the tensors `flats` sent as
        `manifest`, for the layouts the engines had at the last check (their
        layouts in link.layouts), computed now: called once the sends are
        enqueued, the kernels run on the tensors' stream beside the
        transfer on the communication stream, instead of after it. An
        engine registered again since has another layout id: check()
        computes that one after the transfer, as before. Adds the seconds
        to `timings` as early_receipts_s."""
        t = time.perf_counter()
        out = {}
        if self.EARLY and self._last_layout_ids and flats:
            compute = self._computer(manifest, flats, plan_key)
            for layout_id in self._last_layout_ids:
                layout = link.layouts.get(layout_id)
                if layout is None:
                    continue
                try:
                    out[layout_id] = compute(layout, layout_id)
                except Exception:  # noqa: BLE001 - the update is under way: the check
                    pass           # computes it after Finish and reports what fails
        if timings is not None:
            timings["early_receipts_s"] = time.perf_counter() - t
        return out

    def prepare(self, link, manifest, flats, plan_key):
        """Builds, ahead of the first check, the kernel tables of the
        registered source `plan_key` for every layout in link.layouts (the
        engines' layouts the warm start fetched): its first update then
        checks as a steady one does. Nothing without Triton."""
        fast = self._fast(flats, plan_key)
        if fast is None:
            return
        sent = _sent(manifest, flats)
        for layout_id, layout in list(link.layouts.items()):
            self._expected(fast, layout, layout_id, plan_key, sent)

    @staticmethod
    def _fast(flats, plan_key):
        """weightsync.receipts.gpu where the kept-table kernel applies, else None."""
        if plan_key is not None and flats and getattr(flats[0], "is_cuda", False):
            from weightsync.receipts import gpu as receipts_gpu
            if receipts_gpu.available():
                return receipts_gpu
        return None

    def _expected(self, fast, layout, layout_id, plan_key, sent):
        if self._has_fp8(layout, layout_id):
            return self._fp8_expected(fast, layout, layout_id, plan_key, sent)
        return fast.expected_receipts_gpu({0: layout}, sent, plan_key=(
            plan_key, layout_id) if layout_id else None)[0]

    def _computer(self, manifest, flats, plan_key):
        """expected(layout, layout_id) of the tensors `flats` sent as
        `manifest`: the kept-table kernel where it applies, else
        weightsync.receipts' arrays."""
        from weightsync.receipts import expected_receipt_arrays
        sent = _sent(manifest, flats)
        fast = self._fast(flats, plan_key)
        if fast is None:
            return lambda layout, layout_id: expected_receipt_arrays(layout, sent())
        return lambda layout, layout_id: self._expected(fast, layout, layout_id, plan_key, sent)

    def _check(self, link, results, manifest, flats, plan_key, early):
        compute = self._computer(manifest, flats, plan_key)
        link.check_receipts(results, lambda layout, layout_id: (
            early[layout_id] if layout_id in early else compute(layout, layout_id)), keyed=True)

    def _has_fp8(self, layout, layout_id):
        # Once per layout id (a pass over 100k parameters cost ~50 ms).
        from weightsync.receipts import has_fp8
        if not layout_id:
            return has_fp8(layout)
        if layout_id not in self._fp8:
            self._fp8[layout_id] = has_fp8(layout)
        return self._fp8[layout_id]

    def _fp8_expected(self, fast, layout, layout_id, plan_key, sent):
        """The plain parameters by the receipts kernel with the plan cached
        as for a layout without FP8 targets (keyed: nothing per tensor), the
        quantised ones by weightsync.receipts.fp8_gpu; the split once per layout id."""
        from weightsync.receipts import fp8
        from weightsync.receipts import quantized_where_sent
        split = self._split.get(layout_id) if layout_id else None
        if split is None:
            split = fp8.split_layout(layout)[:2]
            if layout_id:
                self._split[layout_id] = split
        plain, quant = split
        # The FP8 kernels' tables keyed like the plain plan (nothing per
        # tensor on a repeated update), started before the plain part.
        wait = self._fp8_started(quant, (plan_key, layout_id), sent) if layout_id else None
        c, n, b = fast.expected_receipts_gpu({0: plain}, sent, plan_key=(
            plan_key, layout_id, "plain") if layout_id else None)[0]
        if wait is not None:
            q_sum, q_params, q_bytes = wait()
        else:
            q_sum, q_params, q_bytes = quantized_where_sent(quant, sent())
        return (c + q_sum) & 0xFFFFFFFFFFFFFFFF, n + q_params, b + q_bytes

    def _fp8_started(self, quant, key, sent):
        from weightsync import receipts
        from weightsync.receipts import fp8_gpu
        if receipts.fp8_triton_failed():
            return None
        try:
            if key not in self._prepared:
                if len(self._prepared) > 16:
                    self._prepared.clear()
                self._prepared[key] = fp8_gpu.prepared_receipt_gpu(quant, sent())
            handle = self._prepared[key]
            return None if handle is None else fp8_gpu.start_prepared(handle)
        except Exception as e:  # noqa: BLE001 - the general path is exact too
            receipts.note_fp8_triton_failure(e)
            return None
