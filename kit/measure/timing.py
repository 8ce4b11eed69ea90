"""Clocks and timing statistics (chapters 00, 03, 04, 05).

Every timing here follows the same rules: the device is synchronized before a clock is read
(CUDA events on a GPU, a monotonic clock on the CPU), warm-up calls are made and kept apart,
many repeats give a median and a spread, and functions compared with each other are timed
interleaved, so a busy neighbour slows them alike.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from kit.measure.device import synchronize


@dataclass
class Timings:
    """Repeated measurements in seconds, summarized as median and spread."""

    seconds: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def quantile(self, q: float) -> float:
        s = sorted(self.seconds)
        return s[min(len(s) - 1, int(q * len(s)))]

    @property
    def spread(self) -> float:
        """p90 - p10, in seconds."""
        return self.quantile(0.9) - self.quantile(0.1)


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def time_fn(fn, device: str, repeats: int = 20, warmup: int = 3) -> Timings:
    """Time `fn()` `repeats` times after `warmup` calls: CUDA events on GPU, a monotonic clock
    on the CPU, the device synchronized before each clock read."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    out = Timings()
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.seconds.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.seconds.append(time.perf_counter() - t0)
    return out


class StepClock:
    """Per-step times: CUDA events on a GPU (read once at the end, so timing never stalls the
    queue), a monotonic clock on the CPU. Only what lies between `start` and `stop` counts."""

    def __init__(self, device: str):
        self.cuda, self.marks = device == "cuda", []

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self):
        self.marks.append([self._mark()])

    def stop(self):
        self.marks[-1].append(self._mark())

    def seconds(self) -> list[float]:
        if self.cuda:
            self.marks[-1][1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in self.marks]
        return [b - a for a, b in self.marks]


def interleaved_timings(fns: dict, device: str, rounds: int, calls: int) -> dict[str, list]:
    """Each function timed `calls` times per round, in alternating order round after round, so
    a busy neighbour slows every function alike: {name: [Timings of each round]}."""
    out = {name: [] for name in fns}
    items = list(fns.items())
    for r in range(rounds):
        for name, fn in (items if r % 2 == 0 else items[::-1]):
            out[name].append(time_fn(fn, device, repeats=calls, warmup=1))
    return out


def paired_difference(through: list, direct: list) -> float:
    """Median over rounds of (quickest call through - quickest direct call) in the same round.
    Noise only ever adds time, so each round's quickest call is its best estimate of the true
    cost, and pairing the rounds cancels what the machine did in between."""
    return statistics.median(min(a.seconds) - min(b.seconds) for a, b in zip(through, direct))


def per_round_best(rounds: list) -> Timings:
    """Each round's quickest call: on a shared machine the best estimate a round gives (the
    median over rounds then keeps one lucky round from deciding)."""
    return Timings([min(r.seconds) for r in rounds])


def cache_lookup_seconds(fn, device: str, calls: int = 20) -> float | None:
    """Mean time per call of the profiler's "TorchDynamo Cache Lookup" events (the lookup of
    the cache entry, guards included); None when the profiler records none."""
    from kit.measure.profiler import profiled
    with profiled(device) as prof:
        for _ in range(calls):
            fn()
        synchronize(device)
    events = [e for e in prof.events() if e.name == "TorchDynamo Cache Lookup"]
    if not events:
        return None
    return sum(e.cpu_time_total for e in events) / 1e6 / calls


# --- whether a median can be trusted -----------------------------------------------------------

# p10 to p90 wider than 1.5 medians: not a quiet machine's spread. On the 2-core EPYC with
# nothing else running, chapter 04's strategies spread 58-92% of their medians (their first
# steps of a round slower); beside a test suite, 186% to 6,700% (chapters 04 and 05).
NOISY_SPREAD = 1.5
OTHER_WORK = 1.0    # a whole core's worth of other work beside the run's own threads
RERUN = "close other work and run the cell again"


def spread_warning(seconds: list[float]) -> str | None:
    """Why the median of `seconds` is not to be trusted from its own spread (p10 to p90 wider
    than NOISY_SPREAD medians), or None."""
    t = Timings(list(seconds))
    median, p10, p90 = t.median, t.quantile(0.1), t.quantile(0.9)
    if median <= 0 or (p90 - p10) <= NOISY_SPREAD * median:
        return None
    return f"p10–p90 {p10 * 1e3:,.2f}–{p90 * 1e3:,.2f} ms around a {median * 1e3:,.2f} ms median"


def load_warning(load_average: dict, threads: int) -> str | None:
    """Why the machine was too busy to trust a timing, or None: the 1-minute load average as
    the timed runs end (`load_average`: "before", "after", each os.getloadavg(); "before"
    only when there is no "after": at the start it still counts the chapter before) more than
    OTHER_WORK above the run's own `threads`."""
    last = load_average.get("after") or load_average.get("before")
    load = last[0] if last else 0.0
    if load <= threads + OTHER_WORK:
        return None
    return f"load average {load:.1f} with {threads} threads of its own: other work shared the CPU"


def verdict_line(warnings: dict[str, str]) -> str:
    """The chapter's word on its timings, in one line: steady, or what is not to be trusted
    (the machine's load, and how many medians spread too wide, the first of them with why)."""
    if not warnings:
        return ("Timings steady: every median's p10–p90 within 1.5 times it, and no other work "
                "on the CPU beyond a core.")
    parts = [f"the machine: {warnings['the machine']}"] if "the machine" in warnings else []
    spread = [name for name in warnings if name != "the machine"]
    if spread:
        parts.append(f"{len(spread)} median(s) whose steps spread wider than 1.5 times them "
                     f"({named(spread)}; {spread[0]}: {warnings[spread[0]]})")
    return f"Not to be trusted ({RERUN}): " + "; ".join(parts) + "."


def named(names: list[str], most: int = 3) -> str:
    """`names` joined, the first `most` of them and how many more."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def warnings_of(items, machine: str | None = None) -> dict[str, str]:
    """The machine's warning (`load_warning`, under "the machine") and every item's
    `timing_warnings()`, in one dict: what a figure or the chapter's verdict names."""
    found = {"the machine": machine} if machine else {}
    for item in items:
        found.update(item.timing_warnings())
    return found


def steps_warnings(steps: dict[str, list[float]], threads: int) -> dict[str, str]:
    """What is not to be trusted among timed steps, by name: the machine, when its load as the
    timed runs end says other work shared the CPU (`load_warning`), and each name whose steps
    spread wider than 1.5 medians (`spread_warning`). Empty: they can be compared."""
    import os
    machine = load_warning({"after": os.getloadavg()}, threads)
    found = {"the machine": machine} if machine else {}
    found.update({name: why for name, seconds in steps.items()
                  if seconds and (why := spread_warning(seconds))})
    return found
