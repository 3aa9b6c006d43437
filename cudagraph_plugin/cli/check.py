"""``python -m cudagraph_plugin check``: check a CUDA-graph configuration without a GPU.

Takes the plugin's CUDA-graph flags plus every model flag the constraints depend on, in the
forms Megatron-LM accepts (``--cuda-graph-scope attn mlp``, ``--moe-layer-freq
"([0]*1+[1]*3)"``, ``--recompute-modules core_attn mlp``; each flag also with underscores,
as Megatron-Bridge's harness spells them), and prints the verdict a run would give
(:func:`cudagraph_plugin.config.check.check_config`): every problem with its fix, the
auto-fixes the run would apply, the advice, and what cannot be checked on this machine.

``--te-version X`` checks the Transformer Engine rules against version X (a GPU recipe on
a laptop); without it they are checked against the installed Transformer Engine, or
reported as "not checked here" when there is none.

``--skip-unknown-flags`` checks a whole Megatron-LM command line as pasted: the flags this
check does not read (``--data-path``, ``--lr``, ...) are named in one note, with a "did you
mean" where one is close to a flag it reads, and skipped. An unknown flag in the plugin's own
``--cuda-graph-`` namespace still breaks the command line: a misspelling there changes the
verdict.

Exit codes: 0 the configuration can work; 1 it has problems (a bad flag value is one more
problem, listed with the others); 2 the command line itself is broken (an unknown flag, a
flag without its value).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from cudagraph_plugin.cli.flags import add_cuda_graph_arguments
from cudagraph_plugin.cli.megatron_lm import as_validate_args, megatron_lm_refuses
from cudagraph_plugin.config import environment
from cudagraph_plugin.config.check import check_config
from cudagraph_plugin.config.environment import INSTALLED, parse_te_version
from cudagraph_plugin.config.errors import CudaGraphConfigError, Violation

USAGE = (
    "usage: {prog} [flags]   (--help lists them; exit codes: 0 OK, 1 problems, 2 a broken "
    "command line)"
)
FP8_FORMATS = ("e4m3", "hybrid")
LIST_FLAGS = ("--cuda-graph-scope", "--cuda-graph-modules", "--recompute-modules")
SKIP_FLAG = "--skip-unknown-flags"
OWN_NAMESPACE = ("--cuda-graph-", "--cuda_graph_")


class _CheckParser(argparse.ArgumentParser):
    """Reports a broken command line in three lines, with a hint, instead of the usage."""

    def error(self, message: str) -> NoReturn:
        usage = USAGE.format(prog=self.prog)
        self.exit(2, f"{self.prog}: error: {message}{_hint(self, message)}\n{usage}\n")


def _hint(parser: argparse.ArgumentParser, message: str) -> str:
    if message.endswith(": expected one argument"):
        # (argparse takes a value starting with "-", "-256,512", for a flag)
        flag = message.removeprefix("argument ").split(":")[0].split("/")[0]
        return f"\n  hint: a value starting with '-' is given as {flag}=VALUE"
    if not message.startswith("unrecognized arguments: "):
        return ""
    known = _known_flags(parser)
    unknown = message.removeprefix("unrecognized arguments: ").split()
    hints = []
    after_flag = False  # the values of an unknown flag are unrecognized too; no hint for them
    for token in unknown:
        if token.startswith("-"):
            close = _close_flag(token.split("=")[0], known)
            if close:
                hints.append(f"{token}: did you mean {close[0]}?")
        elif not after_flag:
            owner, values = _flag_before(getattr(parser, "given", []), token)
            if owner == "--cuda-graph-buckets":  # (one value: the lengths joined by commas)
                if not any(hint.startswith(owner) for hint in hints):
                    hints.append(
                        f"{owner} takes one value, the lengths joined by commas: "
                        f"{owner} {','.join(values)}"
                    )
            elif re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", token, re.DOTALL):
                # (a launch line's environment: CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun ...)
                hints.append(
                    f"{token}: an environment variable; the check reads the environment it "
                    f"runs in: put it before the command ({token} python -m cudagraph_plugin "
                    "check ...)"
                )
            elif re.fullmatch(r"[+~]*[A-Za-z_][\w.]*=.*", token, re.DOTALL):
                # (a Hydra override: user trial, 2026-12-05)
                hints.append(
                    f"{token}: a config override; this command reads command-line flags: "
                    "check a config tree (a Hydra DictConfig, say) from Python with "
                    "cudagraph_plugin.check_config(cfg.<the section with the Megatron "
                    "settings>)"
                )
            else:
                hints.append(
                    f"{token}: a value without a flag; only {', '.join(LIST_FLAGS)} take "
                    "several values"
                )
        after_flag = token.startswith("-")
    if any(_is_flag(t) and not t.startswith(OWN_NAMESPACE) for t in unknown):
        hints.append(
            f"checking a whole Megatron-LM command line? add {SKIP_FLAG}: the flags this check "
            "does not read are then named in a note and skipped"
        )
    return "".join(f"\n  hint: {hint}" for hint in hints)


def _flag_before(argv: Sequence[str], token: str) -> tuple[str | None, list[str]]:
    """The flag whose values ``token`` follows on the command line, and all its values
    (``--cuda-graph-buckets``, ``["256", "512"]`` in ``--cuda-graph-buckets 256 512``);
    ``(None, [])`` where no flag comes before it."""
    argv = list(argv)
    for at in (i for i, item in enumerate(argv) if item == token):
        flags = [i for i in range(at) if argv[i].startswith("-")]
        # (the stray one: a second value or later of its flag, not a flag's own value)
        if not flags or "=" in argv[flags[-1]] or at - flags[-1] < 2:
            continue
        end = next((i for i in range(at, len(argv)) if argv[i].startswith("-")), len(argv))
        return argv[flags[-1]].replace("_", "-"), argv[flags[-1] + 1 : end]
    return None, []


def _close_flag(name: str, known: list[str]) -> list[str]:
    """The flag ``name`` likely misspells: a loose match in the plugin's own namespace, a
    close one elsewhere (Megatron-LM has many flags alike: ``--inference-rng-tracker`` is no
    misspelling of ``--te-rng-tracker``), else the one flag it is the start of."""
    cutoff = 0.6 if name.startswith(OWN_NAMESPACE) else 0.85
    close = difflib.get_close_matches(name, known, n=1, cutoff=cutoff)
    if close:
        return close
    # a flag cut short (--delay-wgrad, --micro-batch), which argparse takes from no one here
    started = [flag for flag in known if flag.startswith(name + "-")]
    return started if len(started) == 1 else []


def _known_flags(parser: argparse.ArgumentParser) -> list[str]:
    return [flag for flag in parser._option_string_actions if flag.startswith("--")]


def _is_flag(token: str) -> bool:
    """A flag, not a value: ``-1e-8`` (a negative number argparse does not recognise as
    one) is a value."""
    if not token.startswith("-"):
        return False
    try:
        float(token)
    except ValueError:
        return True
    return False


def _skip_unknown(parser: argparse.ArgumentParser, unknown: list[str]) -> str | None:
    """The note naming the flags (and their values) a ``--skip-unknown-flags`` check skips;
    a broken command line (an unknown flag in the plugin's own namespace, or a value that
    follows no unknown flag) goes to ``parser.error`` as without the option."""
    known = _known_flags(parser)
    broken, skipped = [], []
    in_unknown_flag = False
    for token in unknown:
        if _is_flag(token):
            name = token.split("=")[0]
            in_unknown_flag = not name.startswith(OWN_NAMESPACE)
            if not in_unknown_flag:
                broken.append(token)
                continue
            close = _close_flag(name, known)
            skipped.append(f"{name} (did you mean {close[0]}?)" if close else name)
        elif not in_unknown_flag:
            broken.append(token)
    if broken:
        parser.error(f"unrecognized arguments: {' '.join(broken)}")
    if not skipped:
        return None
    return (
        f"{len(skipped)} flag(s) this check does not read were skipped ({SKIP_FLAG}): "
        + ", ".join(skipped)
    )


def _flags(dest: str) -> list[str]:
    """The dashed and the underscored spelling of a flag (one for a one-word flag)."""
    return list(dict.fromkeys(["--" + dest.replace("_", "-"), "--" + dest]))


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = _CheckParser(
        prog=prog or "python -m cudagraph_plugin check",
        allow_abbrev=False,  # as Megatron-LM: a misspelled flag is an error, not a prefix
        description="Check a CUDA-graph configuration against every known constraint, as a "
        "run would. Exit codes: 0 OK, 1 problems (bad flag values included), 2 a broken "
        "command line.",
    )
    add_cuda_graph_arguments(parser, lenient=True)
    model = parser.add_argument_group(
        "model (Megatron-LM flag names, forms and defaults; values are checked together)"
    )

    def value(dest: str, default: Any = None, **kwargs: Any) -> None:
        model.add_argument(*_flags(dest), dest=dest, default=default, **kwargs)

    def switch(flag: str, dest: str, *, on: bool = True, group: Any = model, **kwargs: Any) -> None:
        action = "store_true" if on else "store_false"
        group.add_argument(*_flags(flag[2:].replace("-", "_")), dest=dest, action=action, **kwargs)

    value(
        "transformer_impl",
        "transformer_engine",
        metavar="{local,transformer_engine}",
        help="the layer implementation (Megatron-LM's default: transformer_engine)",
    )
    value("seq_length")
    value(
        "position_embedding_type",
        "learned_absolute",
        metavar="{learned_absolute,rope,...}",
        help="Megatron-LM's default: learned_absolute, whose table ends at "
        "--max-position-embeddings",
    )
    switch(
        "--use-rotary-position-embeddings",
        "use_rotary_position_embeddings",
        help="Megatron-LM's legacy flag for --position-embedding-type rope",
    )
    value("max_position_embeddings")
    value("micro_batch_size")
    value("num_experts", help="MoE experts (num_moe_experts)")
    value("moe_expert_capacity_factor")
    switch("--moe-pad-expert-input-to-capacity", "moe_pad_expert_input_to_capacity")
    value("moe_token_dispatcher_type", "allgather", metavar="{allgather,alltoall,flex}")
    switch("--moe-router-padding-for-fp8", "moe_router_padding_for_fp8")
    switch("--moe-permute-fusion", "moe_permute_fusion")
    value("moe_layer_freq", 1, help='N, or a pattern such as "([0]*1+[1]*3)*4"')
    value("moe_shared_expert_intermediate_size")
    switch("--moe-shared-expert-overlap", "moe_shared_expert_overlap")
    value("moe_input_jitter_eps")
    switch("--overlap-moe-expert-parallel-comm", "overlap_moe_expert_parallel_comm")
    switch(
        "--moe-layer-recompute",
        "moe_layer_recompute",
        help="deprecated Megatron-LM flag: selective recompute with moe added to the modules",
    )
    switch(
        "--recompute-activations",
        "recompute_activations",
        help="Megatron-LM's shorthand for --recompute-granularity selective",
    )
    value("recompute_granularity", metavar="{full,selective}")
    value("recompute_method", metavar="{uniform,block}")
    value("recompute_num_layers")
    value("recompute_modules", nargs="+", metavar="MODULE")
    value("attention_dropout", 0.1)
    value("hidden_dropout", 0.1)
    switch("--cpu-offloading", "cpu_offloading")
    value(
        "cpu_offloading_num_layers",
        help="Megatron-LM's flag: more than 0 turns CPU offloading on",
    )
    switch("--delay-wgrad-compute", "delay_wgrad_compute")
    switch("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion", on=False)
    switch("--add-qkv-bias", "add_qkv_bias")
    switch("--disable-bias-linear", "add_bias_linear", on=False)
    switch("--variable-seq-lengths", "variable_seq_lengths")
    switch("--te-rng-tracker", "te_rng_tracker")
    # Megatron-LM's flag turns both checks off; the grad check is off here by default.
    switch("--no-check-for-nan-in-loss", "check_for_nan_in_loss", on=False)
    switch("--no-check-for-nan-in-loss-and-grad", "check_for_nan_in_loss", on=False)
    switch("--check-for-nan-in-grad", "check_for_nan_in_grad")
    switch("--check-for-large-grads", "check_for_large_grads")
    switch("--check-for-spiky-loss", "check_for_spiky_loss")
    value(
        "fp8_format",
        metavar="{e4m3,hybrid}",
        help="informational: FP8 recipes often default to TE mlp graphs",
    )
    parallel = parser.add_argument_group(
        "parallelism, precision and optimizer (Megatron-LM flag names; absent: not given)"
    )

    def given(dest: str, *aliases: str, **kwargs: Any) -> None:
        # (absent from the namespace when not given, as a config without the field)
        flags = [*_flags(dest), *aliases]
        parallel.add_argument(*flags, dest=dest, default=argparse.SUPPRESS, **kwargs)

    def on(flag: str, dest: str, *, value: bool = True) -> None:
        switch(flag, dest, on=value, group=parallel)

    given("tensor_model_parallel_size")
    given("pipeline_model_parallel_size")
    given(
        "virtual_pipeline_model_parallel_size",
        "--num-virtual-stages-per-pipeline-rank",
        "--num_virtual_stages_per_pipeline_rank",
        help="virtual pipeline stages per rank (Megatron-LM: --num-virtual-stages-per-"
        "pipeline-rank)",
    )
    # (as Megatron-LM's validate_args derives the virtual stages: at most one of these)
    parallel.add_argument(*_flags("num_layers"), dest="num_layers", default=None)
    on("--account-for-embedding-in-pipeline-split", "account_for_embedding_in_pipeline_split")
    on("--account-for-loss-in-pipeline-split", "account_for_loss_in_pipeline_split")
    for uneven in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        parallel.add_argument(*_flags(uneven), dest=uneven, default=None)
    parallel.add_argument(
        *_flags("num_layers_per_virtual_pipeline_stage"),
        dest="num_layers_per_virtual_pipeline_stage",
        default=None,
        help="virtual stages = --num-layers / --pipeline-model-parallel-size / this",
    )
    parallel.add_argument(
        *_flags("pipeline_model_parallel_layout"),
        dest="pipeline_model_parallel_layout",
        default=None,
        metavar="LAYOUT",
        help="virtual stages = the layout's stages / --pipeline-model-parallel-size (e.g. "
        '"Et*2|t*2|t*2|t*2L")',
    )
    given("context_parallel_size")
    # Megatron-LM's default (on; its validate_args turns it off without virtual stages, and
    # builds batch_p2p_comm = not overlap_p2p_comm: the settings derive it the same way)
    switch(
        "--no-overlap-p2p-communication",
        "overlap_p2p_comm",
        on=False,
        group=parallel,
        help="Megatron-LM's flag: with virtual pipeline stages, batched p2p communication",
    )
    on("--sequence-parallel", "sequence_parallel")
    on("--fp16", "fp16")
    # (absent: not known; a pasted line may leave out what does not concern the graphs)
    given("bf16", action="store_true")
    given("loss_scale", help="a constant loss scale (fp16; none: megatron-core's dynamic scaler)")
    given("optimizer", metavar="{adam,sgd}")
    on("--use-distributed-optimizer", "use_distributed_optimizer")
    on("--overlap-param-gather-with-optimizer-step", "overlap_param_gather_with_optimizer_step")
    on("--optimizer-cpu-offload", "optimizer_cpu_offload")
    on("--use-precision-aware-optimizer", "use_precision_aware_optimizer")
    given("main_params_dtype", metavar="{fp32,fp16}")
    given("exp_avg_dtype", metavar="{fp32,fp16,bf16,fp8}")
    given("exp_avg_sq_dtype", metavar="{fp32,fp16,bf16,fp8}")
    on("--no-store-param-remainders", "store_param_remainders", value=False)
    on("--fp8-param-gather", "fp8_param_gather")
    on("--log-num-zeros-in-grad", "log_num_zeros_in_grad")
    given("timing_log_level", metavar="{0,1,2}")
    given("weight_decay_incr_style", metavar="{constant,linear,cosine}")
    switch("--enable-cuda-graph", "enable_cuda_graph", help="deprecated Megatron-LM flag")
    switch("--external-cuda-graph", "external_cuda_graph", help="deprecated Megatron-LM flag")
    machine = parser.add_argument_group("the machine of the run")
    machine.add_argument(
        *_flags("te_version"),
        dest="te_version",
        default=None,
        metavar="VERSION",
        help="check the Transformer Engine rules against this version (default: the installed "
        "one; without either they are reported as not checked here)",
    )
    parser.add_argument(
        *_flags("skip_unknown_flags"),
        dest="skip_unknown_flags",
        action="store_true",
        help="check a whole Megatron-LM command line as pasted: flags this check does not "
        "read are named in a note and skipped (a misspelled --cuda-graph-... flag still "
        "exits 2)",
    )
    return parser


def _own_flags(args: argparse.Namespace) -> tuple[Any, list[Violation]]:
    """The check command's own flags: the TE version to check against, and their problems."""
    problems = []
    te_version: Any = INSTALLED
    if args.te_version is not None:
        try:
            text = args.te_version.strip()
            te_version = None if text.lower() == "none" else parse_te_version(text)
        except ValueError:
            te_version = None
            problems.append(
                Violation(
                    ("--te-version",),
                    repr(args.te_version),
                    "not a version number",
                    "give a Transformer Engine version such as 2.12.0",
                )
            )
    if args.fp8_format is not None and args.fp8_format not in FP8_FORMATS:
        problems.append(
            Violation(
                ("--fp8-format",),
                repr(args.fp8_format),
                "not a known FP8 format",
                f"use one of {', '.join(FP8_FORMATS)}",
            )
        )
    return te_version, problems


