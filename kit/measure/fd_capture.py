"""C-level writes to file descriptor 2 kept out of a notebook's output. In JupyterLab (and in
a run's executed notebooks) ipykernel forwards what C++ code writes to descriptor 2 as a
stderr output, an error-coloured box under the cell: torch.profiler's `USDT: ...` lines, or
the `NUMA binding` warning of vLLM's CPU worker at each engine start. `fd2_captured` sends
the descriptor to a temporary file for one block and hands its lines back (or drops them);
what Python code prints to `sys.stderr` still shows."""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile


@contextlib.contextmanager
def fd2_captured(lines: list[str] | None = None):
    """Until the block ends, file descriptor 2 writes to a temporary file; its lines are then
    appended to `lines` (dropped when None), whether the block raised or not."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if lines is not None:
                captured.seek(0)
                lines.extend(captured.read().decode(errors="replace").splitlines())
