"""vLLM's KV cache specs as vLLM's own model builds them from a config.json: the model made on
PyTorch's meta device (no weights, no memory), each attention layer asked for its
`get_kv_cache_spec`, the way the model runner does at engine start. So a sliding window, a
layer pattern or a head count vLLM reads from the config shows up here exactly as the engine
would see it, whatever the kit believes about the model.

About 10-15 s the first time an architecture is seen (vLLM inspects it in a subprocess and
caches the answer on disk), then some 20-400 ms per model."""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import replace


def init_single_rank(vllm_config) -> None:
    """A one-rank torch.distributed world with tensor and pipeline parallel groups of one,
    as a worker sets up before it builds the model (`init_worker_distributed_environment`);
    once per process, and left alone when an engine in this process already made one. vLLM
    makes the expert-parallel group only when the world's first model is a mixture of
    experts, so a later one (after a dense model, or a dense engine) gets its group of one
    here (`ep_group_of_one`)."""
    from vllm.distributed.parallel_state import (ensure_model_parallel_initialized,
                                                 init_distributed_environment,
                                                 model_parallel_is_initialized)
    if not model_parallel_is_initialized():
        init_distributed_environment(1, 0, f"file:///tmp/kit-vllm-specs-{os.getpid()}", 0,
                                     "gloo")
        ensure_model_parallel_initialized(1, 1)
    if vllm_config.model_config.is_moe:
        ep_group_of_one()


def ep_group_of_one() -> None:
    """The expert-parallel group a one-rank MoE model's layers ask for (`get_ep_group`), made
    as `initialize_model_parallel` makes it, where the world has none yet."""
    import torch.distributed
    from vllm.distributed import parallel_state as ps
    if ps._EP is None:
        world = ps.get_world_group()
        ps._EP = ps.init_model_parallel_group(
            [[world.rank]], world.local_rank, torch.distributed.get_backend(world.device_group),
            group_name="ep")


def build_on_meta(vllm_config) -> None:
    """vLLM's model for `vllm_config` made on the meta device: every layer registers itself in
    `compilation_config.static_forward_context`, as in `BaseModelLoader.load_model`, and
    nothing is allocated (`vllm.model_executor.model_loader.utils.initialize_model`)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype
    with set_current_vllm_config(vllm_config), no_reload_metadata():
        init_single_rank(vllm_config)
        with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("meta"):
            initialize_model(vllm_config=vllm_config)


@contextmanager
def no_reload_metadata():
    """`initialize_model` without `record_metadata_for_reloading`: vLLM copies every layer's
    parameters to meta tensors so that a loaded model can later reload its weights layer by
    layer; a meta model that never loads any has no use for them, and the copying was a
    quarter of a build's time (a grid's 18 builds of two models, 7.6 s of which 3.4 s)."""
    from vllm.model_executor.model_loader import utils
    recorded = utils.record_metadata_for_reloading
    utils.record_metadata_for_reloading = lambda model: None
    try:
        yield
    finally:
        utils.record_metadata_for_reloading = recorded


def collect_specs(vllm_config) -> dict:
    """Each attention layer's KV cache spec by layer name, as the model runner collects them
    (`GPUModelRunner.get_kv_cache_spec`, which the CPU runner inherits): layers sharing
    another's cache and layers without a cache left out, each spec customized by its
    attention backend (`customize_attention_spec`)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.worker.utils import customize_attention_spec
    specs = {}
    for name, layer in get_layers_from_vllm_config(vllm_config, AttentionLayerBase).items():
        if isinstance(layer, Attention) and layer.kv_sharing_target_layer_name:
            continue
        spec = layer.get_kv_cache_spec(vllm_config)
        if isinstance(spec, AttentionSpec):
            spec = customize_attention_spec(layer.get_attn_backend(), spec)
        if spec:
            specs[name] = spec
    return specs


def per_rank(specs: dict, vllm_config) -> dict:
    """The specs of one rank of `tensor_parallel_size`: the model is built with one rank here,
    so each layer's KV heads become vLLM's per-rank count (`ModelConfig.get_num_kv_heads`,
    heads replicated when there are fewer than ranks; 1 for latent attention) and a recurrent
    layer's state the shapes its model class gives one rank
    (`get_mamba_state_shape_from_config`, which reads the tensor-parallel size), everything
    else as built."""
    from vllm.v1.kv_cache_interface import MambaSpec
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size == 1:
        return specs
    heads = vllm_config.model_config.get_num_kv_heads(pc)
    return {name: replace(spec, shapes=rank_state_shapes(vllm_config))
            if isinstance(spec, MambaSpec) else replace(spec, num_kv_heads=heads)
            for name, spec in specs.items()}


def rank_state_shapes(vllm_config) -> tuple:
    """One rank's recurrent state shapes, as vLLM's model class computes them."""
    from vllm.model_executor.models import ModelRegistry
    mc = vllm_config.model_config
    model_cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
    return tuple(model_cls.get_mamba_state_shape_from_config(vllm_config))


def release(vllm_config) -> None:
    """Forget the meta model as a model runner's `shutdown` forgets its model: the config's
    forward context emptied (so the config can build again) and vLLM's shared rotary
    embeddings dropped (`_ROPE_DICT`: an engine started later would reuse their meta
    tensors)."""
    from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT
    vllm_config.compilation_config.static_forward_context.clear()
    _ROPE_DICT.clear()


def model_kv_specs(vllm_config) -> dict:
    """vLLM's KV cache spec for every layer of the model `vllm_config` describes, built by
    vLLM's model on the meta device (`build_on_meta`), its block size then set as the engine
    sets it once the model is loaded (`update_block_size_for_backend`, which for a hybrid of
    attention and Mamba layers enlarges the attention block until a page holds a state),
    collected (`collect_specs`), then `release`d, its bytecode hooks dropped (`hooks_released`)."""
    from vllm.platforms import current_platform
    from kit.vllm.installed import hooks_released
    vllm_config.compilation_config.static_forward_context.clear()
    try:
        with hooks_released():
            build_on_meta(vllm_config)
        current_platform.update_block_size_for_backend(vllm_config)  # as `UniProcExecutor`
        return per_rank(collect_specs(vllm_config), vllm_config)
    finally:
        release(vllm_config)
