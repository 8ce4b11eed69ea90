"""The kit: helpers behind the notebooks of a study kit on LLM serving memory and decode speed.

Layers, each importing only from those below it (tests/test_layers.py checks it):

    kit.cli       main, bench, bench_vllm, suite, new_checkpoint, lab, setup_plan, validate,
                  validate_steps                          python -m kit ..., ./setup.sh's plan
    kit.sweep     grid, driver                            a grid of runs on Ray
    kit.execute   notebooks, papermill_engine, progress, runlog: the chapters headless
    kit.pages     html, report, notebook_page, sweep_page what people read after a run
    kit.show      tables, plots, kv_cache_*, widgets      what a learner looks at
    kit.studies   one module per chapter, 00 to 05        the comparisons, each a leaf
    kit.vllm      installed, log, model_folder, kv_sizing, engine_runs, greedy: the real vLLM
    kit.engine    model (and its layers), the KV cache (specs per layer, groups, the run's
                  layout and config), budget, block manager, profile run, decode, its fit and
                  its runners, the ways to run a step, serving trace
    kit.measure   device, timing, memory, throughput, dtype speed, roofline, step breakdown
    kit.config    data, families, model_config, settings: one validated configuration (with
                  kit.errors, kit.units: bytes and rates, kit.results: what a notebook records
                  and the run folders)

Every chapter takes one `Settings` from `kit.load` (in a notebook `kit.notebook_settings`) and
records through `kit.results.Recorder`; `kit.execute.notebooks` runs them headless.
"""
from kit.config import Settings, load, notebook_settings
from kit.errors import ConfigError

__all__ = ["ConfigError", "Settings", "load", "notebook_settings"]
__version__ = "0.1.0"
