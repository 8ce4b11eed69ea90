"""A serving trace (chapter 03): the decode batch size of every step of a plausible serving
run, as an engine's scheduler would produce it. Plain Python, no torch: guards and recompiles
only matter when the inputs change, and this is how they change.
"""
from __future__ import annotations

import random


def decode_batch_sizes(max_num_seqs: int, num_requests: int | None = None, seed: int = 0,
                       min_tokens: int = 4, max_tokens: int = 16) -> list[int]:
    """Decode batch sizes of a plausible serving trace, one per step: requests arrive (half as
    fast again as full batches would retire them), wait for a free slot (at most max_num_seqs
    decode together), generate a random number of tokens and leave. It starts with one
    request, fills every slot (arrivals outpace departures), and drains to the last request,
    so it visits batch 1, the full batch and sizes between. `num_requests` defaults to
    3 × max_num_seqs."""
    rng = random.Random(seed)
    num_requests = num_requests or 3 * max_num_seqs
    rate = 1.5 * max_num_seqs / ((min_tokens + max_tokens) / 2)  # arrivals per step
    waiting, arrived, running, sizes = 1, 1, [], []
    while waiting or running or arrived < num_requests:
        if arrived < num_requests and sizes:
            new = min(num_requests - arrived, rng.randint(0, max(1, round(2 * rate))))
            waiting, arrived = waiting + new, arrived + new
        admit = min(waiting, max_num_seqs - len(running))
        running += [rng.randint(min_tokens, max_tokens) for _ in range(admit)]
        waiting -= admit
        if running:
            sizes.append(len(running))
        running = [left - 1 for left in running if left > 1]
    return sizes
