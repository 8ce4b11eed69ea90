"""Sweeps (layer 8, above `kit.execute`): `grid` the points of a grid of settings, `driver` one
headless run per point as Ray tasks, collected into one folder and page."""
