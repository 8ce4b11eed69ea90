"""The real vLLM beside the kit (layer 3, above `kit.engine`, below `kit.studies`): whether it is
installed (`installed`), its log kept off the learner's screen (`log`), the model folders it
starts from (`model_folder`), the KV cache specs its model builds from a config.json on the meta
device (`model_specs`), its KV cache arithmetic on them without an engine (`kv_sizing`, many
settings of one model at a time included; concurrency against max_model_len, windowed beside full
attention: `concurrency`), its engine started, read and timed (`engine_runs`), its greedy
tokens from a checkpoint (`greedy`) and its CPU fused MoE on one of the kit's layers (`fused_moe`). Importing them imports no vLLM and changes no environment
variable: that happens when an engine starts or a model is built. When vLLM is missing or cannot
start, the functions return a result whose `error` says why and what to do, never a traceback,
so a notebook can go on."""

import logging as _logging

# vLLM's CPU build warns, when it first imports its Triton shim, that Triton has no CPU backend:
# true of every CPU machine and nothing to act on, but JupyterLab would show it as an error box
# in chapter 05. That one record is dropped where it is made; every other vLLM line stays.
_logging.getLogger("vllm.triton_utils.importing").addFilter(
    lambda record: "doesn't include CPU backend" not in record.getMessage())
# transformers 5.19 validates Llama 3 RoPE scaling as if low_freq_factor < high_freq_factor
# were required, and Llama-4-Scout's published config has both at 1.0 (which it then computes
# without complaint): a warning per read of that config.json, shown as an error box in chapter 05.
_logging.getLogger("transformers.modeling_rope_utils").addFilter(
    lambda record: "must be greater than low_freq_factor" not in record.getMessage())
