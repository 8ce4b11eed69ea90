"""Instruments (layer 1, above `kit.config`): the device and what it holds, clocks and timing
statistics, memory measurement, copy and matmul throughput and each dtype's speed against
float32's, the bandwidth floor of a decode step, and a few steps under torch.profiler broken
down into parts (from the profile's table as plain rows, which a GPU run can record). They know
nothing of the kit's model: each one measures a callable, a tensor or a shape."""
