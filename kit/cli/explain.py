"""`python -m kit explain LOG`: a vLLM start-up log's memory and KV cache numbers, each
computed again by vLLM 0.32's sizing code from the model's config.json and the run's settings,
with whether it agrees with the log, the pitfalls the log shows and a what-if table
(`kit.vllm.log_numbers`, `kit.studies.your_vllm`). `--json` prints the same as one JSON document."""
from __future__ import annotations

import json

from kit.errors import ConfigError

SET_NAMES = ("max_model_len", "block_size", "dtype", "kv_cache_dtype", "tensor_parallel_size",
             "max_num_batched_tokens", "max_num_seqs", "enable_prefix_caching",
             "gpu_memory_utilization", "total_memory_gib", "vllm_version")


def given_settings(pairs: list[str]) -> dict:
    """`--set name=value` pairs (values read as `kit run -p` reads them): only the settings
    that size a KV cache."""
    from kit.execute.notebooks import parse_params
    for pair in pairs:
        name, sep, _ = pair.partition("=")
        if not sep or name not in SET_NAMES:
            raise ConfigError(f"--set {pair!r}: give name=value, the name one of "
                              f"{', '.join(SET_NAMES)}")
    return parse_params(pairs)


def text_lines(doc: dict) -> list[str]:
    """The document as a reader sees it in a terminal."""
    lines = [doc["answer"], ""]
    for n in doc["numbers"]:
        mark = {True: "agrees", False: "DIFFERS", None: "from the log"}[n["agrees"]]
        lines.append(f"{mark:>12}  {n['what']}: log {n['logged']}, kit {n.get('kit') or '-'}")
        lines.append(f"{'':>14}{n['how']}")
        if n.get("why"):
            lines.append(f"{'':>14}why: {n['why']}")
    lines += ["", "Pitfalls:"] + [f"  - {p}" for p in doc["pitfalls"] or ["none shown"]]
    lines += ["", "What if (sized at the log's KV cache memory):"]
    for r in doc["what_if"]:
        conc = f"{r['max_concurrency']:.2f}x" if r["max_concurrency"] else "refused"
        reach = {True: "  reaches the target", False: "", None: ""}[r["reaches"]]
        lines.append(f"  {r['change']:<52} {conc:>10} at {r['max_model_len']:,}{reach}"
                     + (f"  ({r['note']})" if r["note"] else ""))
    return lines


def explain_command(args) -> int:
    from kit.studies.your_vllm import document, explain_log, target_of
    given, target = given_settings(args.set or []), target_of(args.target)
    doc = document(explain_log(args.log, args.model, given), target)
    print(json.dumps(doc, indent=1, default=str) if args.json else "\n".join(text_lines(doc)))
    return 0


def add_cli(sub) -> None:
    """The `explain` command of `python -m kit`."""
    p = sub.add_parser("explain", help="reproduce and explain a vLLM start-up log's KV cache "
                                       "numbers")
    p.add_argument("log", help="a file holding vLLM's start-up output")
    p.add_argument("--model", help="the model when the log's cannot be found offline: a name "
                                   "under data/models/, a config.json or a Hugging Face id")
    p.add_argument("--set", action="append", metavar="NAME=VALUE",
                   help=f"a setting the log does not state ({', '.join(SET_NAMES)})")
    p.add_argument("--target", help="REQUESTSxTOKENS: mark the what-if rows that reach it")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=explain_command)
