"""The real vLLM beside the kit (layer 3, above `kit.engine`, below `kit.studies`): whether it is
installed (`installed`), its log kept off the learner's screen (`log`), the model folders it
starts from (`model_folder`), the KV cache specs its model builds from a config.json on the meta
device (`model_specs`), its KV cache arithmetic on them without an engine (`kv_sizing`; many
settings of one model: `sizer`; concurrency against max_model_len, windowed beside full
attention: `concurrency`), its engine started, read and timed (`engine_runs`) and its greedy
tokens from a checkpoint (`greedy`). Importing them imports no vLLM and changes no environment
variable: that happens when an engine starts or a model is built. When vLLM is missing or cannot
start, the functions return a result whose `error` says why and what to do, never a traceback,
so a notebook can go on."""
