"""Command-line flags: :func:`add_cuda_graph_arguments` adds ``--cuda-graph-impl``,
``--cuda-graph-scope`` (space-separated as Megatron-LM's flag, or comma-separated as
Megatron-Bridge's harness, each name checked), ``--cuda-graph-warmup-steps`` and the report
options to any argparse parser, also under the underscore spellings of Megatron-Bridge's
performance harness (``--cuda_graph_impl`` ...). ``lenient=True`` (the ``check`` command)
keeps every value as given, for the rules to report all bad values at once instead of
argparse stopping at the first.
"""

from __future__ import annotations

import argparse
import logging
import weakref
from typing import Any

from cudagraph_plugin.config.values import normalise, parse_scope
from cudagraph_plugin.config.vocabulary import DEPRECATED_SCOPES, IMPLS, SCOPES

logger = logging.getLogger("cudagraph_plugin")

FLAG_DESTS = ("cuda_graph_impl", "cuda_graph_scope", "cuda_graph_warmup_steps")


def join_scope_tokens(tokens: list[str]) -> str:
    """One scope string from a flag's tokens: ``attn mlp`` (Megatron-LM), ``attn,mlp``
    (Megatron-Bridge) and ``attn, mlp`` (unquoted) all give ``"attn,mlp"``; a doubled comma
    inside a token stays for validation to report."""
    text = ""
    for token in tokens:
        if text and not text.rstrip().endswith(",") and not token.lstrip().startswith(","):
            text += ","
        text += token
    return text


def parse_scope_arg(text: str) -> list[str]:
    """Check a ``--cuda-graph-scope`` value: ``"attn, mlp"`` -> ``["attn", "mlp"]``. A name
    given twice is kept (megatron-core accepts it; the settings use it once and say so)."""
    names = list(parse_scope(text))
    if not names:
        raise argparse.ArgumentTypeError(
            f"empty scope {text!r}: give scope names from {', '.join(SCOPES)}"
        )
    if "" in names:
        raise argparse.ArgumentTypeError(
            f"empty scope name in {text!r} (a doubled, leading or trailing comma)"
        )
    deprecated = [name for name in names if name in DEPRECATED_SCOPES]
    if "full_iteration_inference" in deprecated:
        raise argparse.ArgumentTypeError(
            f"scope 'full_iteration_inference' in {text!r} is megatron-core 0.19's deprecated "
            "name for inference CUDA graphs (now inference_cuda_graph_scope=block), which this "
            "plugin does not manage: drop it (training graphs: attn mlp, or full_iteration "
            "with --cuda-graph-impl local)"
        )
    if deprecated:
        raise argparse.ArgumentTypeError(
            f"scope {deprecated[0]!r} in {text!r} is a deprecated megatron-core name "
            "('full' meant whole-layer capture, which this plugin does not manage): name the "
            "scopes, e.g. attn mlp, or full_iteration with --cuda-graph-impl local"
        )
    unknown = [name for name in names if name not in SCOPES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown scope(s) {', '.join(map(repr, unknown))} in {text!r}; valid: "
            f"{', '.join(SCOPES)}"
        )
    return names


class ScopeAction(argparse.Action):
    """``--cuda-graph-scope S [S ...]``: the tokens joined and checked (a bad value is a
    usage error naming the flag). Given twice, the last one holds, as argparse has it (a
    launcher may append an override), and a warning names the one dropped."""

    lenient = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the namespaces this flag was given for, with the text: kept off the namespace,
        # which hosts save with their checkpoints
        # (a Namespace is unhashable: by id, with a weak reference to tell a reused id)
        self._given: dict[int, tuple[weakref.ref[Any], str]] = {}

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        text = join_scope_tokens(list(values))
        ref, earlier = self._given.get(id(namespace), (None, None))
        if ref is not None and ref() is namespace:
            logger.warning(
                "%s given twice: using the last (%s); the earlier one (%s) is dropped; "
                "give every scope in one flag, e.g. %s attn mlp",
                option_string,
                text,
                earlier,
                option_string,
            )
        self._given = {key: seen for key, seen in self._given.items() if seen[0]() is not None}
        try:
            self._given[id(namespace)] = (weakref.ref(namespace), text)
        except TypeError:  # a namespace of the host's without weak references: not tracked
            pass
        if self.lenient:
            setattr(namespace, self.dest, text)
            return
        try:
            setattr(namespace, self.dest, parse_scope_arg(text))
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None


class NotEmpty(argparse.Action):
    """A flag whose empty value is a usage error: an unset variable in a launcher
    (``--cuda-graph-report-json "$REPORT"``) would drop the report, or the buckets, without a
    word. (An action, not a ``type``: argparse runs it only for a flag given, never for a
    host's default.)"""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if isinstance(values, str) and not values.strip():
            raise argparse.ArgumentError(
                self, f"an empty value, got {values!r}: give a value, or leave the flag out"
            )
        setattr(namespace, self.dest, values)


class RawScopeAction(ScopeAction):
    """As :class:`ScopeAction`, keeping the joined text for validation to report."""

    lenient = True


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _peer_exit_deadline(text: str) -> float:
    try:
        return normalise("peer_exit_deadline", text)
    except ValueError as exc:
        problem = exc.args[0]
        raise argparse.ArgumentTypeError(
            f"{problem.problem}, got {text!r}: {problem.fix}"
        ) from None


