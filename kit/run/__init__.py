"""Running the chapters (the top layer): `results` (what a notebook records), `runner`
(notebooks headless through papermill), `report` (a run folder as HTML), `bench` (the
benchmarks) and `cli` (`python -m kit ...`)."""
