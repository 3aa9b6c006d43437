"""The words of a CUDA-graph configuration: implementations, scopes, and how either
megatron-core generation spells them.

megatron-core 0.16 writes full-iteration graphs as ``impl="local"`` with the scope
``full_iteration`` and keeps per-layer scopes in ``cuda_graph_scope``; 0.18+ writes
``impl="full_iteration"`` with no modules and keeps per-layer scopes in
``cuda_graph_modules``. The plugin reads either and thinks in 0.16's vocabulary
(:func:`canonical_impl_and_scope`). Writing a config for the installed generation is
``compat``'s job (it needs megatron-core).
"""

from __future__ import annotations

from typing import Any

IMPLS = ("none", "local", "transformer_engine")
SCOPES = ("full_iteration", "attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")
TE_SCOPES = tuple(s for s in SCOPES if s != "full_iteration")
MOE_SCOPES = ("moe", "moe_router", "moe_preprocess")
DEFAULT_WARMUP_STEPS = 3  # megatron-core's TransformerConfig default
PEER_EXIT_DEADLINE_S = 12.0
"""``cuda_graph_peer_exit_deadline``'s default: a rank whose peer failed ends at most this
long after it heard of it, whatever blocks it (:mod:`cudagraph_plugin.runtime.peer_deadline`);
with the watch's 0.5 s poll (jobs up to 1000 ranks) and the exit itself, within about 15 s of
a failure that the failing rank could mark (not one killed outright: SIGKILL, OOM).
It bounds the whole peer-failed shutdown: the report, every plugin's shutdown hook, the wait
for the abort (shortened to end a second before it)."""

# megatron-core's deprecated scope names: "full" (both generations) is whole-layer capture,
# "full_iteration_inference" (0.19) moved to inference_cuda_graph_scope=block.
DEPRECATED_SCOPES = ("full", "full_iteration_inference")

# Field names under which a host config may hold the scope (0.16: scope; 0.18+: modules).
SCOPE_FIELD_NAMES = ("cuda_graph_scope", "cuda_graph_modules")


def canonical_impl_and_scope(impl: Any, scope: tuple[str, ...]) -> tuple[Any, tuple[str, ...]]:
    """Translate either generation's spelling into the plugin's (0.16's) vocabulary.

    0.18+ spells full-iteration graphs ``impl="full_iteration"`` with no modules; both
    generations spell "whole layer" as the scope ``"full"`` (an empty list after their
    ``__post_init__``).
    """
    if scope == ("full",):
        scope = ()
    if impl == "full_iteration":
        return "local", ("full_iteration", *scope)
    return impl, scope
