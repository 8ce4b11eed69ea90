"""The small serving engine the chapters build (layer 2, above `kit.measure`): the decoder model,
the paged KV cache and its arithmetic, block tables, the paged decode step and its no-cache
reference, the ways to run a step (eager, compiled, guard-free, bytecode hook, CUDA graphs),
and a serving trace of decode batch sizes."""
