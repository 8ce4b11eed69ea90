"""Instruments (layer 1, above `kit.config`): the device and what it holds, clocks and timing
statistics, memory measurement, the bandwidth floor of a decode step, and profiles split into
parts. They know nothing of the kit's model: each one measures a callable, a tensor or a shape."""
