"""What a vLLM start-up log means for its user (chapter 06, `python -m kit explain`): the
pitfalls it shows in this model's terms, the budget as a waterfall, the groups and what one
request reserves in each, and the settings that would reach a target, each sized by vLLM
0.32's own code at the log's memory (the numbers themselves: `kit.vllm.log_numbers`)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from kit.errors import ConfigError
from kit.units import Bytes, Count, GiB, Ratio
from kit.vllm.log_numbers import Explained, explain, tokens_rule, total_memory
from kit.vllm.logged_run import (budget_bounds, build_sizer, hybrid_pages, longest_that_fits,
                                 size_at)
from kit.vllm.startup_log import read_log_file


def explain_log(path, model: str | None = None, settings: dict | None = None) -> Explained:
    """The log in file `path` explained (`kit.vllm.log_numbers.explain`)."""
    return explain(read_log_file(path), model, settings)


def target_of(text: str | None) -> tuple[int, int] | None:
    """A target as `16x32768` (16 requests of 32,768 tokens); None for none."""
    if not text:
        return None
    try:
        n, _, length = str(text).lower().partition("x")
        return int(n), int(length.replace(",", ""))
    except ValueError:
        raise ConfigError(f"target {text!r}: give REQUESTSxTOKENS, e.g. 16x32768") from None


def kv_bytes(ex: Explained) -> int | None:
    """The KV cache's memory as the log's blocks spend it."""
    s = ex.sizing
    return s.num_blocks * ex.per_block if s and s.num_blocks else None


def groups_table(ex: Explained) -> list[dict]:
    """vLLM's groups: their kind, layers, and the blocks and tokens one max_model_len request
    reserves in each."""
    s, block = ex.sizing, ex.sizer.vllm_config.cache_config.block_size
    if s is None:
        return []
    rows = []
    for g in s.groups:
        kind = ("Mamba state" if "Mamba" in g.spec else
                f"sliding window {g.window:,}" if g.window else
                f"chunks of {g.chunk:,}" if g.chunk else
                "latent attention" if "MLA" in g.spec else "full attention")
        rows.append({"kind": kind, "layers": len(g.layers), "blocks per request":
                     g.blocks_per_request, "tokens per request": g.blocks_per_request * block})
    return rows


def waterfall(ex: Explained) -> list[tuple[str, float | None]]:
    """capacity × utilization − weights − activations − non-torch − CUDA graphs = KV cache, in
    GiB, each as logged (None where the log is silent; the remainder where it can be
    inferred)."""
    n, v = ex.log.numbers, ex.log.value
    total = total_memory(ex)
    util = float(ex.run.settings["gpu_memory_utilization"])
    requested = v("requested_gib", 1) or (total * util if total else None)
    weights = v("profiled_weights_gib") or v("weights_gib")
    kv = v("available_kv_gib") or v("cpu_kv_gib")
    graphs = v("cudagraph_estimate_gib") if "equivalent_utilization" in n else None
    act, non_torch = v("activation_gib"), v("non_torch_gib")
    if requested and kv is not None and weights is not None and act is None:
        rest = requested - kv - weights - (graphs or 0) - (non_torch or 0)
        act = round(rest, 2)  # activations and whatever else vLLM's profile counted
    return [("capacity × utilization", requested), ("weights", weights),
            ("activations (peak)", act), ("non-torch", non_torch), ("CUDA graphs", graphs),
            ("KV cache", kv)]


def pitfalls(ex: Explained) -> list[str]:
    """The pitfalls the log shows, each with its cause in this model's terms."""
    out = [p for p in (windows_pitfall(ex), block_pitfall(ex), padding_pitfall(ex),
                       states_pitfall(ex), graphs_pitfall(ex), tp_pitfall(ex),
                       too_long_pitfall(ex), compile_cache_pitfall(ex)) if p]
    return out


