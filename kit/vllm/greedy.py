"""vLLM's greedy tokens from a checkpoint's real weights (chapter 05's token-for-token comparison)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kit.units import MiB
from kit.vllm.engine_runs import keep_torch_threads, shutdown
from kit.vllm.installed import hooks_released, in_process, inspected_here
from kit.vllm.log import captured_vllm_log


@dataclass
class GreedyRun:
    """vLLM's greedy tokens for each prompt, from a checkpoint's real weights, and the
    log-probability vLLM gave each chosen token."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    then: object = None  # what `then(llm)` returned, when given


def cpu_latent_args(folder: Path, dtype: str) -> dict:
    """What vLLM's CPU engine must be given for a latent attention model (DeepSeek), {}
    for any other model or device:

    - in float32 or float16, the attention backend: on a CPU with AMX vLLM picks `AMX_MLA`,
      which packs its weights in bfloat16 only (vLLM fails to start: "expect weight to be
      bfloat16, ..."), so its reference `CPU_MLA` (blocks of 16) instead;
    - its rotary embedding as vLLM's own torch code (`custom_ops: ["-rotary_embedding"]`,
      `RotaryEmbedding.forward_native`): vLLM 0.32's MLA turns two strided views in place
      (`q[..., qk_nope_head_dim:]`, `k_pe.unsqueeze(1)`; vllm/model_executor/layers/mla.py),
      and the CPU kernel behind `forward_cpu` (csrc/cpu/pos_encoding.cpp) reads them as one
      head per token with the head stride as the token stride, so it turns the wrong elements
      (tests/test_deepseek_v3.py pins it down). With it, a tiny float32 DeepSeek-V3 gave 1 of
      72 tokens equal to transformers'; with vLLM's torch rotary, 72 of 72."""
    from vllm.platforms import current_platform
    from kit.config.cache_kinds import LATENT_FAMILIES
    model_type = json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    if model_type not in LATENT_FAMILIES or not current_platform.is_cpu():
        return {}
    args = {"compilation_config": {"custom_ops": ["-rotary_embedding"]}}
    return args if dtype == "bfloat16" else {**args, "attention_backend": "CPU_MLA"}


def greedy_from_checkpoint(folder: Path, prompts: list[list[int]], new_tokens: int,
                           dtype: str = "float32", block_size: int = 128,
                           then=None) -> GreedyRun:
    """Start `vllm.LLM` eagerly on a checkpoint folder (its real weights: no dummy load, no
    tokenizer), generate `new_tokens` greedy tokens per prompt with each one's log-probability
    (`SamplingParams(logprobs=1)`), and shut it down. Raises vLLM's errors. `ignore_eos`
    alone runs every request to `new_tokens`: `min_tokens` would also censor the end-of-sequence
    token until then (vLLM's `MinTokensLogitsProcessor`), so where it is the argmax, vLLM's
    greedy token would be the runner-up and no longer the kit's (or transformers').
    `then(llm)`, when given, runs on the same engine before it shuts down (chapter 05 times an
    MoE model's decode steps on it: one engine start for both)."""
    in_process()
    from vllm import LLM, SamplingParams
    longest = max(len(p) for p in prompts) + new_tokens
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0, logprobs=1,
                            detokenize=False)
    # vLLM's start-up and shut-down lines (seventy-odd, a traceback among them), its C-level
    # NUMA-binding warning and its weight-loading bar stay out of the notebook's output; a
    # failure still raises its message
    with keep_torch_threads(), hooks_released(), inspected_here(), captured_vllm_log([]):
        llm = LLM(model=str(folder), skip_tokenizer_init=True, enforce_eager=True, dtype=dtype,
                  block_size=block_size, max_model_len=max(longest, block_size),
                  max_num_seqs=len(prompts), max_num_batched_tokens=max(longest, 256),
                  kv_cache_memory_bytes=64 * MiB, enable_prefix_caching=False, seed=0,
                  use_tqdm_on_load=False, **cpu_latent_args(folder, dtype))
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
            after = then(llm) if then is not None else None
        finally:
            shutdown(llm)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[step[t].logprob for t, step in zip(toks, o.outputs[0].logprobs)]
                for toks, o in zip(tokens, outs)]
    return GreedyRun(tokens, logprobs, after)


def same_tokens(kit: list[list[int]], vllm: list[list[int]]) -> tuple[int, int] | None:
    """(equal, of): the tokens the two sides generated for the same prompts from the same
    weights, position by position (None when a side has none): all equal says both did the
    same work; a greedy near-tie in bf16 may part them."""
    if not kit or not vllm:
        return None
    pairs = [(a, b) for ks, vs in zip(kit, vllm) for a, b in zip(ks, vs)]
    return sum(a == b for a, b in pairs), max(sum(map(len, kit)), sum(map(len, vllm)))
