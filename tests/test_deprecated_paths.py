"""The 0.1 import paths keep working for one release: each old module re-exports the very
objects of their new homes and warns once, when imported."""

from __future__ import annotations

import importlib
import sys

import pytest

import cudagraph_plugin

OLD_MODULES = {
    "cudagraph_plugin.settings": ("Settings", "read_settings", "FIELD_PATHS", "to_bool"),
    "cudagraph_plugin.validation": (
        "CudaGraphConfigError",
        "Violation",
        "find_violations",
        "advice",
        "plan_autofixes",
        "write_autofixes",
    ),
    "cudagraph_plugin.preflight": ("preflight", "inspect_environment"),
    "cudagraph_plugin.config_check": ("check_config", "ConfigCheck"),
    "cudagraph_plugin.check": ("run_check", "build_parser", "main"),
    "cudagraph_plugin.guard": ("ShapeGuard", "StaticShapeError", "signature"),
    "cudagraph_plugin.report": ("RunReport", "StepTimer", "MemorySnapshot", "verdict"),
    "cudagraph_plugin.plugin": ("CudaGraphPlugin", "Phase", "FALLBACK_REPLAY_STEPS"),
    "cudagraph_plugin.mechanisms": ("FullIterationGraphs", "TEGraphs", "OptimizerGraphs"),
    "cudagraph_plugin.cleanup": ("ReleaseStep", "release_each", "settle"),
}


def _import_fresh(name: str):
    sys.modules.pop(name, None)
    return importlib.import_module(name)


@pytest.mark.parametrize("name", sorted(OLD_MODULES))
def test_old_module_warns_and_re_exports_the_same_objects(name, monkeypatch):
    monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.warns(DeprecationWarning, match=name.replace(".", r"\.") + " is deprecated"):
        module = _import_fresh(name)
    assert set(OLD_MODULES[name]) <= set(module.__all__)
    for attr in module.__all__:
        value = getattr(module, attr)
        home = getattr(value, "__module__", None)
        if home and home.startswith("cudagraph_plugin.") and home != name:
            # a function or class: the object its new module defines, not a copy
            assert getattr(sys.modules[home], value.__name__) is value
    sys.modules.pop(name, None)


def test_write_autofixes_is_the_one_writer_under_its_old_name(monkeypatch):
    from cudagraph_plugin.config.fixes import write_fixes

    monkeypatch.delitem(sys.modules, "cudagraph_plugin.validation", raising=False)
    with pytest.warns(DeprecationWarning):
        old = _import_fresh("cudagraph_plugin.validation")
    assert old.write_autofixes is write_fixes
    sys.modules.pop("cudagraph_plugin.validation", None)


def test_the_public_names_are_unchanged():
    assert set(cudagraph_plugin.__all__) == {
        "__version__",
        "check_config",
        "ConfigCheck",
        "CudaGraphConfigError",
        "Violation",
        "AutoFix",
        "abort_process_groups",  # added by issue 22 (hosts' teardown after a failure)
        "note_refusal_speaker",  # issue 22: a host's own refusal said once per job
        "JobArgumentParser",  # issue 22: argparse's errors said so (2026-12-06)
        # added for issue 23's hosts (review of 2026-12-05: they lived in runtime/ only)
        "pad_step",
        "pad_to_bucket",
        "BucketOverflowError",
        "StaticShapeError",
        "HyperparameterChangedError",
        # the bucket arithmetic (user trial of 2026-12-05: rl_loop.py imported it from
        # internal modules)
        "parse_buckets",
        "bucket_for",
        "padding_waste_percent",
    }
    from cudagraph_plugin.config.check import ConfigCheck, check_config
    from cudagraph_plugin.config.errors import CudaGraphConfigError

    assert cudagraph_plugin.check_config is check_config
    assert cudagraph_plugin.ConfigCheck is ConfigCheck
    assert cudagraph_plugin.CudaGraphConfigError is CudaGraphConfigError
    from cudagraph_plugin.runtime import guard, padding

    assert cudagraph_plugin.pad_step is padding.pad_step
    assert cudagraph_plugin.parse_buckets is padding.parse_buckets
    assert cudagraph_plugin.StaticShapeError is guard.StaticShapeError


def test_compat_and_cli_keep_their_old_names():
    from cudagraph_plugin import cli, compat

    for name in ("any_rank", "DDPBuildContext", "te_version", "mcore_version", "versions"):
        assert callable(getattr(compat, name))
    for name in ("add_cuda_graph_arguments", "apply_overrides", "parse_scope_arg"):
        assert callable(getattr(cli, name))
