"""The headless run's papermill engine, "kit" (papermill's word for how it executes a notebook):
papermill's nbclient engine with the kernel's stdout and stderr sent to a file descriptor
`kit.execute.notebooks` gives (the run's log, kit/execute/runlog.py) and
each code cell's start and each output reported to a `Watch` (the live line and the log).

The route is the libraries' own: papermill hands the extra keyword arguments of
`execute_notebook(..., engine_name="kit", kernel_output=FD, kernel_env=ENV, watch=W)` to the
engine; `NotebookClient.execute(**kw)` hands its keyword arguments to
`KernelManager.start_kernel`, which passes `stdout`, `stderr` and `env` on to the kernel's
`Popen`; nbclient calls `on_cell_execute` before each code cell and `process_message` for each
output.
"""
from __future__ import annotations

from papermill.clientwrap import PapermillNotebookClient
from papermill.engines import Engine, papermill_engines
from papermill.log import logger
from traitlets import Any

ENGINE_NAME = "kit"


def plain_text(output) -> tuple[str, str]:
    """(stream name or "display", text) of an output; ("", "") for errors and the like."""
    if output.get("output_type") == "stream":
        return output.get("name", "stdout"), "".join(output.get("text", ""))
    text = output.get("data", {}).get("text/plain", "")
    first = "".join(text).strip().splitlines()[:1]
    return ("display", first[0]) if first else ("", "")


class Watch:
    """Cells and outputs of one notebook, to its live line (`progress`) and the run's `log`."""

    def __init__(self, progress, log):
        self.progress, self.log = progress, log

    def cell_started(self, cell: int, cells: int) -> None:
        self.progress.cell_started(cell, cells)

    def output(self, cell: int | None, output) -> None:
        """Streams go to the log; stdout and displays to the live line (stderr, mostly warnings
        and C-level prints that ipykernel forwards, stays off it)."""
        name, text = plain_text(output)
        if name in ("stdout", "stderr"):
            self.log.printed(cell, name, text)
        if text and name != "stderr":
            self.progress.printed(text)


class WatchedClient(PapermillNotebookClient):
    """papermill's client, telling `watch` which code cell runs and what it printed."""

    watch = Any(None, allow_none=True)

    def __init__(self, nb_man, **kw):
        super().__init__(nb_man, **kw)
        self.code_cells = [i for i, c in enumerate(self.nb.cells) if c.cell_type == "code"]
        if self.watch is not None:
            self.on_cell_execute = self.cell_started

    def code_cell(self, cell_index: int) -> int | None:
        """1-based position among the code cells (papermill's injected parameters included)."""
        return self.code_cells.index(cell_index) + 1 if cell_index in self.code_cells else None

    def cell_started(self, cell, cell_index: int) -> None:
        self.watch.cell_started(self.code_cell(cell_index), len(self.code_cells))

    def process_message(self, msg, cell, cell_index):
        output = super().process_message(msg, cell, cell_index)
        if output is not None and self.watch is not None:
            self.watch.output(self.code_cell(cell_index), output)
        return output


class KitEngine(Engine):
    @classmethod
    def execute_managed_notebook(cls, nb_man, kernel_name, start_timeout=60,
                                 execution_timeout=None, kernel_output=None, kernel_env=None,
                                 watch=None, **_):
        """Run the notebook; the kernel's stdout and stderr go to `kernel_output` (a file
        descriptor or file; None: this process's), its environment is `kernel_env` (None:
        this process's)."""
        client = WatchedClient(nb_man, kernel_name=kernel_name, startup_timeout=start_timeout,
                               timeout=execution_timeout, log=logger, watch=watch)
        env = {"env": kernel_env} if kernel_env is not None else {}
        return client.execute(stdout=kernel_output, stderr=kernel_output, **env)


papermill_engines.register(ENGINE_NAME, KitEngine)
