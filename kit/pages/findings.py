"""What a run found, in a few sentences with the reference beside each number: the top of the
report. Each finding reads one chapter's recorded results; a chapter that did not run, or a
number it did not record here (vLLM missing, say), gives no finding rather than a guess."""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from kit.config import reference
from kit.show.judgement import FLOOR_SHARE, UNSTEADY


@dataclass(frozen=True)
class Finding:
    chapter: str
    question: str   # what the chapter asks
    found: str      # the measured answer, formatted
    reference: str  # what to hold it against: the PR's, vLLM's, the floor
    ok: bool | None = None  # within its target, when it has one


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def memory(r: dict) -> list[Finding]:
    if "kv_ratio_compiled_over_eager" not in r:
        return []
    pr = reference("pr7796")
    return [Finding("01_memory_profiling",
                    "KV cache left by a compiled profiling run ÷ an eager one",
                    f"{r['kv_ratio_compiled_over_eager']:.2f}×",
                    f"the PR: {r['pr_kv_ratio']:.2f}× (Gemma-2B, "
                    f"{pr['kv_blocks_profile_compiled']} ÷ {pr['kv_blocks_profile_eager']} blocks)")]


def kv_cache(r: dict) -> list[Finding]:
    if "num_blocks" not in r:
        return []
    return [Finding("02_kv_cache", "KV cache blocks from the budget, and requests of "
                    "max_model_len that fit", f"{r['num_blocks']:,} blocks, "
                    f"{r['max_concurrency']:.2f}× concurrency",
                    "vLLM's formula; chapter 05 checks it against vLLM's own code")]


def decode(r: dict) -> list[Finding]:
    best = r.get("best_strategy")
    timing = (r.get("strategies") or {}).get(best)
    if not timing or not timing.get("median_step_seconds"):
        return []
    warned = r.get("timing_warnings") or {}
    share = timing.get("percent_of_floor")
    found = [Finding("04_decode_timing", f"the quickest decode step ({best})",
                     _ms(timing["median_step_seconds"])  # the chapter's words and number
                     + (f", {FLOOR_SHARE} {share:.0f}%" if share else "")
                     + untrusted(warned, best),
                     f"floor {_ms(statistics.median(r['floor_seconds']))}: the bytes a step "
                     "must move ÷ the copy bandwidth measured in the run"
                     if r.get("floor_seconds") else "no floor measured")]
    if "step_stock_over_guard_free" in r:
        pr = reference("pr7796")
        found.append(Finding("04_decode_timing", "what checking guards costs a step: stock "
                             "compile's step ÷ guard-free's",
                             f"{r['step_stock_over_guard_free']:.2f}×"
                             + untrusted(warned, "stock", "guard_free"),
                             f"the PR: {r['pr_step_ratio']:.2f}× ({pr['decode_step_ms_before']:g} → "
                             f"{pr['decode_step_ms_after']:g} ms on a GPU)"))
    return found


def untrusted(warnings: dict, *names: str) -> str:
    """What the chapter said against these strategies' timings (or the machine), if anything."""
    why = [f"{n}: {warnings[n]}" for n in ("the machine", *names) if n in warnings]
    return f" {UNSTEADY} not to be trusted ({'; '.join(why)})" if why else ""


def vllm(r: dict) -> list[Finding]:
    found = []
    ratio = r.get("best_ratio_kit_over_vllm")
    warned = r.get("timing_warnings") or {}
    sides = [n for n in warned if n != "the machine"]
    if ratio is not None:  # a ratio of timings the chapter does not trust is not judged
        found.append(Finding("05_vllm_side_by_side", "the kit's best decode step ÷ vLLM's best",
                             f"{ratio:.2f}×" + (" (the kit quicker)" if ratio < 1 else
                                                " (vLLM quicker)") + untrusted(warned, *sides),
                             "target: at most 1.00×, both timed in turns in one process",
                             ok=None if warned else ratio <= 1.0))
    for dtype, t in (r.get("token_for_token") or {}).items():
        steps = t.get("steps") or []
        if not steps:
            continue
        agree = sum(bool(s.get("agree")) for s in steps)
        found.append(Finding("05_vllm_side_by_side", f"greedy tokens equal to vLLM's ({dtype})",
                             f"{agree} of {len(steps)}",
                             "all of them in float32; bf16 up to a step whose top two logits "
                             "are closer than its rounding", ok=t.get("ok")))
    return found


READERS = {"01_memory_profiling": memory, "02_kv_cache": kv_cache, "04_decode_timing": decode,
           "05_vllm_side_by_side": vllm}


def findings(notebooks: list[dict]) -> list[Finding]:
    """The findings of a run's notebooks (summary.json's, results filled in), in chapter order."""
    found = []
    for nb in sorted(notebooks, key=lambda nb: nb["notebook"]):
        reader = READERS.get(nb["notebook"])
        if reader:
            found += reader(nb["recorded"].get("results", {}))
    return found
