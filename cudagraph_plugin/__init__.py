"""megatron-cudagraph-plugin: CUDA graphs for any Megatron-Core training loop.

Public API (imported on first use, so ``import cudagraph_plugin`` stays cheap)::

    from cudagraph_plugin import check_config, CudaGraphConfigError

    result = check_config(cfg, te_version="2.12")   # changes nothing
    result.problems, result.autofixes, result.advice, result.notes

    from cudagraph_plugin import abort_process_groups

    abort_process_groups(timeout_s=10)   # a host's teardown after an abnormal end: every
                                         # process group aborted at once (see its docstring)

    from cudagraph_plugin import note_refusal_speaker

    print_refusal(note_refusal_speaker(ConfigurationError(...)))   # a host's own refusal
                                         # of its arguments, said once per torchrun job
    from cudagraph_plugin import JobArgumentParser   # argparse's errors said that way, in
                                         # two lines (exit 2); parser.refuse(problems)

    from cudagraph_plugin import pad_step, BucketOverflowError   # bucketed graphs: padding
    from cudagraph_plugin import parse_buckets, bucket_for, padding_waste_percent
                                         # their arithmetic, as the plugin reads and pads

    from cudagraph_plugin import StaticShapeError, HyperparameterChangedError   # what a
                                         # replay refuses (a changed shape or setting)

The package is layered; each layer imports only the ones listed before it (a test keeps
it so, ``docs/architecture.md`` draws it):

* ``hookspecs`` (its own distribution) — the contract between host and plugins;
* ``config/``  — pure Python: read settings from any host config, the rules, the
  environment facts, advice, and the one writer of automatic fixes (``check_config``);
* ``cli/``     — the command-line flags, the harness overrides and the ``check`` command;
* ``compat/``  — the only code that knows megatron-core's and Transformer Engine's APIs;
* ``runtime/`` — one run: the plugin class and the small objects it delegates to;
* ``entry``    — the entry-point module that registers a plugin per run.

The flat modules of 0.1.0 (``settings``, ``validation``, ``preflight``, ``config_check``,
``check``, ``guard``, ``report``, ``plugin``, ``mechanisms``, ``cleanup``) re-export their
names for one release and warn.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "check_config": "cudagraph_plugin.config.check",
    "ConfigCheck": "cudagraph_plugin.config.check",
    "CudaGraphConfigError": "cudagraph_plugin.config.errors",
    "Violation": "cudagraph_plugin.config.errors",
    "AutoFix": "cudagraph_plugin.config.fixes",
    "abort_process_groups": "cudagraph_plugin.compat.device",
    "note_refusal_speaker": "cudagraph_plugin.runtime.configure_refusal",
    "JobArgumentParser": "cudagraph_plugin.runtime.configure_refusal",
    "pad_step": "cudagraph_plugin.runtime.padding",
    "pad_to_bucket": "cudagraph_plugin.runtime.padding",
    "BucketOverflowError": "cudagraph_plugin.runtime.padding",
    "parse_buckets": "cudagraph_plugin.config.buckets",
    "bucket_for": "cudagraph_plugin.config.buckets",
    "padding_waste_percent": "cudagraph_plugin.config.buckets",
    "StaticShapeError": "cudagraph_plugin.runtime.guard",
    "HyperparameterChangedError": "cudagraph_plugin.runtime.optimizer_sync",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'cudagraph_plugin' has no attribute {name!r}")
