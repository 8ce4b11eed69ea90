"""torch.profiler without its C-level chatter: starting and stopping it prints
`USDT: ... profiler_start` and `... profiler_stop` straight to file descriptor 2, which
JupyterLab shows as an error-coloured box under the cell. `profiled(device)` silences the
descriptor for those two moments only, so what the profiled code itself prints still shows."""
from __future__ import annotations

import contextlib
import os
import sys

from torch.profiler import ProfilerActivity, profile


@contextlib.contextmanager
def fd2_silenced():
    """File descriptor 2 goes to the null device until the block ends."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


@contextlib.contextmanager
def profiled(device: str, **options):
    """`with profiled(device) as prof:` torch.profiler on the CPU (and CUDA on a GPU), quiet."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    prof = profile(activities=activities, **options)
    with fd2_silenced():
        prof.__enter__()
    try:
        yield prof
    finally:
        with fd2_silenced():
            prof.__exit__(None, None, None)
