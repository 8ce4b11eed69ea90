"""The kit: helpers behind the notebooks of a study kit on LLM serving memory and decode speed.

Layers, each importing only from those below it (tests/test_layers.py checks it):

    kit.run       runner, results, report, bench, cli     (python -m kit ...)
    kit.show      tables, plots, widgets                  what a learner looks at
    kit.studies   one module per chapter, 00 to 05        the comparisons
    kit.engine    model, KV cache, block tables, decode, runners, serving trace
    kit.measure   device, timing, memory, roofline, step profile
    kit.config    settings, model shapes, validation (and kit.errors)

Every chapter takes one `Settings` from `kit.load` (in a notebook `kit.notebook_settings`) and
records through `kit.run.results.Recorder`; `kit.run.runner` runs them headless.
"""
from kit.config import Settings, load, notebook_settings
from kit.errors import ConfigError

__all__ = ["ConfigError", "Settings", "load", "notebook_settings"]
__version__ = "0.1.0"
