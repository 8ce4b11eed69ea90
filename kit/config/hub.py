"""A model by its Hugging Face id (`Qwen/Qwen3-0.6B`), as vLLM takes it: only its config.json,
fetched once through huggingface_hub into the usual cache (HF_HOME, HF_HUB_CACHE) and read
from there afterwards, so the notebooks' kernels and later runs need no network. The kit
never downloads weights: a model by id runs with random weights, as a config.json path does.
huggingface_hub is imported here only when an id is given (this is the bottom layer)."""
from __future__ import annotations

import re
from pathlib import Path

from kit.errors import ConfigError

CONFIG = "config.json"
# `org/name`; a bare name is one under data/models/, and a name ending in .json is a path
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# seconds the Hub has to answer before it counts as unreachable: one short HEAD, because
# hf_hub_download retries an unreachable Hub for another minute before it gives up
HUB_TIMEOUT = 10


def is_hub_id(model: str) -> bool:
    """`org/name`, as the Hub names models (checked only where no local path of that name
    exists: a path wins)."""
    return bool(HUB_ID.fullmatch(model)) and not model.endswith(".json")


def hub_config(repo_id: str, instead: str) -> Path:
    """The config.json of `repo_id` in huggingface_hub's cache: read from there when cached
    (no network), else fetched into it; with the Hub offline (HF_HUB_OFFLINE=1) the cache
    only. Anything else is a ConfigError naming the id, why, and `instead` (what to give)."""
    try:
        from huggingface_hub import constants, try_to_load_from_cache
    except ImportError:
        raise ConfigError(f"model {repo_id!r} is a Hugging Face id, and reading one needs "
                          f"huggingface_hub (pip install huggingface_hub); {instead}") from None
    cached = try_to_load_from_cache(repo_id, CONFIG)
    if isinstance(cached, str):
        return Path(cached)
    where = f"not in the Hugging Face cache {constants.HF_HUB_CACHE}"
    if cached is not None:  # the cache remembers that the repository has no config.json
        why = "its repository on the Hub holds no config.json (as the cache remembers)"
    elif constants.HF_HUB_OFFLINE:
        why = (f"the Hub is offline (HF_HUB_OFFLINE=1) and its config.json is {where} "
               "(fetch it once with the network on)")
    else:
        try:
            return fetch_config(repo_id)
        except Exception as e:  # noqa: BLE001: every way the Hub can fail reads as one line
            why = hub_failure(e, repo_id, where)
    raise ConfigError(f"model {repo_id!r}: {why}; {instead}")


def fetch_config(repo_id: str) -> Path:
    """config.json into the cache: a short HEAD first, so that an unreachable Hub fails in
    HUB_TIMEOUT seconds, then huggingface_hub's own download."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    get_hf_file_metadata(hf_hub_url(repo_id, CONFIG), timeout=HUB_TIMEOUT)
    return Path(hf_hub_download(repo_id, CONFIG, etag_timeout=HUB_TIMEOUT))


def hub_failure(e: Exception, repo_id: str, where: str) -> str:
    """Why the Hub did not give `repo_id`'s config.json, in a clause."""
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError,
                                        HFValidationError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError)
    login = "log in with `hf auth login` or set HF_TOKEN"
    if isinstance(e, GatedRepoError):
        return f"it is gated: accept its terms on https://huggingface.co/{repo_id} and {login}"
    if isinstance(e, RepositoryNotFoundError):
        return f"the Hub has no model of that id (or it is private: {login})"
    if isinstance(e, EntryNotFoundError):
        return "its repository on the Hub holds no config.json"
    if isinstance(e, HFValidationError):
        return f"it is not a valid Hugging Face id ({str(e).splitlines()[0]})"
    if isinstance(e, OfflineModeIsEnabled):
        return f"the Hub is offline and its config.json is {where}"
    if isinstance(e, HfHubHTTPError) and getattr(e, "response", None) is not None:
        return f"the Hub answered HTTP {e.response.status_code} and its config.json is {where}"
    return (f"the Hub could not be reached ({type(e).__name__}) and its config.json is "
            f"{where} (HF_HUB_OFFLINE=1 skips the Hub)")
