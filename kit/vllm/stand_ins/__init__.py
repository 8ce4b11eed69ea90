"""Stand-ins for packages vLLM imports but this set-up cannot install, so that vLLM's own sizing
code (`kit.vllm.kv_sizing`) still runs on the models that need them. Only torchvision so far:
vLLM's Qwen3.5 module imports Qwen3-VL's, which imports transformers' image processors, which
import torchvision; PyPI's torchvision does not load beside the CPU build of torch the set-up
installs, so the set-up removes it. Sizing never touches an image: the stand-in's names are
placeholders that fail if called. vLLM's engine is not started with it."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from pathlib import Path

HERE = str(Path(__file__).parent)
# Architectures whose vLLM module imports torchvision.
NEEDS_TORCHVISION = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")


def needs_torchvision(model_folder: Path) -> bool:
    """Whether vLLM's module for the folder's config.json imports torchvision."""
    try:
        archs = json.loads((Path(model_folder) / "config.json").read_text()).get("architectures")
    except (OSError, ValueError):
        return False
    return bool(set(archs or ()) & set(NEEDS_TORCHVISION))


def torchvision_stand_in(model_folder: Path) -> bool:
    """Put the stand-in where this process and vLLM's model inspection (a child process) find
    it, when the folder's model needs torchvision and none is installed; True if it did. It
    stays for the rest of the process, as the vLLM modules imported through it do."""
    if not needs_torchvision(model_folder) or importlib.util.find_spec("torchvision"):
        return False
    sys.path.insert(0, HERE)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH"))
                                               if p)
    # transformers then says once that Qwen2-VL's image processor falls back to its PIL form;
    # sizing never makes one, so the line would only be noise in a chapter
    logging.getLogger("transformers.utils.import_utils").setLevel(logging.ERROR)
    return True
