"""What plugins answer to the hooks whose results a run uses, checked where the run takes
them, and who answered.

A run uses four kinds of answer: keyword-argument dicts (``mcgraph_model_config_kwargs``,
``mcgraph_rng_options``, merged by :func:`merge_kwargs`), context managers
(``mcgraph_model_build_context``), the warm-up length (``mcgraph_warmup_steps``) and the
forward/backward callable (``mcgraph_forward_backward_func``). A wrong answer fails here,
naming the value, what was expected and the plugins whose implementation gave it: pluggy
hands the run the answers without their authors, so where more than one plugin implements
the hook the message names each of them (the host's own defaults excepted). Without this a
list from a kwargs hook failed as ``'list' object has no attribute 'items'`` inside the
merge, and a ``None`` from a forward/backward wrapper as ``'NoneType' object is not
callable`` at step 0, in another plugin's frame.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import pluggy

from hookspecs.manager import HOST_DEFAULTS_NAME, describe_plugin
from hookspecs.ranks import launcher_rank

logger = logging.getLogger(__name__)


class SettledKwargs(dict):  # type: ignore[type-arg]
    """A kwargs answer whose fields the plugin settles from the run's own configuration
    (``why`` says how), so that they replace what the host's ``base`` holds for them.

    A host whose configuration object is its model config (Megatron-Bridge's ``cfg.model``)
    naturally passes all of it as ``base``, the plugin's own fields included
    (``cuda_graph_impl="local"``, ``cuda_graph_scope="attn,mlp"``); the plugin answers the
    same settings spelled for the installed megatron-core (``["attn", "mlp"]``, 0.18+'s
    ``cuda_graph_impl="full_iteration"``), or off where they cannot act (no CUDA device).
    Such an answer replaces the host's value, logged on rank 0 with the reason, where a
    plain dict's would be a conflict. Two plugins that disagree are refused all the same,
    in either order (a plugin that agreed with the host's value holds it too). It is a
    ``dict``: a host that merges the answers itself sees the values as they are (a copy,
    ``dict(answer)`` or ``answer | other``, is a plain dict without ``why``).
    """

    def __init__(self, values: Mapping[str, Any], *, why: str) -> None:
        super().__init__(values)
        self.why = why


def answered_by(pluginmanager: pluggy.PluginManager, hook_name: str) -> str:
    """``answered by plugin 'x' (dist)`` or ``implemented by plugins 'x' (dist), 'y'``: the
    plugins whose ``hook_name`` implementations may have given an answer (objects a plugin
    registered count as that plugin), the host's defaults excepted."""
    impls = getattr(pluginmanager.hook, hook_name).get_hookimpls()
    names = list(
        dict.fromkeys(
            describe_plugin(pluginmanager, impl.plugin_name)
            for impl in reversed(impls)  # (the order pluggy calls them in)
            if impl.plugin_name != HOST_DEFAULTS_NAME
        )
    )
    if not names:
        return "answered by the host's defaults"
    if len(names) == 1:
        return f"answered by plugin {names[0]}"
    return f"implemented by plugins {', '.join(names)}"


HOST = "the host's"


def merge_kwargs(
    results: list[dict[str, Any] | None],
    what: str,
    base: dict[str, Any] | None = None,
    *,
    who: str = "",
) -> dict[str, Any]:
    """Merge keyword-argument dicts contributed by plugins (collected hook results).

    :param results: The hook's collected results; ``None`` entries are skipped.
    :param what: What the kwargs are for, used in the error message.
    :param base: The host's own kwargs, merged first.
    :param who: Who answered (:func:`answered_by`), added to an error's message.
    :raises TypeError: if a contribution is not a mapping (``None`` aside).
    :raises ValueError: if two contributions set the same key to different values (a
        :class:`SettledKwargs` answer replaces the host's ``base`` value instead, logged).
    """
    merged: dict[str, Any] = dict(base or {})
    source = dict.fromkeys(merged, HOST)
    by = f" ({who})" if who else ""
    for contribution in results:
        if contribution is None:
            continue
        if not isinstance(contribution, Mapping):
            raise TypeError(
                f"{what}: a plugin answered {contribution!r} ({type(contribution).__name__}), "
                f"not a dict of keyword arguments{by}; answer a dict, or None for nothing"
            )
        why = contribution.why if isinstance(contribution, SettledKwargs) else None
        for key, value in contribution.items():
            if key in merged and merged[key] != value:
                if why is None or source[key] != HOST:
                    raise ValueError(
                        f"{what}: conflicting values for {key!r}: {source[key]} "
                        f"{merged[key]!r} and a plugin's {value!r}{by}; make the host and its "
                        f"plugins agree on {key!r}"
                    )
                if launcher_rank()[0] == 0:  # (each rank replaces alike: said once per job)
                    logger.info(
                        "%s: %s=%r replaces the host's %r: %s%s",
                        what,
                        key,
                        value,
                        merged[key],
                        why,
                        by,
                    )
            merged[key] = value
            # (a plugin's, once a plugin gave it: a host value a plugin agreed with is no
            # longer the host's alone for a later settled answer to replace; review of
            # 2026-12-05: the outcome depended on the order pluggy called them in)
            source[key] = "a plugin's"
    return merged


def context_managers(results: list[Any], who: str) -> list[Any]:
    """The answers of ``mcgraph_model_build_context``, each a context manager."""
    for manager in results:
        if not (hasattr(manager, "__enter__") and hasattr(manager, "__exit__")):
            hint = (
                ": return the context manager, not the function that makes it (call it: "
                "`return build_context()`)"
                if callable(manager)
                else ""
            )
            raise TypeError(
                f"mcgraph_model_build_context answered {manager!r} "
                f"({type(manager).__name__}), not a context manager ({who}); answer one, or "
                f"None for nothing{hint}"
            )
    return results


def warmup_answer(warmup: Any, who: str) -> int | None:
    """The answer of ``mcgraph_warmup_steps``: a non-negative int or ``None``."""
    if warmup is not None and (
        isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0
    ):
        raise ValueError(
            f"mcgraph_warmup_steps answered {warmup!r} ({who}); a plugin must answer a "
            "non-negative int or None"
        )
    return warmup


def forward_backward_answer(function: Any, given: Any, who: str) -> Any:
    """The answer of ``mcgraph_forward_backward_func``: a callable (the host's default
    implementation answers the function it was given)."""
    if not callable(function) and function is given:
        raise TypeError(
            f"run.forward_backward_func was given {given!r} ({type(given).__name__}), not a "
            "callable; pass megatron-core's get_forward_backward_func()"
        )
    if not callable(function):
        raise TypeError(
            f"mcgraph_forward_backward_func answered {function!r} ({type(function).__name__}) "
            f"for {given!r}, not a callable ({who}); a wrapper answers the function it was "
            "given, or a callable that calls it (`return (yield)` in a wrapper=True "
            "implementation)"
        )
    return function
