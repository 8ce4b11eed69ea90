"""A stand-in for torchvision, for sizing Qwen3.5 with vLLM's own code on a machine without it:
vLLM's Qwen3.5 module imports Qwen3-VL's, which imports transformers' image processors, which
import torchvision. Sizing never processes an image; any name asked of any torchvision module
is a placeholder that fails if called."""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+kit-stand-in"


class _Placeholder:
    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"torchvision is not installed ({self._name} was called)")

    def __getattr__(self, attr):
        return _attribute(self._name, attr)

    def __mro_entries__(self, bases):
        return (object,)


def _attribute(owner, attr):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Placeholder(f"{owner}.{attr}")


def _module(name):
    module = types.ModuleType(name)
    module.__path__ = []
    module.__getattr__ = lambda attr: _attribute(name, attr)
    return module


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _module(spec.name)

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__getattr__ = lambda attr: _attribute("torchvision", attr)
