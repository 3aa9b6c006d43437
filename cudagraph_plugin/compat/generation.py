"""Which megatron-core generation is installed, and its spelling of the model config.

Differences are detected by feature (a field, an attribute, a parameter), never by reading
version numbers: megatron-core on ``PYTHONPATH`` has no package metadata, and release
candidates of a new generation sort before its first release. Version numbers are read only
to be shown (the report, ``check``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from cudagraph_plugin.config import environment


@functools.cache
def new_generation() -> bool:
    """megatron-core's 0.18+ configuration spelling: ``TransformerConfig`` has
    ``cuda_graph_modules`` (and the ``full_iteration`` impl)."""
    from megatron.core.transformer import TransformerConfig

    return "cuda_graph_modules" in {field.name for field in dataclasses.fields(TransformerConfig)}


def versions() -> dict[str, str | None]:
    """torch / megatron-core / Transformer Engine versions for reports (never raises)."""

    def shown(read: Callable[[], Any]) -> str | None:
        try:
            value = read()
        except Exception:  # a report must not fail over a version it cannot read
            return None
        return None if value is None else str(value)

    return {
        "torch": shown(
            lambda: environment.dist_version("torch") or __import__("torch").__version__
        ),
        "megatron-core": shown(environment.mcore_version),
        "transformer-engine": shown(environment.installed_te_version),
    }


def model_config_kwargs(impl: str, scope: tuple[str, ...], warmup_steps: int) -> dict[str, Any]:
    """``TransformerConfig`` fields for these settings, spelled for the installed MCore."""
    kwargs: dict[str, Any] = {"cuda_graph_impl": impl}
    if impl == "none":
        if not new_generation():
            # 0.16's default scope "full" warns "full scope is deprecated" on every build, a
            # graphs-off one too (users take it for their flag); [] is the same whole layer
            kwargs["cuda_graph_scope"] = []
        return kwargs
    kwargs["cuda_graph_warmup_steps"] = warmup_steps
    kwargs["use_te_rng_tracker"] = True
    if new_generation():
        # 0.16's name left None: a host's base holding it (a config written for 0.16) would
        # make 0.18+ assert "cuda_graph_scope and cuda_graph_modules cannot be set together"
        kwargs["cuda_graph_scope"] = None
        if "full_iteration" in scope:
            kwargs["cuda_graph_impl"] = "full_iteration"
            kwargs["cuda_graph_modules"] = []
        else:
            kwargs["cuda_graph_modules"] = list(scope)
    else:
        kwargs["cuda_graph_scope"] = list(scope)
    return kwargs


def scope_names_after_build(model_config: Any) -> tuple[str, list[str]]:
    """The scope field of the installed generation, and the names (strings) in it in a
    built ``TransformerConfig``, whose ``__post_init__`` makes enum members of them: strings
    there were written after the build (an override applied to the finalised config), and
    megatron-core's own checks (``CudaGraphScope.full_iteration in config.cuda_graph_scope``)
    do not see them."""
    from megatron.core.transformer import TransformerConfig

    field = "cuda_graph_modules" if new_generation() else "cuda_graph_scope"
    if not isinstance(model_config, TransformerConfig):
        return field, []
    value = getattr(model_config, field, None)
    names = [item for item in value if isinstance(item, str)] if isinstance(value, list) else []
    return field, names