def _flags(parser: argparse.ArgumentParser, dest: str) -> list[str]:
    """Both spellings of a flag, or none when the parser already has either: the host's
    own definition (its choices, its default) then governs both spellings' meaning."""
    spellings = ["--" + dest.replace("_", "-"), "--" + dest]
    if any(flag in parser._option_string_actions for flag in spellings):
        return []
    return spellings


def add_cuda_graph_arguments(parser: argparse.ArgumentParser, *, lenient: bool = False) -> None:
    """Add the CUDA-graph flags to ``parser`` (flags the parser already has are left alone;
    a default the host gave with ``parser.set_defaults(...)`` before this call is kept).

    :param lenient: Keep the values as given (no choices, no types): for a caller that
        validates them all together and reports every bad one (the ``check`` command).
    """
    group = parser.add_argument_group("CUDA graphs (megatron-cudagraph-plugin)")
    impl_help = (
        "none; local (with scope full_iteration: megatron-core's FullCudaGraphWrapper); "
        "transformer_engine (per-layer TE graphs); full_iteration (megatron-core 0.18+'s "
        "spelling of local with scope full_iteration)"
    )
    impls = (*IMPLS, "full_iteration")
    scope_action = RawScopeAction if lenient else ScopeAction
    options: list[tuple[str, dict[str, Any]]] = [
        (
            "cuda_graph_impl",
            dict(default="none", metavar="{" + ",".join(impls) + "}", help=impl_help)
            if lenient
            else dict(choices=impls, default="none", help=impl_help),
        ),
        (
            "cuda_graph_scope",
            dict(
                nargs="+",
                action=scope_action,
                default=None,
                metavar="SCOPE",
                help=f"space- or comma-separated: {', '.join(SCOPES)}",
            ),
        ),
        (
            "cuda_graph_modules",
            dict(
                nargs="+",
                action=scope_action,
                default=None,
                metavar="MODULE",
                help="megatron-core 0.18+'s name for --cuda-graph-scope (give one of the two)",
            ),
        ),
        (
            "cuda_graph_warmup_steps",
            dict(
                type=None if lenient else _non_negative_int,
                default=None,
                metavar="N",
                help="eager steps before capture (default: megatron-core's 3)",
            ),
        ),
        (
            "cuda_graph_report_json",
            dict(
                action=NotEmpty,
                default=None,
                metavar="PATH",
                help="also write the run report as JSON here",
            ),
        ),
        (
            "cuda_graph_fallback_on_slowdown",
            dict(
                action="store_true",
                help="full_iteration only: if replay is measurably slower than eager, free the "
                "graph and continue with the plain forward_backward_func",
            ),
        ),
        (
            "cuda_graph_buckets",
            dict(
                action=NotEmpty,
                default=None,
                metavar="LENGTHS",
                help="full_iteration: one graph per sequence-length bucket, e.g. 256,512,1024 "
                "(the host pads each step's micro-batches to a bucket; other lengths run "
                "eagerly)",
            ),
        ),
        (
            "cuda_graph_baseline_steps",
            dict(
                type=None if lenient else _non_negative_int,
                default=None,
                metavar="N",
                help="measure at least N eager steps before the capture (raises the warm-up to "
                "N + 1 where it is shorter): a sturdier eager figure for the report",
            ),
        ),
        (
            "cuda_graph_accept_eager",
            dict(
                action="store_true",
                help="run eagerly, with one warning, when the loop ends up capturing nothing "
                "(no graphable layer, a forward/backward not taken from the run, ...); by "
                "default that is an error",
            ),
        ),
        (
            "cuda_graph_device_grad_norm",
            dict(
                action="store_true",
                help="compute the gradient norm on the device (torch foreach kernels in place of "
                "megatron-core's host-reading fallback) in any run; the optimizer graph always "
                "does where it is needed",
            ),
        ),
        (
            "cuda_graph_log_all_ranks",
            dict(
                action="store_true",
                help=(
                    "every rank logs the job-wide lines too, each with its rank (by default "
                    "rank 0 alone does)"
                ),
            ),
        ),
        (
            "cuda_graph_peer_exit_deadline",
            dict(
                type=None if lenient else _peer_exit_deadline,
                default=None,
                metavar="SECONDS",
                help="in a multi-rank job, a rank whose peer failed ends at most this long "
                "after it heard of it, even where its shutdown hangs (its threads' stacks "
                "go to stderr, exit status 70); default 12, 0: off",
            ),
        ),
        (
            "optimizer_cuda_graph",
            dict(
                action="store_true",
                help="also capture the optimizer step (megatron-core 0.17+'s "
                "OptimizerCudaGraphWrapper; build OptimizerConfig(optimizer_cuda_graph=True))",
            ),
        ),
    ]
    for dest, kwargs in options:
        flags = _flags(parser, dest)
        if not flags:
            logger.debug("parser already has %s; keeping its definition", dest)
            continue
        # a host recipe's parser.set_defaults(cuda_graph_impl=...): argparse keeps such a
        # default only for an argument added without one, and every value flag here has one
        host_default = parser.get_default(dest)
        if host_default is not None:
            kwargs = {**kwargs, "default": host_default}
        group.add_argument(*flags, dest=dest, **kwargs)
