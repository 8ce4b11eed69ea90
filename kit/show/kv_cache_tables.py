"""Chapter 02's tables: the KV cache config's blocks, tokens and concurrency, the block manager's
tables, one sequence's tables per group step by step, and the PR's Gemma-2B blocks in bytes;
chapter 05's agreement with vLLM's KV code per model. Each shows what a study returned."""
from __future__ import annotations

from kit.show.tables import Table, fmt_bytes


def sizing_table(config) -> Table:
    """Chapter 02's blocks, tokens and concurrency (`KVCacheConfig`)."""
    layout = config.layout
    return Table([{"bytes per token": f"{layout.bytes_per_token:,}",
                   "bytes per block": f"{layout.bytes_per_block:,}",
                   "KV budget": fmt_bytes(config.budget_bytes),
                   "num_blocks": f"{config.num_blocks:,}",
                   "cache bytes": fmt_bytes(config.cache_bytes),
                   "tokens": f"{config.num_tokens:,}",
                   "max concurrency": f"{config.max_concurrency:.2f}×"}])


def block_tables_table(tables, shown: int = 12) -> Table:
    """Each sequence's tokens and blocks, and the first `shown` entries of its block table in
    each KV cache group (`GroupedBlockTables`)."""
    return Table([{"seq": seq, **({"group": g} if len(per_group) > 1 else {}),
                   "tokens": tables.num_computed_tokens[seq], "blocks": len(t),
                   "block table": t[:shown] + (["…"] if len(t) > shown else [])}
                  for seq, per_group in tables.tables.items() for g, t in enumerate(per_group)])


def group_steps_table(result, changes_only: bool = True) -> Table:
    """One sequence's block table in each KV cache group, step by step (`TableSteps`): blocks
    held, null-block entries, blocks handed back (−) and taken (+), and the pool's free blocks;
    `changes_only`: the prefill and the steps where a block moved."""
    def ids(blocks, shown=4):
        return ", ".join(map(str, blocks[:shown])) + (f", … ({len(blocks)})"
                                                      if len(blocks) > shown else "")

    def cell(s, g):
        held = sum(b != 0 for b in s.tables[g])
        moved = "".join([f" −[{ids(s.freed[g])}]" if s.freed[g] else "",
                         f" +[{ids(s.new[g])}]" if s.new[g] else ""])
        return f"{held} held, {s.tables[g].count(0)} null{moved}"
    names = [f"group {g} ({'full' if grp.window is None else f'window {grp.window:,}'})"
             for g, grp in enumerate(result.groups)]
    steps = [s for s in result.steps
             if not changes_only or s.step == 0 or any(s.freed + s.new)]
    return Table([{"step": s.step, "tokens": s.num_computed_tokens,
                   **{name: cell(s, g) for g, name in enumerate(names)},
                   "free blocks": s.num_free_blocks} for s in steps],
                 title=f"{result.model}: sequence 0's block tables, blocks of "
                       f"{result.blocks}, {result.num_blocks:,} in the pool")


def pr_blocks_table(a, model_name: str, device: str) -> Table:
    """The PR's Gemma-2B blocks in bytes beside this run's (`PRArithmetic`)."""
    here = a.here_blocks
    return Table([
        {"": "vLLM #7796, Gemma-2B (GPU)",
         "compiled profile": f"{a.pr_blocks['compiled']:,} blocks = "
                             f"{fmt_bytes(a.pr_bytes('compiled'))}",
         "eager profile": f"{a.pr_blocks['eager']:,} blocks = "
                          f"{fmt_bytes(a.pr_bytes('eager'))}",
         "eager charged extra": f"{fmt_bytes(a.pr_extra_bytes)} "
                                f"({1 - a.pr_bytes('eager') / a.pr_bytes('compiled'):.1%} "
                                "of the cache)",
         "compiled ÷ eager": f"{a.pr_blocks['compiled'] / a.pr_blocks['eager']:.3f}"},
        {"": f"here, {model_name} ({device})", "compiled profile": f"{here['compiled']:,} blocks",
         "eager profile": f"{here['eager']:,} blocks",
         "eager charged extra": f"{fmt_bytes(a.here_extra_bytes)} "
                                f"({1 - here['eager'] / max(1, here['compiled']):.1%} "
                                "of the cache)",
         "compiled ÷ eager": f"{here['compiled'] / max(1, here['eager']):.3f}"}])


def latent_table(rows: list[dict]) -> Table:
    """What a token keeps per layer with latent attention, against multi-head K and V
    (`cache_kinds_lesson.latent_row`)."""
    return Table([{"model": r["model"], "layers": r["layers"], "heads": r["heads"],
                   "latent, B per token per layer": f'{r["latent_bytes_per_token_layer"]:,}',
                   "multi-head K and V, B": f'{r["mha_bytes_per_token_layer"]:,}',
                   "K and V ÷ latent": f'{r["mha_over_latent"]:.1f}×',
                   "latent, all layers": fmt_bytes(r["latent_bytes_per_token"])} for r in rows])


def hybrid_table(rows: list[dict], derivations: list[str] | None = None) -> Table:
    """Each hybrid's attention block, state and padding on a device
    (`cache_kinds_lesson.HybridBlock.row`), with vLLM's rule for the block worked out in a
    column of its own when `derivations` (`HybridBlock.derivation`, one per row) are given."""
    derivations = derivations or [None] * len(rows)
    return Table([{"model": r["model"], "device": r["device"],
                   "attention, B per token": f'{r["attention_bytes_per_token"]:,}',
                   "state, B per request": f'{r["state_bytes"]:,}',
                   **({"block = k × ⌈state ÷ (k × attention)⌉": d} if d else {}),
                   "attention block": f'{r["block_size"]:,} tokens',
                   "state padded": f'{r["padding"]:.2%}',
                   "groups × layers": f'{r["groups"]} × {r["layers_per_group"]}',
                   "blocks per 32k request": r["blocks_per_request"]}
                  for r, d in zip(rows, derivations)])


def grid_per_model_table(grid) -> Table:
    """Chapter 05's agreement grid (`KVAgreement` rows) counted per model: cases, agreeing,
    refused by both."""
    per_model = {}
    for r in grid:
        m = per_model.setdefault(r.model, {"model": r.model, "cases": 0, "agree": 0,
                                           "refused by both": 0})
        m["cases"] += 1
        m["agree"] += r.agree
        m["refused by both"] += bool(r.kit_error and r.vllm_error)
    return Table(list(per_model.values()), title="kit blocks = vLLM blocks, per model")
