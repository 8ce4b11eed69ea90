"""A vLLM start-up log read as its users paste it: whatever prefixes its lines carry
(`(EngineCore_DP0 pid=…) INFO 10-03 16:22:17 [gpu_worker.py:298]`, the kit's own capture, or
none), in any order, other lines between. What the engine was asked (the non-default args and
the engine's config line) and every number it logged about memory and the KV cache, as logged,
for vLLM's wording from about 0.6 (the V0 engine) through 0.32. Plain text in, no vLLM
imported."""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

from kit.errors import ConfigError

NUM = r"(-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?)"
GIB = NUM + r" ?Gi?B"
# Each number the kit reads: its key, what it is, and the pattern whose groups hold it (a
# pattern without groups: a line whose presence is what the kit reads).
LINES = {
    "weights_gib": ("the weights loaded",
                    r"(?:Model loading took|Loading model weights took) " + GIB),
    "requested_gib": ("capacity × gpu_memory_utilization",
                      r"gpu_memory_utilization \(" + NUM + r"\) = " + GIB),
    "total_gpu_gib": ("the device's capacity", r"total_gpu_memory(?: \(|=)" + GIB),
    "profiled_weights_gib": ("the weights, as profiled",
                             r"(?:model weights take|weights memory:) " + GIB),
    "non_torch_gib": ("memory outside PyTorch",
                      r"(?:non_torch_memory takes |non_torch_memory=|non-torch forward increase memory: )"
                      + GIB),
    "activation_gib": ("the profiling run's activation peak",
                       r"(?:PyTorch activation peak memory takes|torch peak memory increase:) "
                       + GIB),
    "non_kv_gib": ("everything but the KV cache", r"Total non-KV cache memory: " + GIB),
    "available_kv_gib": ("the KV cache's memory",
                         r"(?:Available KV cache memory: |reserved for KV Cache is |kv_cache_size=)" + GIB),
    "gpu_blocks": ("the KV cache's blocks", r"GPU blocks: " + NUM),
    "cpu_kv_gib": ("the KV cache's memory (CPU)", r"Explicitly set \(" + NUM + r"/"),
    "cudagraph_estimate_gib": ("the CUDA graphs' estimated memory",
                               r"Estimated CUDA graph memory: " + GIB + " total"),
    "equivalent_utilization": ("gpu_memory_utilization without the CUDA graphs' estimate",
                               r"is equivalent to --gpu-memory-utilization=" + NUM),
    "attention_block_size": ("the attention block enlarged to a Mamba page",
                             r"Setting attention block size to " + NUM + " tokens"),
    "mamba_padding_pct": ("the Mamba page's padding", r"Padding mamba page size by " + NUM + "%"),
    "padding_layers": ("padding layers added to a group",
                       r"Add " + NUM + r" padding layers, may waste at most " + NUM + "%"),
    "kv_cache_tokens": ("the KV cache's size in tokens",
                        r"(?:GPU|CPU|XPU|TPU|HPU|NPU)(?: \+ host)? KV cache size: " + NUM
                        + " tokens"),
    "max_concurrency": ("the maximum concurrency",
                        r"Maximum concurrency for " + NUM + r" tokens per request: " + NUM + "x"),
    "graph_capture_gib": ("the CUDA graphs, as captured",
                          r"Graph capturing finished in " + NUM + r" secs?, took " + GIB),
    "mamba_blocks_refusal": ("max_num_seqs above the Mamba state blocks",
                             r"max_num_seqs \(" + NUM + r"\) exceeds available Mamba cache "
                             r"blocks \(" + NUM + r"\)"),
    "too_long_tokens": ("max_model_len above the cache's tokens",
                        r"max seq len \(" + NUM + r"\) is larger than the maximum number of "
                        r"tokens that can be stored in KV cache \(" + NUM + r"\)"),
    "compiled_again": ("the compiled model compiled again, not loaded from vLLM's cache",
                       r"Compiling model again due to a load failure"),
    "too_long_gib": ("one max_model_len request above the cache's memory",
                     r"max seq len \(" + NUM + r"\), \(" + GIB + r" KV cache is needed, which is "
                     r"larger than the available KV cache memory \(" + GIB + r"\)"),
}
REPEATED = {"padding_layers"}  # logged once for each kind of layer it pads
VERSION = re.compile(r"(?:V1 LLM engine \(v|vLLM API server version |vLLM version )"
                     r"(\d+\.\d+\.\d+[\w.+-]*)")
ARGS = re.compile(r"non-default args: (\{.*\})")
ENGINE = re.compile(r"with config: (.*)")
ENGINE_KEYS = ("model", "dtype", "max_seq_len", "tensor_parallel_size", "quantization",
               "kv_cache_dtype", "enable_prefix_caching", "enforce_eager", "device_config")
ARCHITECTURE = re.compile(r"Resolved architecture: (\w+)")
BATCHED = re.compile(r"max_num_batched_tokens=(\d+)")
READS = "0.6 to 0.32"  # the wording the patterns above were written from (V0 and V1)
OLDEST = (0, 6)


@dataclass(frozen=True)
class Logged:
    """One number as the log states it: its text (as logged), its value, and the decimals it
    was rounded to (a logged "6.51 GiB" is any value from 6.505 to 6.515)."""

    text: str
    value: float
    decimals: int
    line: str

    def bounds(self) -> tuple[float, float]:
        half = 0.5 * 10 ** -self.decimals if self.decimals else 0.0
        return self.value - half, self.value + half


