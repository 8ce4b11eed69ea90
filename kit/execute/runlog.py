"""The run's log, `<run>/kernel.log`: everything that would otherwise clutter the terminal.

- each kernel's stdout and stderr, as file descriptors: C-level prints (torch.profiler's
  `USDT: ... profiler_start`), ipykernel's own start-up warning ("Kernel is running over TCP
  without encryption", logged by IPKernelApp.init_sockets in the kernel process) and the
  subprocesses that inherit them (vLLM's engine processes in chapter 05);
- the headless run's papermill, nbclient, jupyter_client and traitlets loggers;
- what each notebook printed, each line marked with its code cell.

With `echo` (`python -m kit run --verbose`) the kernels' output and the loggers' warnings reach
the terminal (stderr) as well, as they did before the log existed.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import sys
import threading
from pathlib import Path

LOG_NAME = "kernel.log"
LOGGERS = ("papermill", "nbclient", "jupyter_client", "traitlets")
FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class RunLog:
    """`with RunLog(folder / LOG_NAME, echo) as log:` open for the whole run."""

    def __init__(self, path: Path, echo: bool = False):
        self.path, self.echo = Path(path), echo
        self.file = None
        self.saved = []

    def __enter__(self) -> RunLog:
        self.file = open(self.path, "a", buffering=1, encoding="utf-8", errors="replace")
        self.saved = route_loggers(self.handlers())
        return self

    def __exit__(self, *exc) -> None:
        restore_loggers(self.saved)
        self.file.close()

    def handlers(self) -> list[logging.Handler]:
        to_log = logging.StreamHandler(self.file)
        to_log.setFormatter(logging.Formatter(FORMAT))
        if not self.echo:
            return [to_log]
        to_terminal = logging.StreamHandler(sys.stderr)
        to_terminal.setLevel(logging.WARNING)  # what reached the terminal without a log
        return [to_log, to_terminal]

    def write(self, text: str) -> None:
        self.file.write(text)
        self.file.flush()

    def section(self, title: str) -> None:
        self.write(f"\n===== {dt.datetime.now():%Y-%m-%d %H:%M:%S} {title} =====\n")

    def printed(self, cell: int | None, name: str, text: str) -> None:
        """A notebook's stream output (`name`: stdout or stderr), each line marked."""
        mark = f"[cell {cell}{'' if name == 'stdout' else ' ' + name}] "
        self.write("".join(mark + line for line in text.splitlines(keepends=True))
                   + ("" if text.endswith("\n") else "\n"))

    @contextlib.contextmanager
    def kernel_output(self):
        """The file descriptor for a kernel's stdout and stderr: the log's, or with `echo` a
        pipe that a thread copies to the log and the terminal."""
        if not self.echo:
            yield self.file.fileno()
            return
        read, write = os.pipe()
        copier = threading.Thread(target=self._copy, args=(read,), daemon=True)
        copier.start()
        try:
            yield write
        finally:
            os.close(write)
            copier.join(timeout=10)  # subprocesses of the kernel may hold the pipe for longer

    def _copy(self, read: int) -> None:
        with open(read, "rb", buffering=0) as pipe:
            for chunk in iter(lambda: pipe.read(65536), b""):
                with contextlib.suppress(OSError, ValueError):  # the log closed under us
                    os.write(self.file.fileno(), chunk)
                    sys.stderr.write(chunk.decode(errors="replace"))
                    sys.stderr.flush()


def route_loggers(handlers: list[logging.Handler]) -> list[tuple]:
    """Send LOGGERS (INFO and up) to `handlers` only; returns what restore_loggers needs."""
    saved = []
    for name in LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level, logger.propagate, handlers))
        logger.setLevel(logging.INFO)
        logger.propagate = False
        for handler in handlers:
            logger.addHandler(handler)
    return saved


def restore_loggers(saved: list[tuple]) -> None:
    for logger, level, propagate, handlers in saved:
        for handler in handlers:
            logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
