"""Running the chapters headless (layer 7, above `kit.pages`): `notebooks` runs them through
papermill (`python -m kit run`), `papermill_engine` is the papermill engine that follows each cell,
`progress` the live line on the terminal, `runlog` the run's kernel.log."""
