"""Every number a vLLM start-up log states about memory and the KV cache, computed again from
the model's config.json and the run's settings with vLLM 0.32's own sizing code (`kit.vllm.
kv_sizing` through `kit.vllm.logged_run`, no engine), and whether the two agree within the log's
rounding ("6.51 GiB" is any byte count from 6.505 to 6.515 GiB, and the blocks such a budget
buys are a range too); where they do not, what differs."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from kit.units import GiB
from kit.vllm.kv_sizing import VLLMKVSizing, VLLMSizer
from kit.vllm.logged_run import (ALIGNMENTS, LoggedRun, align_to_logged_block, aligned_block,
                                 budget_bounds, build_sizer, hybrid_pages, logged_run,
                                 pool_block_bytes, size_at, weight_bytes)
from kit.vllm.startup_log import StartupLog, version_tuple

NEW_TOKENS_RULE = (0, 24)  # "KV cache size" = concurrency × max_model_len by here (0.19 not)


@dataclass
class Reproduced:
    """One number the log states: as logged, the kit's, whether they agree (None: the kit
    cannot compute it here, and `how` says what the log implies), how the kit got it, and
    where they disagree, why."""

    key: str
    what: str
    logged: str
    kit: str | None
    agrees: bool | None
    how: str
    why: str | None = None

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None or k == "agrees"}


@dataclass
class Explained:
    """A log explained: its run, the sizing at the blocks the log's numbers pin, and its
    numbers."""

    log: StartupLog
    run: LoggedRun
    sizer: VLLMSizer
    sizing: VLLMKVSizing | None
    blocks: tuple[int, int] | None  # the blocks the log's memory allows (lowest, highest)
    numbers: list[Reproduced] = field(default_factory=list)
    per_block: int = 0  # what one block id costs in the pool the groups share

    def number(self, key: str) -> Reproduced | None:
        return next((n for n in self.numbers if n.key == key), None)


def tokens_rule(log: StartupLog) -> str:
    """Which rule the log's "KV cache size: N tokens" follows: "0.32" (int(concurrency ×
    max_model_len), vLLM's since about 0.20) or "older" (blocks ÷ groups × block size), read
    off the log itself where it states both numbers, else from its version."""
    tokens, conc = log.value("kv_cache_tokens"), log.numbers.get("max_concurrency")
    if tokens is not None and conc:
        length, c = conc[0].value, conc[1].value
        return "0.32" if abs(tokens - c * length) <= 0.005 * length + 1 else "older"
    if log.version:
        return "0.32" if version_tuple(log.version) >= NEW_TOKENS_RULE else "older"
    return "0.32"


def logged_tokens(sizing: VLLMKVSizing, rule: str) -> int | None:
    """The tokens vLLM logs for `sizing` under `rule` (`tokens_rule`)."""
    if sizing.num_blocks is None:
        return None
    if rule == "0.32":
        return sizing.num_tokens
    groups = max(1, len(sizing.groups))
    return sizing.num_blocks // groups * sizing.block_size


def match_tokens(sizer, run, per_block: int, tokens: int, rule: str,
                 blocks: tuple[int, int] | None, concurrency=None) -> VLLMKVSizing | None:
    """The sizing whose logged tokens equal `tokens` (within `blocks` when the log's memory
    pins them), of those the one whose concurrency rounds to the log's (`concurrency`, a
    `Logged`) where there is one: every block count in a narrow range, else those near the
    count the tokens imply."""
    if blocks and blocks[1] - blocks[0] <= 256:
        candidates = range(blocks[0], blocks[1] + 1)
    else:
        one = size_at(sizer, run, 1024 * per_block)
        rate = (logged_tokens(one, rule) or 0) / 1024
        guess = int(tokens / rate) if rate else 1
        candidates = sorted(range(max(1, guess - 16), guess + 17), key=lambda n: abs(n - guess))
    found = [s for s in (size_at(sizer, run, n * per_block) for n in candidates)
             if logged_tokens(s, rule) == tokens]
    return next((s for s in found if concurrency is not None and s.max_concurrency is not None
                 and within(concurrency, s.max_concurrency)), found[0] if found else None)


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GiB:.2f} GiB"


def within(logged, value: float) -> bool:
    """`value` rounds to what the log states (a `Logged`)."""
    lo, hi = logged.bounds()
    return lo - 1e-9 <= value <= hi + 1e-9


def explain(log: StartupLog, model: str | None = None, given: dict | None = None) -> Explained:
    """Every number `log` states, computed again for its model and settings (`logged_run`).
    A hybrid whose log does not say whether prefix caching was on is explained both ways
    (vLLM's default "align" keeps two or three Mamba states a request, and older versions ran
    hybrids with it off, one state): the way more numbers agree, said in the settings."""
    if given and given.get("vllm_version") and not log.version:
        log.version = str(given["vllm_version"])
    ex = explained_run(log, logged_run(log, model, given))
    if hybrid_pages(ex.sizer.specs) and ex.run.source["enable_prefix_caching"] == \
            "vLLM's default" and any(n.agrees is False for n in ex.numbers):
        off = explained_run(log, logged_run(log, model, {**(given or {}),
                                                         "enable_prefix_caching": False}))
        if sum(bool(n.agrees) for n in off.numbers) > sum(bool(n.agrees) for n in ex.numbers):
            off.run.source["enable_prefix_caching"] = ("off: only so do the log's numbers "
                                                       "agree (older vLLM ran hybrids so)")
            return off
    return ex


def explained_run(log: StartupLog, run: LoggedRun) -> Explained:
    """`explain` for one reading of the log's settings (`run`)."""
    sizer = build_sizer(run)
    pages = hybrid_pages(sizer.specs)
    if pages:  # the log's attention block, or the one its device's backend would pick
        block = log.value("attention_block_size") or aligned_block(
            *pages, ALIGNMENTS.get(run.device, 16))
        align_to_logged_block(sizer, int(block))
    per_block = pool_block_bytes(sizer, run)
    bounds = budget_bounds(log, run)
    blocks = None
    if bounds:  # vLLM's `get_num_blocks`: the memory over what a block costs in every layer
        blocks = (bounds[0] // per_block, bounds[1] // per_block)
    rule = tokens_rule(log)
    ex = Explained(log, run, sizer, pinned_sizing(log, sizer, run, per_block, rule, blocks),
                   blocks, per_block=per_block)
    for make in NUMBERS:
        ex.numbers.extend(n for n in make(ex, per_block, rule) if n is not None)
    return ex


def pinned_sizing(log, sizer, run, per_block, rule, blocks) -> VLLMKVSizing | None:
    """The sizing at the blocks the log pins: V0's blocks line, the block count whose tokens
    (and concurrency) are the log's, a refusal's state blocks, or the least its memory buys."""
    tokens, states = log.value("kv_cache_tokens"), log.value("mamba_blocks_refusal", 1)
    if log.value("gpu_blocks"):  # vLLM's V0 engine logs the blocks themselves
        return size_at(sizer, run, int(log.value("gpu_blocks")) * per_block)
    if tokens is not None:
        conc = log.numbers.get("max_concurrency")
        sizing = match_tokens(sizer, run, per_block, int(tokens), rule, blocks,
                              conc[1] if conc else None)
        if sizing is not None:
            return sizing
    if states:  # the state blocks a refusal names
        return size_at(sizer, run, int(states) * per_block)
    return size_at(sizer, run, blocks[0] * per_block) if blocks else None


def cost_ratio_reason(ex: Explained, per_block: int, tokens: int, rule: str) -> str:
    """Why the log's tokens are not what its memory buys the kit's model: another version's
    rule, or what one block costs by the log against by the config (`block_cost_reason`)."""
    other = "older" if rule == "0.32" else "0.32"
    if ex.blocks and match_tokens(ex.sizer, ex.run, per_block, tokens, other, ex.blocks):
        return (f"the log's tokens follow vLLM's {'0.32' if other == '0.32' else 'older'} rule "
                "for the KV cache's size: another vLLM version than the kit assumed (give "
                "--set vllm_version=...)")
    one = size_at(ex.sizer, ex.run, 1024 * per_block)
    rate = (logged_tokens(one, rule) or 1) / 1024
    return block_cost_reason(ex, per_block, tokens / rate)


def block_cost_reason(ex: Explained, per_block: int, blocks: float) -> str:
    """What one block costs by the log (its memory ÷ its blocks) against by the config, named
    where the ratio has a usual cause."""
    bounds = budget_bounds(ex.log, ex.run)
    if not bounds:
        return ("the log states no KV cache memory to compare with: another model or a "
                "setting the log does not state")
    ratio = bounds[0] / blocks / per_block
    causes = {0.5: "an fp8 KV cache (kv_cache_dtype=fp8) or twice the tensor-parallel ranks",
              2.0: "a KV cache in twice the bytes (float32, or kv_cache_dtype not fp8) or half "
                   "the tensor-parallel ranks"}
    near = next((c for r, c in causes.items() if abs(ratio - r) < 0.02 * r), None)
    return (f"a block costs {ratio:.3f}× in the log what the config gives ({per_block:,} B): "
            + (near or "another model (layers, KV heads or head size), or a setting the log "
               "does not state") + "; give it with --set or --model")


def tokens_number(ex: Explained, per_block: int, rule: str) -> list[Reproduced | None]:
    t = ex.log.numbers.get("kv_cache_tokens")
    if not t:
        return []
    s, logged_t = ex.sizing, int(t[0].value)
    how_rule = ("int(max concurrency × max_model_len), vLLM's rule since about 0.20"
                if rule == "0.32" else "blocks ÷ groups × block size, the rule before about 0.20")
    if s is None:
        if not ex.blocks:
            return [Reproduced("kv_cache_tokens", "KV cache size (tokens)", t[0].text, None, False,
                           f"no block count gives these tokens, counted as {how_rule}",
                           cost_ratio_reason(ex, per_block, logged_t, rule))]
        lo, hi = (size_at(ex.sizer, ex.run, b * per_block) for b in ex.blocks)
        kit = f"{logged_tokens(lo, rule):,} to {logged_tokens(hi, rule):,}"
        return [Reproduced("kv_cache_tokens", "KV cache size (tokens)", t[0].text, kit, False,
                       f"the blocks the log's memory buys, counted as {how_rule}",
                       cost_ratio_reason(ex, per_block, logged_t, rule))]
    inside = (not ex.blocks or ex.blocks[0] <= s.num_blocks <= ex.blocks[1]) and \
        logged_tokens(s, rule) == logged_t
    how = (f"{s.num_blocks:,} blocks of {s.block_size} tokens in {len(s.groups)} group(s), "
           f"counted as {how_rule}")
    why = None if inside else cost_ratio_reason(ex, per_block, logged_t, rule)
    return [Reproduced("kv_cache_tokens", "KV cache size (tokens)", t[0].text,
                   f"{logged_tokens(s, rule):,}", inside, how, why)]


def concurrency_number(ex: Explained, per_block: int, rule: str) -> list[Reproduced | None]:
    c, s = ex.log.numbers.get("max_concurrency"), ex.sizing
    if not c or s is None or s.max_concurrency is None:
        return []
    length = int(c[0].value)
    per_request = s.blocks_per_request
    how = (f"{s.num_blocks:,} blocks ÷ {per_request:,} blocks one {length:,}-token request "
           f"reserves over {len(s.groups)} group(s)")
    ok = within(c[1], s.max_concurrency) and length == int(ex.run.settings["max_model_len"])
    why = None
    if not ok:
        why = ("vLLM before about 0.20 counted what a request reserves otherwise (its Mamba "
               "states and windows by other rules)" if rule != "0.32" else
               "max_model_len, max_num_batched_tokens or prefix caching differ from the log's")
    return [Reproduced("max_concurrency", f"maximum concurrency at {length:,} tokens", c[1].text,
                   f"{s.max_concurrency:.2f}", ok, how, why)]


def memory_number(ex: Explained, per_block: int, rule: str) -> list[Reproduced | None]:
    key = next((k for k in ("available_kv_gib", "cpu_kv_gib") if k in ex.log.numbers), None)
    s = ex.sizing
    if key is None or s is None or s.num_blocks is None:
        return []
    logged = ex.log.numbers[key][0]
    lo, hi = s.num_blocks * per_block, (s.num_blocks + 1) * per_block - 1
    ok = logged.bounds()[0] * GiB <= hi and lo <= logged.bounds()[1] * GiB
    how = (f"{s.num_blocks:,} blocks × {per_block:,} B a block = {gib(lo)} (vLLM leaves what is "
           "short of one more block unused)")
    return [Reproduced(key, "the KV cache's memory", logged.text, gib(lo), ok, how,
                   None if ok else "the log's tokens need more or fewer blocks than this memory")]


def weights_number(ex: Explained, per_block: int, rule: str) -> list[Reproduced | None]:
    w = ex.log.numbers.get("weights_gib")
    if not w:
        return []
    counted = weight_bytes(ex.run)
    if counted is None:
        return [Reproduced("weights_gib", "the weights loaded", w[0].text, None, None,
                       "the kit does not count this family's parameters; the log's value is "
                       "what the load took on one rank")]
    ok = abs(counted / GiB - w[0].value) <= max(0.005, 0.02 * w[0].value)
    quant = ex.run.quantization
    how = (f"parameters from the config × {ex.run.settings['dtype']} ÷ "
           f"{ex.run.settings['tensor_parallel_size']} rank(s), within 2% (vLLM measures what "
           "the load took: buffers and the allocator's rounding beside the parameters)")
    why = None
    if not ok:
        why = (f"the weights are stored quantized ({quant}): the kit counts "
               f"{ex.run.settings['dtype']} parameters" if quant else
               "fewer bytes than the config's parameters in the served dtype: a quantized "
               "checkpoint (the config given holds no quantization_config)"
               if w[0].value < 0.8 * counted / GiB else
               "the loaded model differs from the config's shapes (a vision tower or "
               "speculative drafter loaded beside it, tied or untied embeddings)")
    return [Reproduced("weights_gib", "the weights loaded", w[0].text, gib(counted), ok, how, why)]


def budget_numbers(ex: Explained, per_block: int, rule: str) -> list[Reproduced | None]:
    """The profiling line's arithmetic (vLLM before about 0.10 logs every term):
    capacity × utilization = requested; requested − weights − non-torch − activations = the
    KV cache."""
    n, out = ex.log.numbers, []
    if "requested_gib" in n and "total_gpu_gib" in n:
        util, requested = n["requested_gib"]
        value = n["total_gpu_gib"][0].value * util.value
        out.append(Reproduced("requested_gib", "capacity × gpu_memory_utilization",
                          requested.text, f"{value:.2f} GiB", abs(value - requested.value)
                          <= 0.01, f"{n['total_gpu_gib'][0].text} GiB × {util.text}"))
    terms = ("profiled_weights_gib", "non_torch_gib", "activation_gib")
    if "requested_gib" in n and "available_kv_gib" in n and all(t in n for t in terms):
        rest = n["requested_gib"][1].value - sum(n[t][0].value for t in terms)
        kv = n["available_kv_gib"][0]
        out.append(Reproduced("kv_budget_arithmetic", "requested − weights − non-torch − "
                          "activations", kv.text, f"{rest:.2f} GiB",
                          abs(rest - kv.value) <= 0.02 + 1e-9,
                          "the logged terms, each rounded to 0.01 GiB"))
    return out


def total_memory(ex: Explained) -> float | None:
    """The device's capacity in GiB: given (`total_memory_gib`), logged by the profiling line,
    or implied by the CUDA-graph lines (estimate ÷ (utilization − its equivalent))."""
    n, s = ex.log.numbers, ex.run.settings
    if s.get("total_memory_gib"):
        return float(s["total_memory_gib"])
    if "total_gpu_gib" in n:
        return n["total_gpu_gib"][0].value
    util, equiv = s.get("gpu_memory_utilization"), ex.log.value("equivalent_utilization")
    est = ex.log.value("cudagraph_estimate_gib")
    if est and equiv is not None and util and float(util) > equiv:
        return est / (float(util) - equiv)
    return None


def cudagraph_numbers(ex: Explained, per_block: int, rule: str) -> list[Reproduced | None]:
    n, out = ex.log.numbers, []
    est, util = ex.log.value("cudagraph_estimate_gib"), ex.run.settings["gpu_memory_utilization"]
    if "equivalent_utilization" in n and est is not None:
        total = total_memory(ex)
        given = ex.run.settings.get("total_memory_gib")
        value = float(util) - est / total if total else None
        out.append(Reproduced(
            "equivalent_utilization", "gpu_memory_utilization without the graphs' estimate",
            n["equivalent_utilization"][0].text, f"{value:.4f}" if given else None,
            abs(value - n["equivalent_utilization"][0].value) <= 5e-5 if given else None,
            f"{util} − {est:.2f} GiB estimate ÷ capacity; the log implies a capacity of "
            f"{total:.2f} GiB" if total else "needs the device's capacity"))
    if "graph_capture_gib" in n:
        took = n["graph_capture_gib"][1]
        out.append(Reproduced("graph_capture_gib", "the CUDA graphs, as captured", took.text, None,
                          None, "measured on the GPU while capturing; the kit runs no CUDA "
                          "graphs here" + (f"; vLLM's estimate before capture was {est:.2f} GiB"
                                           if est is not None else "")))
    return out


def hybrid_numbers(ex: Explained, per_block: int, rule: str) -> list[Reproduced | None]:
    pages = hybrid_pages(ex.sizer.specs)
    if pages is None:
        return []
    mamba, attn = pages
    align = ALIGNMENTS.get(ex.run.device, 16)
    block = aligned_block(mamba, attn, align)
    out = []
    logged = ex.log.numbers.get("attention_block_size")
    if logged:
        out.append(Reproduced("attention_block_size", "the attention block, enlarged",
                              logged[0].text,
                          f"{block}", block == int(logged[0].value),
                          f"a Mamba state of {mamba:,} B over {attn:,} B per attention token, "
                          f"rounded up to the {ex.run.device} backend's multiple of {align}",
                          None if block == int(logged[0].value) else
                          "the log's attention backend rounds to another multiple"))
    pad = ex.log.numbers.get("mamba_padding_pct")
    if pad:
        used = int(logged[0].value) if logged else block
        pct = 100 * (used * attn - mamba) / mamba
        out.append(Reproduced("mamba_padding_pct", "the Mamba page's padding", pad[0].text,
                          f"{pct:.2f}%", within(pad[0], pct),
                          f"({used} tokens × {attn:,} B − {mamba:,} B) ÷ {mamba:,} B"))
    return out


def padding_number(ex: Explained, per_block: int, rule: str) -> list[Reproduced | None]:
    """vLLM's padding lines (one for each kind of layer it pads) against those its grouping
    logs for the config's layers."""
    got = ex.log.numbers.get("padding_layers")
    if not got or ex.sizing is None:
        return []
    records: list = []
    size_at(ex.sizer, ex.run, ex.sizing.num_blocks * per_block, records)
    ours = re.findall(r"Add (\d+) padding layers, may waste at most ([\d.]+)%",
                      " ".join(r.getMessage() for r in records))
    theirs = [(got[i].text, got[i + 1].text) for i in range(0, len(got), 2)]
    text = "; ".join(f"{n} layers, {pct}%" for n, pct in theirs)
    ok = sorted(ours) == sorted(theirs)
    return [Reproduced("padding_layers", "padding layers", text,
                       "; ".join(f"{n} layers, {pct}%" for n, pct in ours) or "none", ok,
                       "vLLM's grouping of the layers by kind (groups as large as the smallest "
                       "kind's count; the others padded)",
                       None if ok else "the engine's layers differ from the config's: a "
                       "speculative drafter (speculative_config) or another tower adds layers")]


def states_number(ex: Explained, per_block: int) -> Reproduced:
    """The Mamba state blocks of a max_num_seqs refusal: against the log's memory where it
    states one, else the memory they imply."""
    seqs, blocks = (int(x.value) for x in ex.log.numbers["mamba_blocks_refusal"])
    how = (f"every decoding sequence holds one Mamba state block, so {seqs:,} sequences need "
           f"as many; {blocks:,} blocks × {per_block:,} B a block = {gib(blocks * per_block)}")
    if not ex.blocks:
        return Reproduced("mamba_blocks_refusal", "the Mamba state blocks", f"{blocks:,}", None,
                          None, how + ": the KV cache memory the log implies")
    ok = ex.blocks[0] <= blocks <= ex.blocks[1]
    kit = f"{ex.blocks[0]:,}" + ("" if ex.blocks[0] == ex.blocks[1] else f" to {ex.blocks[1]:,}")
    return Reproduced("mamba_blocks_refusal", "the Mamba state blocks", f"{blocks:,}", kit, ok,
                      how, None if ok else "the log's memory buys other blocks")


def refusal_numbers(ex: Explained, per_block: int, rule: str) -> list[Reproduced | None]:
    n, out = ex.log.numbers, []
    if "mamba_blocks_refusal" in n:
        out.append(states_number(ex, per_block))
    bounds = budget_bounds(ex.log, ex.run)
    if "too_long_gib" in n:
        from vllm.v1.core.kv_cache_utils import max_memory_usage_bytes
        length, need, _ = n["too_long_gib"]
        ex.sizer.vllm_config.model_config.max_model_len = int(length.value)
        ours = max_memory_usage_bytes(ex.sizer.vllm_config, ex.sizer.specs.values())
        out.append(Reproduced("too_long_gib", f"one {int(length.value):,}-token request's KV cache",
                          need.text, gib(ours), within(need, ours / GiB),
                          "what each layer of one request reserves at max_model_len, summed"))
    if "too_long_tokens" in n and bounds:
        length, tokens = (int(x.value) for x in n["too_long_tokens"])
        blocks = int(ex.log.value("gpu_blocks") or bounds[0] // per_block)
        ours = blocks * int(ex.run.settings["block_size"])
        out.append(Reproduced("too_long_tokens", "the tokens the KV cache stores", f"{tokens:,}",
                          f"{ours:,}", ours == tokens, "the KV cache's blocks × block size"))
    return out


def blocks_number(ex: Explained, per_block: int, rule: str) -> list[Reproduced | None]:
    got = ex.log.numbers.get("gpu_blocks")
    if not got or not ex.blocks:
        return []
    lo, hi = ex.blocks
    ok = lo <= int(got[0].value) <= hi
    return [Reproduced("gpu_blocks", "the KV cache's blocks", got[0].text,
                   f"{lo:,}" if lo == hi else f"{lo:,} to {hi:,}", ok,
                   f"the logged KV cache memory ÷ {per_block:,} B a block",
                   None if ok else block_cost_reason(ex, per_block, got[0].value))]


NUMBERS = (blocks_number, tokens_number, concurrency_number, memory_number, weights_number,
           budget_numbers, cudagraph_numbers, hybrid_numbers, padding_number, refusal_numbers)
