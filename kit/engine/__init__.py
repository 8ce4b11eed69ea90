"""The small serving engine the chapters build (layer 2, above `kit.measure`): the decoder model
(its parts in `layers`, DeepSeek's latent attention and experts in `layers.mla`, `mla_moe`),
the KV cache as vLLM 0.32 shapes it (a spec per layer, `kv_specs`; their groups, `kv_groups`;
the run's layout and config, `kv_cache`), the memory budget (`budget`), the block manager
(`block_manager`), vLLM's profile run (`profile_run`), the paged decode step, its fit in the
cache (`decode_fit`) and its no-cache reference, the ways to run a step (`runners`: eager, compiled,
guard-free, bytecode hook, CUDA graphs) and those the decode builds with them
(`decode_runners`: the step, the CPU's compiled prefill, the warm-up), and a serving trace of
decode batch sizes."""
