"""What `python -m kit run` shows while a notebook runs: one live line per notebook on a terminal,
rewritten in place (the cell, elapsed seconds, the last line the notebook printed) and replaced
by the notebook's result line; plain lines, one at the start and one at the end, elsewhere.

    [5/6] 04_decode_timing · cell 5/25 · 41 s · timed run 2/3: eager, stock, ...
"""
from __future__ import annotations

import re
import shutil
import sys
import threading
import time

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
CLEAR_LINE = "\r\x1b[K"


def last_line(text: str) -> str:
    """The last non-empty line of printed text as a terminal would leave it (after a carriage
    return only what follows it), without colours or tabs; "" when there is none."""
    for line in reversed(ANSI.sub("", text).splitlines()):
        line = line.rsplit("\r", 1)[-1].replace("\t", " ").strip()
        if line:
            return "".join(ch for ch in line if ch.isprintable())
    return ""


def fit(text: str, width: int) -> str:
    """`text` cut to fit `width` columns, ending in an ellipsis when cut."""
    width = max(width, 2)
    return text if len(text) <= width else text[:width - 1] + "…"


def live_line(index: int, total: int, stem: str, cell: int | None, cells: int,
              seconds: float, last: str = "", width: int = 100) -> str:
    """The live line: which notebook, which code cell of how many, seconds since the notebook
    started, and the last line it printed, cut to `width` columns."""
    where = f"cell {cell}/{cells}" if cell else "starting the kernel"
    parts = [f"[{index}/{total}] {stem}", where, f"{seconds:.0f} s"]
    return fit(" · ".join(parts + ([last] if last else [])), width)


class Progress:
    """One notebook's line on `stream`: live (a ticker redraws it every `tick` seconds) when
    `animate`, else one plain line at the start and the result line at the end."""

    def __init__(self, index: int, total: int, stem: str, animate: bool, stream=None,
                 tick: float = 1.0):
        self.index, self.total, self.stem, self.animate = index, total, stem, animate
        self.stream = stream or sys.stdout
        self.cell, self.cells, self.last = None, 0, ""
        self.t0 = time.perf_counter()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.ticker = threading.Thread(target=self._tick, args=(tick,), daemon=True)

    def start(self) -> None:
        if self.animate:
            self.redraw()
            self.ticker.start()
        else:
            self._write(f"[{self.index}/{self.total}] {self.stem} ...\n")

    def cell_started(self, cell: int, cells: int) -> None:
        """A code cell (1-based among `cells` code cells) started."""
        self.cell, self.cells = cell, cells
        self.redraw()

    def printed(self, text: str) -> None:
        """The notebook printed `text` (a stream, or a display's plain text)."""
        line = last_line(text)
        if line:
            self.last = line
            self.redraw()

    def line(self) -> str:
        width = shutil.get_terminal_size().columns - 1
        return live_line(self.index, self.total, self.stem, self.cell, self.cells,
                         time.perf_counter() - self.t0, self.last, width)

    def redraw(self) -> None:
        if self.animate and not self.stop.is_set():
            self._write(CLEAR_LINE + self.line())

    def finish(self, result: str) -> None:
        """Replace the live line by the notebook's result line."""
        self.stop.set()
        if self.ticker.is_alive():
            self.ticker.join()
        self._write((CLEAR_LINE if self.animate else "") + result + "\n")

    def _tick(self, tick: float) -> None:
        while not self.stop.wait(tick):
            self.redraw()

    def _write(self, text: str) -> None:
        with self.lock:
            self.stream.write(text)
            self.stream.flush()
