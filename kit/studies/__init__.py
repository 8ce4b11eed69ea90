"""One module per chapter's comparison (layer 4, above `kit.vllm`), named after its notebook:
`setup_check` (00), `memory_profiling` (01), `kv_cache_sizing` (02), `compile_strategies` (03),
`decode_timing` (04), `vllm_side_by_side` and `token_for_token` (05). Each is a leaf: no study
imports another; what chapters share lives below (`kit.engine.profile_run`,
`kit.engine.decode_runners`, `kit.measure.dtype_speed`, `kit.vllm`). Each measurement returns a
small result dataclass that the notebook displays (through `kit.show`) and records; none of them
prints tables or draws figures."""