def run_check(argv: Sequence[str] | None = None, out: Any = None, prog: str | None = None) -> int:
    out = out or sys.stdout
    parser = build_parser(prog)
    parser.given = list(sys.argv[1:] if argv is None else argv)  # type: ignore[attr-defined]
    args, unknown = parser.parse_known_args(argv)
    if unknown and not args.skip_unknown_flags:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")  # (what parse_args says)
    skipped = _skip_unknown(parser, unknown) if unknown else None
    te_version, own_problems = _own_flags(args)
    derived_problems, derived = as_validate_args(args)
    own_problems += derived_problems
    given = args.te_version is not None and te_version is not None
    installed = environment.installed_te_version()
    result = check_config(
        args,
        te_version=te_version,
        te_available=True if given or (te_version == INSTALLED and installed) else None,
        environ=os.environ,
        nccl_initialized=False,
        harness=True,
        paths_here=False,  # (the run may write on a filesystem this machine does not mount)
    )
    settings, te = result.settings, result.environment.te_version
    if te is None:
        te_text = "not installed here" if installed is None else "not checked"
    else:
        te_text = f"{te} (--te-version)" if given else str(te)
    buckets = f" buckets={','.join(map(str, settings.buckets))}" if settings.buckets else ""
    print(
        f"cuda graphs: impl={settings.impl} scope={','.join(settings.scope) or '-'}{buckets} "
        f"warmup={settings.warmup_steps} (megatron-core {environment.mcore_version()}, "
        f"Transformer Engine {te_text})",
        file=out,
    )
    problems = [*own_problems, *result.problems]
    # (a run applies them only to a configuration without problems)
    fix_label = "auto-fix (once the problems are fixed)" if problems else "auto-fix"
    for fix in result.autofixes:
        print(f"  {fix_label}: {fix.message}", file=out)
    for note in result.advice:
        print(f"  advice: {note}", file=out)
    launcher = megatron_lm_refuses(result.autofixes, settings.impl)
    if derived:
        print(f"  derived as Megatron-LM's validate_args does: {'; '.join(derived)}", file=out)
    for note in ([skipped] if skipped else []) + launcher + list(result.notes):
        print(f"  note: {note}", file=out)
    if problems:
        print(str(CudaGraphConfigError(problems)), file=out)
        print("FAILED", file=out)
        return 1
    print("OK", file=out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The ``mcgraph-check`` console script: ``python -m cudagraph_plugin check`` under the
    name it was run by (its usage lines say that name)."""
    return run_check(argv, prog=os.path.basename(sys.argv[0]) or None)
