"""One module per chapter's comparison (layer 3, above `kit.engine`), named after its notebook:
`setup_check` (00), `memory_profiling` (01), `kv_cache` (02), `compile_strategies` (03),
`decode_timing` (04), `vllm_side_by_side` (05, with `vllm_bridge`, the real engine). Each
measurement returns a small result dataclass that the notebook displays (through `kit.show`)
and records; none of them prints tables or draws figures."""