@dataclass
class StartupLog:
    """What a start-up log says: `numbers` by key (`LINES`), each as a list of `Logged` (one
    per group in the pattern), the engine's settings and the vLLM version where it is logged."""

    numbers: dict[str, list[Logged]] = field(default_factory=dict)
    args: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    version: str | None = None
    device: str | None = None  # "GPU", "CPU", ... as the KV cache line names it

    def value(self, key: str, index: int = 0) -> float | None:
        got = self.numbers.get(key)
        return got[index].value if got and len(got) > index else None

    def setting(self, key: str):
        """A setting as the log states it: the non-default args first, then the engine line."""
        return self.args.get(key, self.engine.get(key))


def logged(text: str, line: str) -> Logged:
    decimals = len(text.split(".")[1]) if "." in text else 0
    return Logged(text, float(text.replace(",", "")), decimals, line.strip())


def literal_dict(text: str) -> dict:
    """The non-default args line's dict; values Python cannot read back (an object's repr)
    are skipped, the rest kept."""
    try:
        value = ast.literal_eval(text)
        return value if isinstance(value, dict) else {}
    except (ValueError, SyntaxError):
        pairs = re.findall(r"'(\w+)': ('[^']*'|[\w.\-]+)", text)
        return {k: ast.literal_eval(v) if v[0] == "'" else plain_value(v) for k, v in pairs}


def plain_value(text: str):
    """A value from the engine's config line: a number, True/False/None, or the text."""
    with_quotes = text.strip().strip("'")
    for cast in (int, float):
        try:
            return cast(with_quotes)
        except ValueError:
            pass
    return {"True": True, "False": False, "None": None}.get(with_quotes, with_quotes)


def engine_settings(text: str) -> dict:
    """The settings `ENGINE_KEYS` from "Initializing a V1 LLM engine … with config: …"."""
    out = {}
    for key in ENGINE_KEYS:
        m = re.search(rf"(?:^|, ){key}=('[^']*'|[^,]+)", text)
        if m:
            out[key] = plain_value(m.group(1))
    if isinstance(out.get("dtype"), str):
        out["dtype"] = out["dtype"].removeprefix("torch.")
    return out


def read_line(log: StartupLog, line: str) -> None:
    for key, (_, pattern) in LINES.items():
        m = re.search(pattern, line)
        if m and key in REPEATED:  # one line per kind of layer: every one kept
            log.numbers.setdefault(key, []).extend(logged(g, line) for g in m.groups())
        elif m and key not in log.numbers:  # the first of a repeated line (one engine a log)
            log.numbers[key] = [logged(g, line) for g in m.groups()]
            if key == "kv_cache_tokens":
                log.device = re.search(r"(\w+)(?: \+ host)? KV cache size", line).group(1)
    if log.version is None and (m := VERSION.search(line)):
        log.version = m.group(1)
    if not log.args and (m := ARGS.search(line)):
        log.args = literal_dict(m.group(1))
    if "model" not in log.engine and "LLM engine" in line and (m := ENGINE.search(line)):
        log.engine.update(engine_settings(m.group(1)))
    if "architecture" not in log.engine and (m := ARCHITECTURE.search(line)):
        log.engine["architecture"] = m.group(1)
    if "max_num_batched_tokens" not in log.engine and (m := BATCHED.search(line)):
        log.engine["max_num_batched_tokens"] = int(m.group(1))


# Lines a KV cache explanation needs at least one of.
KV_LINES = ("kv_cache_tokens", "gpu_blocks", "available_kv_gib", "cpu_kv_gib", "mamba_blocks_refusal",
            "too_long_tokens", "too_long_gib")


def read_log(text: str, name: str = "the log") -> StartupLog:
    """Every number and setting in `text`; a ConfigError when it is not a vLLM start-up log
    or is cut before its KV cache lines, or its version is one whose lines the kit does not
    read."""
    log = StartupLog()
    for line in text.splitlines():
        read_line(log, line)
    if not (log.numbers or log.args or log.engine or log.version):
        raise ConfigError(f"{name} is not a vLLM start-up log: none of its lines is one vLLM "
                          "logs at start-up (its non-default args, its engine's config, "
                          "\"Model loading took\", \"KV cache size\").")
    if log.version and version_tuple(log.version) < OLDEST:
        raise ConfigError(f"{name} was written by vLLM {log.version}; the kit reads the "
                          f"start-up lines of vLLM {READS}.")
    if not any(k in log.numbers for k in KV_LINES):
        seen = ", ".join(sorted(log.numbers)) or "only its settings"
        raise ConfigError(f"{name} ends before vLLM sized its KV cache: no \"KV cache size\", "
                          f"\"Available KV cache memory\" or refusal line (it has {seen}). "
                          "Paste the log up to the \"Maximum concurrency\" line.")
    return log


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def read_log_file(path) -> StartupLog:
    """The log in file `path`: as given, else relative to the kit's folder (data/logs/...)."""
    from kit.config import DATA
    path = Path(path).expanduser()
    if not path.is_file() and not path.is_absolute() and (DATA.parent / path).is_file():
        path = DATA.parent / path
    if not path.is_file():
        raise ConfigError(f"no log at {path}: give the path of a file holding vLLM's start-up "
                          "output (e.g. `vllm serve … 2>&1 | tee vllm.log`)")
    return read_log(path.read_text(errors="replace"), str(path))