def windows_pitfall(ex: Explained) -> str | None:
    s, length = ex.sizing, int(ex.run.settings["max_model_len"])
    if s is None or not s.groups or all(not g.window and not g.chunk for g in s.groups) \
            and not hybrid_pages(ex.sizer.specs):
        return None
    block = ex.sizer.vllm_config.cache_config.block_size
    full = len(s.groups) * -(-length // block)
    return (f"Tokens are not concurrency here: a {length:,}-token request reserves "
            f"{s.blocks_per_request:,} blocks over {len(s.groups)} groups (windows, chunks or "
            f"states reserve less than the full {full:,}), so {s.num_blocks:,} blocks serve "
            f"{s.max_concurrency:.2f} such requests; the \"KV cache size\" line counts "
            + ("concurrency × max_model_len" if tokens_rule(ex.log) == "0.32" else
               "blocks ÷ groups × block size (vLLM before about 0.20), which is not "
               "concurrency × max_model_len"))


def block_pitfall(ex: Explained) -> str | None:
    logged = ex.log.value("attention_block_size") or (
        hybrid_pages(ex.sizer.specs) and ex.sizer.vllm_config.cache_config.block_size)
    if not logged:
        return None
    return (f"The attention block was enlarged to {int(logged):,} tokens so that one page holds a "
            f"Mamba state: every request holds at least one such block per attention group, "
            f"{int(logged):,} tokens even for a 100-token prompt, and prefix caching shares "
            "only whole blocks.")


def padding_pitfall(ex: Explained) -> str | None:
    got = ex.log.numbers.get("padding_layers")
    if not got:
        return None
    worst = max(got[1::2], key=lambda x: x.value)
    return (f"Padding layers ({', '.join(n.text for n in got[::2])}): vLLM groups the layers by "
            f"kind in groups of equal size and pads the short ones, so up to {worst.text}% of "
            "a kind's KV cache memory can hold nothing.")


def states_pitfall(ex: Explained) -> str | None:
    seqs = int(ex.run.settings["max_num_seqs"])
    got = ex.log.numbers.get("mamba_blocks_refusal")
    blocks = int(got[1].value) if got else (ex.sizing.num_blocks if ex.sizing and
                                            hybrid_pages(ex.sizer.specs) else None)
    if blocks is None or seqs <= blocks:
        return None
    default = " (vLLM's default: the log does not state it)" \
        if ex.run.source.get("max_num_seqs") == "vLLM's default" else ""
    return (f"max_num_seqs={seqs:,}{default} is above the {blocks:,} Mamba state blocks: every "
            f"decoding sequence holds one, so vLLM refuses to capture CUDA graphs for them. "
            f"Lower max_num_seqs to {blocks:,} or fewer, or give the cache more memory.")


def graphs_pitfall(ex: Explained) -> str | None:
    est = ex.log.value("cudagraph_estimate_gib")
    equiv = ex.log.value("equivalent_utilization")
    if est is None or equiv is None:
        return None
    return (f"Since vLLM 0.21 the CUDA graphs' estimated {est:.2f} GiB comes off the KV cache's "
            f"budget: gpu_memory_utilization={ex.run.settings['gpu_memory_utilization']} "
            f"now buys what {equiv} did before.")


def tp_pitfall(ex: Explained) -> str | None:
    tp = int(ex.run.settings["tensor_parallel_size"])
    if tp == 1:
        return None
    mc = ex.sizer.vllm_config.model_config
    if mc.use_mla:
        return (f"Latent attention at tensor_parallel_size={tp}: every rank keeps the whole "
                "latent cache (one latent per token, not divided by heads), so more ranks add "
                "memory for weights, not tokens per rank.")
    total = mc.get_total_num_kv_heads()
    per_rank = mc.get_num_kv_heads(ex.sizer.vllm_config.parallel_config)
    if total >= tp:
        return None
    return (f"{total} KV heads over {tp} ranks: each rank keeps {per_rank} (heads are "
            "replicated when there are fewer than ranks), so the ranks past the heads' count "
            "add no tokens.")


def compile_cache_pitfall(ex: Explained) -> str | None:
    if "compiled_again" not in ex.log.numbers:
        return None
    return ("vLLM compiled the model again instead of loading what an earlier start compiled "
            "(\"Compiling model again due to a load failure\"): every start pays the compile. "
            "vLLM 0.32 with torch 2.13 cannot load back what its AOT compile saved "
            "(VLLM_USE_AOT_COMPILE, its default from torch 2.10); VLLM_USE_AOT_COMPILE=0 takes "
            "its other compile cache, which loads (a start of the kit's tiny model on 2 CPU "
            "cores: 19.4 s against 12.5 s).")


def too_long_pitfall(ex: Explained) -> str | None:
    n = ex.log.numbers
    if not ("too_long_gib" in n or "too_long_tokens" in n):
        return None
    bounds = budget_bounds(ex.log, ex.run)
    if not bounds:
        return None
    blocks = ex.log.value("gpu_blocks")  # the blocks themselves, where the log states them
    budget = int(blocks) * ex.per_block if blocks else bounds[0]
    longest = longest_that_fits(ex.sizer, ex.run, budget)
    if not longest:
        return "max_model_len does not fit: not even one block of it fits the KV cache"
    logged = ex.log.numbers.get("too_long_tokens")
    theirs = (f" (the log's vLLM counted {int(logged[1].value):,} tokens, every block; 0.32 keeps one "
              "back as its null block)" if logged and int(logged[1].value) != longest else "")
    return (f"max_model_len={int(ex.run.settings['max_model_len']):,} does not fit one request "
            f"in the KV cache's memory; the longest that does is {longest:,} tokens by vLLM "
            f"0.32's check{theirs}: lower max_model_len to it, or give the cache more memory.")


@dataclass(frozen=True)
class WhatIf:
    """One row of the what-if table: a change, the settings it sizes with, and what vLLM's
    code gives (None where it refuses), with whether it reaches the target."""

    change: str
    tokens: int | None
    max_concurrency: float | None
    max_model_len: int
    note: str = ""
    reaches: bool | None = None


def changes(ex: Explained, budget: int) -> list[tuple[str, dict, int, str]]:
    """(change, settings changed, KV budget, note) for each what-if row the log allows."""
    s, out = ex.run.settings, [("as logged", {}, budget, "")]
    if str(s["kv_cache_dtype"]) in ("auto", "bfloat16", "float16"):
        out.append(("kv_cache_dtype=fp8", {"kv_cache_dtype": "fp8"}, budget,
                    "one byte an element; check the model's accuracy"))
    length = int(s["max_model_len"])
    out.append((f"max_model_len={length // 2:,}", {"max_model_len": length // 2}, budget, ""))
    total = total_memory(ex)
    util = float(s["gpu_memory_utilization"])
    if total and util <= 0.9:
        out.append((f"gpu_memory_utilization={util + 0.05:.2f}",
                    {"gpu_memory_utilization": util + 0.05}, budget + int(0.05 * total * GiB),
                    f"+{0.05 * total:.2f} GiB of a {total:.2f} GiB device"))
    est = ex.log.value("cudagraph_estimate_gib")
    if est:
        out.append(("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0", {}, budget + int(est * GiB),
                    "the graphs' memory then comes out of what the cache was given: raise "
                    "it only with headroom"))
    if hybrid_pages(ex.sizer.specs) and s["enable_prefix_caching"] is not False:
        out.append(("enable_prefix_caching=False (mamba_cache_mode none)",
                    {"enable_prefix_caching": False}, budget, "one state per request"))
    elif not hybrid_pages(ex.sizer.specs):
        block = 32 if int(s["block_size"]) == 16 else 16
        out.append((f"block_size={block}", {"block_size": block}, budget,
                    "a request's last block is only partly used"))
    return out + tp_change(ex, budget)


def tp_change(ex: Explained, budget: int) -> list[tuple[str, dict, int, str]]:
    """Twice the tensor-parallel ranks: each rank's weights halve, and what they free goes to
    its cache (activations and the rest taken as unchanged); KV heads split where there are
    enough."""
    tp = int(ex.run.settings["tensor_parallel_size"])
    weights = ex.log.value("weights_gib")
    if not weights:
        return []
    freed = int(weights * GiB / 2)
    return [(f"tensor_parallel_size={2 * tp}", {"tensor_parallel_size": 2 * tp}, budget + freed,
             f"per rank: +{freed / GiB:.2f} GiB of weights freed; needs {2 * tp} devices")]


def what_if(ex: Explained, target: tuple[int, int] | None = None) -> list[WhatIf]:
    """Each change of `changes` sized at the log's KV memory by vLLM's code; `target`
    (requests, tokens each) marks the rows that serve that many requests of that length."""
    budget = kv_bytes(ex)
    if budget is None:
        return []
    rows = []
    for change, settings, kv, note in changes(ex, budget):
        run = replace(ex.run, settings={**ex.run.settings, **settings})
        try:
            sizer = ex.sizer if not settings.keys() - {"max_model_len",
                                                       "gpu_memory_utilization"} else \
                build_sizer(run)
        except ConfigError as e:
            rows.append(WhatIf(change, None, None, int(run.settings["max_model_len"]), str(e)))
            continue
        if target:
            run = replace(run, settings={**run.settings, "max_model_len": min(
                int(run.settings["max_model_len"]), sizer.longest)})
        got = size_at(sizer, run, kv)
        reaches = None
        if target and got.max_concurrency is not None:
            at = size_at(sizer, replace(run, settings={**run.settings,
                                                       "max_model_len": target[1]}), kv)
            reaches = bool(at.max_concurrency and at.max_concurrency >= target[0])
        rows.append(WhatIf(change, got.num_tokens, got.max_concurrency,
                           int(run.settings["max_model_len"]), got.error or note, reaches))
    return rows


def answer(ex: Explained) -> str:
    """The log in one sentence: a refusal's cause and fix where the log ends in one, else what
    its KV cache holds and whether the kit agrees."""
    refusal = states_pitfall(ex) if "mamba_blocks_refusal" in ex.log.numbers else \
        too_long_pitfall(ex)
    numbers = [n for n in ex.numbers if n.agrees is not None]
    off = [n for n in numbers if not n.agrees]
    verdict = ("nothing it states could be computed again" if not numbers else
               f"all {len(numbers)} numbers the kit computes agree with the log" if not off
               else f"{len(off)} of {len(numbers)} numbers differ "
                    f"({', '.join(n.key for n in off)})")
    if refusal:
        return f"{ex.run.model}: {refusal.rstrip('.')} ({verdict})."
    s = ex.sizing
    head = (f"{ex.run.model}: {s.num_blocks:,} blocks, {s.max_concurrency:.2f} requests of "
            f"{int(ex.run.settings['max_model_len']):,} tokens at once"
            if s and s.max_concurrency else f"{ex.run.model}: the KV cache could not be pinned")
    return f"{head}; {verdict}."


def document(ex: Explained, target: tuple[int, int] | None = None) -> dict:
    """Everything the log's explanation found, as plain data (`kit explain --json`)."""
    return {"model": ex.run.model, "vllm_version": ex.log.version, "device": ex.run.device,
            "answer": answer(ex),
            "settings": {k: {"value": v, "from": ex.run.source.get(k)}
                         for k, v in ex.run.settings.items()},
            "numbers": [n.as_dict() for n in ex.numbers], "pitfalls": pitfalls(ex),
            "groups": groups_table(ex), "budget_gib": dict(waterfall(ex)),
            "what_if": [r.__dict__ for r in what_if(ex, target)]}


def with_units(doc: dict) -> dict:
    """The document's budget, groups and what-if rows with each number typed (`kit.units`),
    as chapter 06 records them."""
    return {"budget_bytes": {k: Bytes(round(v * GiB)) for k, v in doc["budget_gib"].items()
                             if v is not None},
            "groups": [Count.of(row) for row in doc["groups"]],
            "what_if": [{**r, "tokens": Count.of(r["tokens"]),
                         "max_concurrency": Ratio.of(r["max_concurrency"]),
                         "max_model_len": Count(r["max_model_len"])} for r in doc["what_if"]]}
