"""The small serving engine the chapters build (layer 2, above `kit.measure`): the decoder model,
the paged KV cache and its arithmetic, block tables, vLLM's profile run (`memory_profile`), the
paged decode step and its no-cache reference, the ways to run a step (`runners`: eager, compiled,
guard-free, bytecode hook, CUDA graphs) and those the decode builds with them
(`decode_runners`: the step, the CPU's compiled prefill, the warm-up), and a serving trace of
decode batch sizes."""
