"""The host's default implementations of the perform hooks.

Registered by :func:`hookspecs.get_plugin_manager` and marked ``trylast`` so that any other
plugin can take over (return a result first) or wrap them (``wrapper=True``). Duck-typed
on megatron-core's ``DistributedDataParallel`` API: no torch import.
"""

from __future__ import annotations

from typing import Any

from hookspecs.markers import hookimpl


@hookimpl(trylast=True)
def mcgraph_forward_backward_func(forward_backward_func: Any) -> Any:
    return forward_backward_func


@hookimpl(trylast=True)
def mcgraph_disable_forward_pre_hook(model: list[Any], param_sync: bool) -> bool:
    for chunk in model:
        chunk.disable_forward_pre_hook(param_sync=param_sync)
    return True


@hookimpl(trylast=True)
def mcgraph_enable_forward_pre_hook(model: list[Any]) -> bool:
    for chunk in model:
        chunk.enable_forward_pre_hook()
    return True
