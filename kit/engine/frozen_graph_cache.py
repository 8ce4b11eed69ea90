"""Inductor's FX graph cache for graphs whose frozen weights oneDNN has packed (the CPU's
compiled runners, `decode_runners.CPU_FREEZING`).

Inductor caches a compiled graph on disk and, for a graph with frozen weights, keys it by each
weight's shape and dtype, not its values: the entry holds the weights' names, and a hit takes the
values from the graph being compiled (torch/_inductor/output_code.py,
`CompiledFxGraphConstantsWithGm`). A weight that freezing packs for oneDNN becomes an mkldnn
tensor, and Inductor bypasses the cache for any graph holding one ("mkldnn tensors
unpickleable", torch/_inductor/codecache.py), a check older than the frozen-weights keying
(pytorch#117888, #143808): every such graph was generated again in every process, 10-13 s for
tiny's prefill or decode step on a 2-core Zen 4. Inside `packed_weights_cached()` a frozen
mkldnn weight is keyed as any other frozen weight (its shape and dtype) and so never needs
pickling; anything else is checked as Inductor checks it. The same graph's second compile then
loads the generated code, with the weights of the model compiling it (docs/measurements.md,
"The kit's compile cache on the CPU").
"""
from __future__ import annotations

import contextlib
from unittest import mock


def _frozen_mkldnn(t) -> bool:
    from torch._inductor.freezing_utils import is_frozen_param
    return t.is_mkldnn and is_frozen_param(t)


@contextlib.contextmanager
def packed_weights_cached():
    """Within: graphs whose frozen weights are oneDNN-packed are looked up in and saved to
    Inductor's FX graph cache. Does nothing where this torch lacks the key's pickler (its
    `_reduce_tensor` refuses mkldnn tensors in torch 2.11 and 2.13; 2.13 checks them first in
    `CacheabilityValidator.check_tensor` too)."""
    from torch._inductor import codecache
    pickler = getattr(codecache, "FxGraphCachePickler", None)
    if not hasattr(pickler, "_reduce_tensor"):
        yield
        return
    reduce = pickler._reduce_tensor

    def reduce_tensor(self, t):
        if _frozen_mkldnn(t):  # the key Inductor gives any frozen weight: no values
            return _same, (("frozen mkldnn", tuple(t.shape), t.dtype, t.device.type),)
        return reduce(self, t)

    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(pickler, "_reduce_tensor", reduce_tensor))
        validator = getattr(codecache, "CacheabilityValidator", None)
        if hasattr(validator, "check_tensor"):
            check = validator.check_tensor

            def check_tensor(t):
                if not _frozen_mkldnn(t):
                    check(t)
            patches.enter_context(
                mock.patch.object(validator, "check_tensor", staticmethod(check_tensor)))
        yield


def _same(x):
    return x
