"""torch.profiler without its C-level chatter: starting and stopping it prints
`USDT: ... profiler_start` and `... profiler_stop` straight to file descriptor 2, which
JupyterLab shows as an error-coloured box under the cell. `profiled(device)` silences the
descriptor for those two moments only (`kit.measure.fd_capture`), so what the profiled code itself
prints still shows."""
from __future__ import annotations

import contextlib

from torch.profiler import ProfilerActivity, profile

from kit.measure.fd_capture import fd2_captured


@contextlib.contextmanager
def profiled(device: str, **options):
    """`with profiled(device) as prof:` torch.profiler on the CPU (and CUDA on a GPU), quiet."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    prof = profile(activities=activities, **options)
    with fd2_captured():
        prof.__enter__()
    try:
        yield prof
    finally:
        with fd2_captured():
            prof.__exit__(None, None, None)
