"""vLLM's log, kept apart: its records collected with their times (`captured_vllm_log`, the
C-level lines on file descriptor 2 among them), its console lines muted, phases timed from it,
and a refusal turned into one line saying what to do."""
from __future__ import annotations

import contextlib
import logging
import time
import warnings

from kit.measure.fd_capture import fd2_captured


def fail_message(e: BaseException) -> str:
    """One line from an exception vLLM raised, with what the learner can do."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    errors = getattr(e, "errors", None)  # vLLM's configs are pydantic: take the first error
    if callable(errors):
        with contextlib.suppress(Exception):
            first = errors()[0]
            where = ".".join(str(x) for x in first.get("loc", ()))
            text = (f"{where}: " if where else "") + first["msg"].removeprefix("Value error, ")
    text = text.split(" Supported architectures")[0].rstrip(".")  # a list of hundreds follows
    if "not supported" in text or "architecture" in text.lower():
        return (f"vLLM cannot run this model: {text}. Use a Llama, Mistral, Qwen2 or Gemma "
                "config (data/models/).")
    if "block size" in text.lower():
        return (f"vLLM refused the block size: {text}. Its CPU attention takes multiples of 32 "
                "(128 by default); give block_size=32, 64 or 128.")
    if "memory" in text.lower():
        return (f"vLLM refused the memory settings: {text}. Give it a larger "
                "kv_cache_memory_bytes or a smaller max_model_len.")
    return f"vLLM could not start: {type(e).__name__}: {text}"


class _Capture(logging.Handler):
    """Collects vLLM's log records with their times."""

    def __init__(self, records: list):
        super().__init__(logging.DEBUG)
        self.records = records

    def emit(self, record):
        self.records.append(record)


def format_records(records) -> list[str]:
    return [f"{time.strftime('%H:%M:%S', time.localtime(r.created))}.{int(r.msecs):03d} "
            f"{r.levelname} [{r.name}] {r.getMessage()}" for r in records]


def phase_seconds(records, start: str, end: str) -> float | None:
    """Seconds between the first log record containing `start` and the next containing `end`."""
    t0 = next((r.created for r in records if start in r.getMessage()), None)
    if t0 is None:
        return None
    return next((r.created - t0 for r in records if r.created >= t0 and end in r.getMessage()),
                None)


def clear_once_caches() -> None:
    """Forget which "once" lines vLLM has logged (the KV cache size among them), so the next
    engine or sizing logs its own."""
    import vllm.logger as vlog
    for name in ("_print_debug_once", "_print_info_once", "_print_warning_once"):
        getattr(getattr(vlog, name, None), "cache_clear", lambda: None)()


def logged_once(call, contains: str) -> str | None:
    """Run `call()` and return the message of the first vLLM log record containing `contains`
    that it logged (its "once" caches cleared first, so a repeat logs again)."""
    records: list = []
    handler = _Capture(records)
    logger = logging.getLogger("vllm")
    clear_once_caches()
    logger.addHandler(handler)
    try:
        call()
    finally:
        logger.removeHandler(handler)
    return next((r.getMessage() for r in records if contains in r.getMessage()), None)


@contextlib.contextmanager
def captured_vllm_log(records: list, logging_config=None, echo: bool = False):
    """Collect vLLM's log records into `records`; silence its console handler unless `echo`.
    Unless `echo`, what C code writes to file descriptor 2 meanwhile (the CPU worker's
    NUMA-binding warning at each engine start) is kept too, appended as records of "stderr".

    vLLM configures its loggers once per process, at the first `LLM(...)` or engine config,
    which would replace the handlers seen here; applying that configuration first (its default,
    or `logging_config`) keeps ours and lets the console one be muted."""
    import vllm.logger as vlog
    from vllm.engine.arg_utils import EngineArgs
    with contextlib.suppress(Exception):
        vlog.configure_logging_if_needed(logging_config or EngineArgs().create_logging_config())
    clear_once_caches()  # "once" lines would be skipped on a second engine
    logger = logging.getLogger("vllm")
    handler = _Capture(records)
    # vLLM's Triton shim warns about a deprecated torch.distributed name on every engine start
    warnings.filterwarnings("ignore", message=".*reduce_op.*", category=FutureWarning)
    muted = [] if echo else [h for h in logger.handlers if isinstance(h, logging.StreamHandler)]
    levels = [h.level for h in muted]
    for h in muted:
        h.setLevel(logging.CRITICAL + 1)
    logger.addHandler(handler)
    c_lines: list[str] = []
    try:
        with contextlib.nullcontext() if echo else fd2_captured(c_lines):
            yield
    finally:
        logger.removeHandler(handler)
        for h, level in zip(muted, levels):
            h.setLevel(level)
        records.extend(logging.makeLogRecord({"name": "stderr", "levelname": "C-LEVEL",
                                              "msg": line}) for line in c_lines)
