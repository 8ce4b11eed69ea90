import os

import pytest


@pytest.fixture(autouse=True)
def _keep_run_dir_env(monkeypatch):
    """The runner sets KIT_RUN_DIR for its kernels; keep that from leaking between tests."""
    monkeypatch.delenv("KIT_RUN_DIR", raising=False)
    yield
