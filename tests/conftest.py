"""Shared test set-up for the whole suite.

This module owns two things every test relies on:

* ``examples/`` on ``sys.path``, so tests import the example host (``train_gpt``) and the
  CUDA-to-CPU redirect (``cpu_redirect``) the way the example script itself does;
* blocking the ``cudagraph`` entry point while its module does not exist yet: the
  distribution declares ``cudagraph = cudagraph_plugin.entry``, and loading a missing module
  would fail every plugin manager. Once ``cudagraph_plugin.entry`` exists this does nothing.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from hookspecs import BLOCK_ENV_VAR

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"

if str(EXAMPLES_DIR) not in sys.path:
    sys.path.insert(0, str(EXAMPLES_DIR))


def _cudagraph_entry_missing() -> bool:
    try:
        return importlib.util.find_spec("cudagraph_plugin.entry") is None
    except ModuleNotFoundError:
        return True


def _blocked_value(environ: dict[str, str] | os._Environ[str]) -> str | None:
    """The block list with ``cudagraph`` added while its module is missing, else ``None``."""
    if not _cudagraph_entry_missing():
        return None
    blocked = [name.strip() for name in environ.get(BLOCK_ENV_VAR, "").split(",") if name.strip()]
    if "cudagraph" in blocked:
        return None
    return ",".join([*blocked, "cudagraph"])


@pytest.fixture(autouse=True)
def _block_missing_cudagraph_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    value = _blocked_value(os.environ)
    if value is not None:
        monkeypatch.setenv(BLOCK_ENV_VAR, value)


@pytest.fixture(scope="session")
def subprocess_env() -> dict[str, str]:
    """Environment for a child Python: this one, with the same plugin blocking."""
    env = dict(os.environ)
    value = _blocked_value(env)
    if value is not None:
        env[BLOCK_ENV_VAR] = value
    return env
