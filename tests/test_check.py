"""``python -m cudagraph_plugin check`` on real recipes' settings."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cudagraph_plugin import __main__ as entry
from cudagraph_plugin.cli.check import build_parser, run_check
from cudagraph_plugin.config import environment

DENSE_FULL_ITERATION = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]
DENSE_TE = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn,mlp"]
DROPLESS_MOE = [
    "--cuda-graph-impl",
    "transformer_engine",
    "--cuda-graph-scope",
    "attn,moe_router,moe_preprocess",
    "--num-experts",
    "8",
    "--moe-token-dispatcher-type",
    "alltoall",
    "--moe-permute-fusion",
]
FP8_TE_MLP_FULL_RECOMPUTE = [
    "--cuda-graph-impl",
    "transformer_engine",
    "--cuda-graph-scope",
    "mlp",
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "1",
    "--fp8-format",
    "hybrid",
]

RNG_FIX = (
    "auto-fix: CUDA graphs are on (TE RNG tracker): set te_rng_tracker=True (on the command "
    "line: pass --te-rng-tracker)"
)
NAN_FIX = (
    "auto-fix: full_iteration CUDA graph (the loss cannot be inspected inside the captured "
    "iteration): set check_for_nan_in_loss=False (on the command line: pass "
    "--no-check-for-nan-in-loss-and-grad)"
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """A deterministic environment: no allocator options, no Transformer Engine."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)
    monkeypatch.setattr(environment, "installed_te_version", lambda: None)


def check(argv):
    out = io.StringIO()
    code = run_check(argv, out=out)
    return code, out.getvalue()


def lines(text):
    return [line.strip() for line in text.splitlines()]


# -- the four recipes ---------------------------------------------------------------------------


def test_dense_full_iteration_is_ok_with_its_auto_fixes():
    code, out = check(DENSE_FULL_ITERATION)
    assert code == 0, out
    got = lines(out)
    assert got[0] == (
        "cuda graphs: impl=local scope=full_iteration warmup=3 "
        f"(megatron-core {environment.mcore_version()}, Transformer Engine not installed here)"
    )
    assert RNG_FIX in got
    assert NAN_FIX in got
    assert any(line.startswith("advice: scope full_iteration is wider") for line in got)
    assert got[-1] == "OK"
    assert "FAILED" not in out and "problem(s)" not in out
    assert "needs Transformer Engine" not in out  # local graphs do not need TE


def test_dense_te_attn_mlp_is_ok():
    code, out = check(DENSE_TE)
    assert code == 0, out
    got = lines(out)
    assert got[0].startswith("cuda graphs: impl=transformer_engine scope=attn,mlp warmup=3 ")
    assert RNG_FIX in got
    assert NAN_FIX not in got  # the loss NaN check is fine with TE scopes
    assert not any(line.startswith("advice:") for line in got)
    assert any(line.startswith("note: a run needs Transformer Engine") for line in got)
    assert got[-1] == "OK"


def test_dropless_moe_dense_parts_is_ok():
    code, out = check(DROPLESS_MOE)
    assert code == 0, out
    got = lines(out)
    assert "scope=attn,moe_router,moe_preprocess" in got[0]
    assert RNG_FIX in got
    assert not any(line.startswith("advice:") for line in got)
    assert got[-1] == "OK"


def test_fp8_te_mlp_with_full_recompute_fails():
    code, out = check(FP8_TE_MLP_FULL_RECOMPUTE)
    assert code == 1, out
    got = lines(out)
    assert got[-1] == "FAILED"
    assert "1 problem(s) with the CUDA graph configuration:" in got
    (problem,) = [line for line in got if line.startswith("1. ")]
    assert problem.startswith(
        "1. --recompute-granularity, --recompute-num-layers, --cuda-graph-scope = "
        "('full', 1, 'mlp'): layer-level (full) recompute works only with the full-iteration "
        "graph"
    )
    assert problem.endswith(
        '(megatron-core: "full recompute is only supported with full iteration CUDA graph")'
    )
    assert (
        "fix: use selective recompute (recompute_granularity=selective), turn CUDA graphs off, "
        "or use cuda_graph_impl=local with scope full_iteration"
    ) in got
    assert "OK" not in got


def test_fp8_recipe_fixed_by_moving_to_full_iteration():
    argv = [*FP8_TE_MLP_FULL_RECOMPUTE]
    argv[1], argv[3] = "local", "full_iteration"
    code, out = check(argv)
    assert code == 0, out


def test_fp8_recipe_fixed_by_selective_recompute():
    argv = [
        *DENSE_TE,
        "--recompute-granularity",
        "selective",
        "--recompute-modules",
        "layernorm",
        "--fp8-format",
        "hybrid",
    ]
    code, out = check(argv)
    assert code == 0, out


# -- more verdicts the constraints imply ---------------------------------------------------------


def test_drop_and_pad_moe_with_moe_scope_is_ok():
    code, out = check(
        [
            "--cuda-graph-impl",
            "transformer_engine",
            "--cuda-graph-scope",
            "attn,moe",
            "--num-experts",
            "8",
            "--moe-expert-capacity-factor",
            "1.0",
            "--moe-pad-expert-input-to-capacity",
        ]
    )
    assert code == 0, out


def test_dropless_moe_with_moe_scope_fails():
    code, out = check(
        [
            "--cuda-graph-impl",
            "transformer_engine",
            "--cuda-graph-scope",
            "attn,moe",
            "--num-experts",
            "8",
            "--moe-expert-capacity-factor",
            "none",
        ]
    )
    assert code == 1
    assert "moe cuda graph is only supported with drop-padding MoE" in out
    assert "--moe-expert-capacity-factor" in out


def test_full_iteration_with_selective_recompute_and_attention_dropout_fails():
    # Megatron-LM's default attention dropout is 0.1.
    code, out = check([*DENSE_FULL_ITERATION, "--recompute-granularity", "selective"])
    assert code == 1
    assert "--attention-dropout" in out
    assert "attention dropout is not supported with graphed attention recomputation" in out
    code, out = check(
        [*DENSE_FULL_ITERATION, "--recompute-granularity", "selective", "--attention-dropout", "0"]
    )
    assert code == 0, out


def test_three_problems_reported_at_once():
    code, out = check(
        [*DENSE_TE, "--cpu-offloading", "--variable-seq-lengths", "--enable-cuda-graph"]
    )
    assert code == 1
    assert "3 problem(s) with the CUDA graph configuration:" in out
    numbered = [line for line in lines(out) if line[:3] in ("1. ", "2. ", "3. ", "4. ")]
    assert [line[:2] for line in numbered] == ["1.", "2.", "3."]
    assert out.count("\n     fix: ") == 3


def test_impl_none_with_scope_is_ok_and_clears_it():
    code, out = check(["--cuda-graph-impl", "none", "--cuda-graph-scope", "attn"])
    assert code == 0, out
    assert "auto-fix: cuda_graph_impl is none: cleared --cuda-graph-scope (was attn)" in lines(out)
    assert lines(out)[0].startswith("cuda graphs: impl=none scope=- ")


def test_impl_none_clears_both_scope_flags_each_with_its_own_value():
    # (refused anyway: both generations' flags may not be given together)
    _, out = check(["--cuda-graph-modules", "attn", "--cuda-graph-scope", "mlp"])
    label = "auto-fix (once the problems are fixed)"
    assert f"{label}: cuda_graph_impl is none: cleared --cuda-graph-scope (was mlp)" in lines(out)
    assert f"{label}: cuda_graph_impl is none: cleared --cuda-graph-modules (was attn)" in lines(
        out
    )


def test_a_refused_configuration_s_auto_fixes_are_labelled_as_applying_once_fixed():
    """(review of 2026-12-04: ``--cuda-graph-impl locl`` printed "auto-fix: CUDA graphs are
    on: set --te-rng-tracker=True" beside its refusal; a run writes no fix then.)"""
    _, out = check(["--cuda-graph-impl", "locl"])
    assert "auto-fix (once the problems are fixed): CUDA graphs are on" in out
    assert "  auto-fix: " not in out


@pytest.mark.parametrize("argv", [[], ["--cuda-graph-scope", "attn"]], ids=["off", "scope"])
def test_fallback_with_graphs_off_is_said_not_refused(argv):
    """A recipe that sets the fallback by default still runs its eager baseline
    (--cuda-graph-impl none): the flag has no off form on a command line (sixth review)."""
    code, out = check([*argv, "--cuda-graph-fallback-on-slowdown"])
    assert code == 0, out
    assert (
        "--cuda-graph-fallback-on-slowdown has nothing to do with CUDA graphs off "
        "(--cuda-graph-impl=none)"
    ) in out


@pytest.mark.parametrize(
    "flag", [["--cuda-graph-baseline-steps", "5"], ["--cuda-graph-accept-eager"]]
)
def test_the_other_graphs_only_settings_with_graphs_off_are_said(flag):
    """They were ignored without a word (a user review)."""
    code, out = check(flag)
    assert code == 0, out
    assert f"{flag[0]} has nothing to do with CUDA graphs off (--cuda-graph-impl=none)" in out


@pytest.mark.parametrize(
    "argv,value",
    [([*DENSE_TE], "(True, 'transformer_engine', 'attn,mlp')")],
    ids=["te-scopes"],
)
def test_fallback_without_full_iteration_fails(argv, value):
    code, out = check([*argv, "--cuda-graph-fallback-on-slowdown"])
    assert code == 1, out
    assert (
        "1. --cuda-graph-fallback-on-slowdown, --cuda-graph-impl, --cuda-graph-scope = "
        f"{value}: the fallback policy frees the full-iteration graph" in out
    )
    assert (
        "fix: use cuda_graph_impl=local with scope full_iteration, or drop "
        "cuda_graph_fallback_on_slowdown"
    ) in lines(out)


def test_fallback_with_full_iteration_is_ok():
    code, out = check([*DENSE_FULL_ITERATION, "--cuda-graph-fallback-on-slowdown"])
    assert code == 0, out


def test_the_report_json_path_is_left_to_the_run(tmp_path):
    """`check` runs anywhere (a laptop, a login node) where the run's filesystem may not be
    mounted: the path is said to be checked by the run, not refused here (sixth review: a
    cluster-only path failed the check as '/ is not writable'). The run refuses a bad one
    when it starts (tests/test_plugin_lifecycle.py)."""
    for path in (tmp_path, "/lustre/scratch/run1/report.json"):
        code, out = check(["--cuda-graph-report-json", str(path)])
        assert code == 0, out
        assert (
            f"--cuda-graph-report-json={str(path)!r}: whether the run report can be written "
            "there is not checked here"
        ) in out


def test_graphs_on_without_scope_fails():
    code, out = check(["--cuda-graph-impl", "transformer_engine"])
    assert code == 1
    assert "no scope is given" in out


def test_expandable_segments_dry_run(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    code, out = check(DENSE_TE)
    assert code == 0, out
    assert any(
        line.startswith("auto-fix: set NCCL_GRAPH_REGISTER=0: PYTORCH_CUDA_ALLOC_CONF has")
        for line in lines(out)
    )
    assert any("advice: PYTORCH_CUDA_ALLOC_CONF has expandable_segments" in x for x in lines(out))
    assert "NCCL_GRAPH_REGISTER" not in os.environ  # the check changes nothing


def test_expandable_segments_with_register_on_fails(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "1")
    code, out = check(DENSE_TE)
    assert code == 1
    assert "NCCL_GRAPH_REGISTER, PYTORCH_CUDA_ALLOC_CONF = " in out
    assert "fix: export NCCL_GRAPH_REGISTER=0" in out


def test_no_flags_means_graphs_off_and_ok():
    code, out = check([])
    assert code == 0
    assert lines(out) == [lines(out)[0], "OK"]
    assert lines(out)[0].startswith("cuda graphs: impl=none scope=- warmup=3 ")


def test_bad_flag_value_is_a_listed_problem_exit_1(capsys):
    code, out = check(
        ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn,bogus"]
    )
    assert code == 1
    assert "1. --cuda-graph-scope = 'attn,bogus': unknown CUDA graph scope(s) 'bogus'" in out
    assert capsys.readouterr().err == ""


def test_check_leaves_the_logger_as_it_found_it():
    import logging

    log = logging.getLogger("cudagraph_plugin")
    handlers = list(log.handlers)
    check(DENSE_TE)
    check(FP8_TE_MLP_FULL_RECOMPUTE)
    assert log.handlers == handlers


# -- the real command line -------------------------------------------------------------------------


def _run(*args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF",)}
    env.pop("NCCL_GRAPH_REGISTER", None)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "cudagraph_plugin", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_subprocess_check_fails_fp8_recipe():
    proc = _run("check", *FP8_TE_MLP_FULL_RECOMPUTE)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith("FAILED")
    assert "--recompute-granularity" in proc.stdout
    assert "fix: use selective recompute" in proc.stdout


def test_subprocess_check_ok_dense_full_iteration():
    proc = _run("check", *DENSE_FULL_ITERATION)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith("OK")
    assert NAN_FIX in lines(proc.stdout)


def test_check_imports_neither_torch_nor_megatron():
    code = (
        "import sys\n"
        "from cudagraph_plugin.check import run_check\n"
        f"run_check({DENSE_TE!r})\n"
        "heavy = sorted(m for m in sys.modules\n"
        "               if m.split('.')[0] in ('torch', 'megatron', 'transformer_engine'))\n"
        "print('HEAVY', heavy)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "HEAVY []" in proc.stdout


def test_subprocess_no_arguments_prints_usage_and_exits_2():
    proc = _run()
    assert proc.returncode == 2
    assert proc.stdout.startswith("usage: python -m cudagraph_plugin check")


def test_subprocess_unknown_command_exits_2():
    proc = _run("validate")
    assert proc.returncode == 2
    assert "unknown command 'validate'" in proc.stderr
    assert "usage: python -m cudagraph_plugin check" in proc.stderr
    assert proc.stdout == ""


def test_subprocess_check_help_lists_the_flags():
    proc = _run("check", "--help")
    assert proc.returncode == 0, proc.stderr
    for flag in (
        "--cuda-graph-impl",
        "--cuda-graph-scope",
        "--cuda-graph-warmup-steps",
        "--recompute-granularity",
        "--num-experts",
        "--fp8-format",
    ):
        assert flag in proc.stdout


@pytest.mark.parametrize("argv, code", [(["-h"], 0), (["--help"], 0), ([], 2)])
def test_main_usage(capsys, argv, code):
    assert entry.main(argv) == code
    assert capsys.readouterr().out.startswith("usage: ")


def test_main_dispatches_to_check(capsys):
    assert entry.main(["check", *FP8_TE_MLP_FULL_RECOMPUTE]) == 1
    assert "FAILED" in capsys.readouterr().out


# -- what real launchers pass ---------------------------------------------------------------------

TE = ["--cuda-graph-impl", "transformer_engine"]


@pytest.mark.parametrize(
    "scope",
    [
        ["--cuda-graph-scope", "attn", "mlp"],
        ["--cuda_graph_scope", "attn", "mlp"],
        ["--cuda-graph-scope", "attn,", "mlp"],
        ["--cuda-graph-scope=attn,mlp"],
        ["--cuda-graph-modules", "attn", "mlp"],
    ],
    ids=["megatron-lm", "underscores", "unquoted-comma", "equals", "megatron-core-0.19-modules"],
)
def test_space_separated_scopes_as_megatron_lm_takes_them(scope):
    # Before: "unrecognized arguments: mlp" and exit 2.
    code, out = check([*TE, *scope])
    assert code == 0, out
    assert lines(out)[0].startswith("cuda graphs: impl=transformer_engine scope=attn,mlp ")


def test_new_generation_full_iteration_impl_spelling():
    code, out = check(["--cuda-graph-impl", "full_iteration"])
    assert code == 0, out
    assert lines(out)[0].startswith("cuda graphs: impl=local scope=full_iteration ")


def test_moe_layer_freq_pattern_string_is_checked():
    # Before: "argument --moe-layer-freq: invalid int value" and exit 2.
    moe = ["--num-experts", "8", "--moe-layer-freq"]
    code, out = check(
        [*TE, "--cuda-graph-scope", "attn", "mlp", "moe_router", *moe, "([0]*1+[1]*3)"]
    )
    assert code == 0, out
    code, out = check([*TE, "--cuda-graph-scope", "attn", "mlp", "moe_router", *moe, "([1]*4)"])
    assert code == 1
    assert "mlp cuda graph is only supported for dense layers, but not found in the model" in out
    assert "--moe-layer-freq" in out


def test_recompute_modules_as_megatron_lm_takes_them():
    argv = [*TE, "--cuda-graph-scope", "attn", "--recompute-granularity", "selective"]
    code, out = check([*argv, "--recompute-modules", "layernorm", "core_attn"])
    assert code == 1
    assert "--attention-dropout, --recompute-modules, --cuda-graph-scope = " in out
    assert "(0.1, ['layernorm', 'core_attn'], 'attn')" in out
    code, out = check([*argv, "--recompute_modules", "layernorm", "mlp"])
    assert code == 0, out


def test_megatron_lm_nan_check_flag_is_understood():
    code, out = check([*DENSE_FULL_ITERATION, "--no-check-for-nan-in-loss-and-grad"])
    assert code == 0, out
    assert NAN_FIX not in lines(out)  # already off: nothing to fix


def test_every_bad_value_is_a_listed_problem_not_a_usage_dump(capsys):
    # Before: the first bad value printed the 35-line usage block and exited 2.
    code, out = check(
        [
            *TE,
            "--cuda-graph-scope",
            "attn,,mlp",
            "--num-experts",
            "eight",
            "--cuda-graph-warmup-steps",
            "-1",
            "--moe-layer-freq",
            "([0]*1+[1]*x)",
            "--attention-dropout",
            "lots",
            "--fp8-format",
            "e5m2",
            "--te-version",
            "two",
        ]
    )
    assert code == 1
    assert capsys.readouterr().err == ""
    assert "usage:" not in out
    assert "7 problem(s) with the CUDA graph configuration:" in out
    for field, value in [
        ("--te-version", "'two'"),
        ("--fp8-format", "'e5m2'"),
        ("--cuda-graph-warmup-steps", "'-1'"),
        ("--num-experts", "'eight'"),
        ("--moe-layer-freq", "'([0]*1+[1]*x)'"),
        ("--attention-dropout", "'lots'"),
        ("--cuda-graph-scope", "'attn,,mlp'"),
    ]:
        assert f". {field} = {value}: " in out, field
    assert out.count("\n     fix: ") == 7


@pytest.mark.parametrize("text", ["full", "full,attn"])
def test_deprecated_full_scope_is_called_deprecated(text):
    code, out = check([*TE, "--cuda-graph-scope", text])
    assert code == 1
    assert 'megatron-core: "full scope is deprecated"' in out
    assert "unknown" not in out


def test_every_model_flag_has_both_spellings():
    parser = build_parser()
    flags = [f for f in parser._option_string_actions if f.startswith("--") and f != "--help"]
    for flag in flags:
        other = "--" + (
            flag[2:].replace("-", "_") if "-" in flag[2:] else flag[2:].replace("_", "-")
        )
        assert other in parser._option_string_actions, flag


# -- exit codes ----------------------------------------------------------------------------------


def test_broken_command_line_exits_2_in_a_few_lines_with_a_hint():
    proc = _run("check", "--cuda-graph-scpoe", "attn")
    assert proc.returncode == 2
    assert proc.stdout == ""
    err = proc.stderr.strip().splitlines()
    assert len(err) <= 4, proc.stderr
    assert "unrecognized arguments: --cuda-graph-scpoe attn" in err[0]
    assert any("did you mean --cuda-graph-scope?" in line for line in err)
    assert "exit codes: 0 OK, 1 problems, 2 a broken command line" in err[-1]


def test_abbreviated_flag_is_not_taken_for_another_as_megatron_lm(capsys):
    with pytest.raises(SystemExit) as info:
        run_check([*TE, "--cuda-graph-scop", "attn"], out=io.StringIO())
    assert info.value.code == 2
    assert "did you mean --cuda-graph-scope?" in capsys.readouterr().err


def test_flag_without_value_exits_2():
    with pytest.raises(SystemExit) as info:
        run_check(["--num-experts"], out=io.StringIO())
    assert info.value.code == 2


# A Megatron-LM command line as pasted from a launcher: flags the check does not read
# (several values, a store_true, a negative number, a misspelling of one it reads) around
# the flags it does read.
PASTED = [
    "--hidden-size", "1024", "--data-path", "1.0", "/data/a", "1.0", "/data/b", "--bf16",
    "--adam-eps", "-1e-8", "--seq-lenght", "4096", "--lr=6e-4",
    *DENSE_FULL_ITERATION, "--micro-batch-size", "4", "--tensor-model-parallel-size", "2",
    "--num-experts", "8", "--moe-router-topk", "2", "--cpu-offloading",
]  # fmt: skip


def test_a_pasted_megatron_lm_command_line_gets_the_verdict_of_the_flags_it_reads():
    """(2026-12-05: a whole Megatron-LM command line exited 2 on its first flag the check
    does not read, ``--num-layers``, with "did you mean --num-experts?" hints; the only way
    was to pick the CUDA-graph flags out by hand.)"""
    code, out = check([*PASTED, "--skip-unknown-flags"])
    plain_code, plain = check([*DENSE_FULL_ITERATION, "--micro-batch-size", "4",
                               "--tensor-model-parallel-size", "2", "--num-experts", "8",
                               "--cpu-offloading", "--bf16"])  # fmt: skip
    notes = [line for line in lines(out) if "does not read" in line]
    assert notes == [
        "note: 6 flag(s) this check does not read were skipped (--skip-unknown-flags): "
        "--hidden-size, --data-path, --adam-eps, --seq-lenght (did you mean --seq-length?), "
        "--lr, --moe-router-topk"
    ], out
    # the rest is the verdict of the flags it reads alone (here: problems, exit 1)
    assert (code, [line for line in lines(out) if line not in notes]) == (plain_code, lines(plain))
    assert code == 1 and "--cpu-offloading = True" in out


def test_without_the_option_a_pasted_command_line_is_broken_and_the_hint_names_it(capsys):
    with pytest.raises(SystemExit) as raised:
        check(PASTED)
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --hidden-size 1024 --data-path" in err
    assert "hint: checking a whole Megatron-LM command line? add --skip-unknown-flags" in err


@pytest.mark.parametrize(
    ("broken", "said"),
    [
        # the plugin's own namespace: a misspelling there changes the verdict
        (["--cuda-graph-warmup", "3"], "did you mean --cuda-graph-warmup-steps?"),
        (["--cuda_graph_bucket=8,16"], "unrecognized arguments: --cuda_graph_bucket=8,16"),
        # a value that follows no flag (here a second value of a one-value flag)
        (["--micro-batch-size", "4", "8"], "unrecognized arguments: 8"),
    ],
)  # fmt: skip
def test_skipping_unknown_flags_still_refuses_a_broken_command_line(capsys, broken, said):
    with pytest.raises(SystemExit) as raised:
        check([*DENSE_FULL_ITERATION, "--skip-unknown-flags", *broken])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert said in err, err
    assert "add --skip-unknown-flags" not in err


def test_skipping_with_nothing_to_skip_says_nothing():
    code, out = check([*DENSE_FULL_ITERATION, "--skip_unknown_flags"])
    assert code == 0 and "does not read" not in out


def test_help_documents_the_exit_codes():
    proc = _run("check", "--help")
    assert proc.returncode == 0
    assert "Exit codes: 0 OK, 1 problems (bad flag values included), 2 a broken" in " ".join(
        proc.stdout.split()
    )
    assert "--te-version" in proc.stdout


# -- Transformer Engine rules on a laptop ----------------------------------------------------------

# (megatron-core takes delayed weight gradients only with expert-parallel overlap, which
# allows TE graphs of attn, moe_router and moe_preprocess only)
WGRAD = [
    *TE, "--cuda-graph-scope", "attn", "moe_router", "moe_preprocess", "--num-experts", "8",
    "--moe-token-dispatcher-type", "alltoall", "--moe-permute-fusion",
    "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute", "--disable-bias-linear",
]  # fmt: skip


def test_te_rules_without_te_are_not_checked_here_and_say_so():
    # Before: rejected with "requires Transformer Engine >= 2.12.0 (installed: none)".
    code, out = check(WGRAD)
    assert code == 0, out
    assert "Transformer Engine not installed here" in lines(out)[0]
    assert any(
        line.startswith(
            "note: delay_wgrad_compute with attn,moe_router,moe_preprocess in the CUDA graph "
            "scope needs "
            "Transformer Engine >= 2.12.0: not checked here"
        )
        for line in lines(out)
    )


@pytest.mark.parametrize("version, code", [("2.12", 0), ("2.12.0", 0), ("2.11.0", 1)])
def test_te_version_checks_a_gpu_recipe_on_a_laptop(version, code):
    got, out = check([*WGRAD, "--te-version", version])
    assert got == code, out
    assert f"Transformer Engine {version} (--te-version)" in lines(out)[0]
    assert "not checked here" not in out
    if code:
        assert 'Megatron-LM: "CUDA graph with delay_wgrad_compute requires TE version >= ' in out
        assert f"Transformer Engine >= 2.12.0 (given: {version})" in out


def test_installed_te_is_used_without_te_version(monkeypatch):
    from packaging.version import Version

    monkeypatch.setattr(environment, "installed_te_version", lambda: Version("2.11.0"))
    code, out = check(WGRAD)
    assert code == 1
    assert "Transformer Engine >= 2.12.0 (installed: 2.11.0)" in out
    assert "Transformer Engine 2.11.0 (megatron" not in out
    assert lines(out)[0].endswith("Transformer Engine 2.11.0)")
    assert "a run needs Transformer Engine" not in out


@pytest.mark.parametrize("flag", ["--check-for-large-grads", "--check-for-spiky-loss"])
def test_a_history_check_with_full_iteration_fails_the_check(flag):
    code, out = check([*DENSE_FULL_ITERATION, flag])
    assert code == 1
    assert f"{flag} = True: full_iteration CUDA graph with" in out
    assert f"fix: drop {flag}, or use TE scopes" in out


# -- every field a rule reads has its flag (review of 2026-12-04) ------------------------------

# Fields a rule reads that have no Megatron-LM flag of their own: megatron-core derives them
# (the p2p settings from the pipeline layout, use_te_rng_tracker from --te-rng-tracker,
# moe_layer_recompute from --recompute-modules), or only config objects carry them.
NO_FLAG = {
    "model_te_rng_tracker", "batch_p2p_comm", "batch_p2p_sync", "grad_norm_skip_threshold",
    # Megatron-LM derives params_dtype from --bf16/--fp16; mixed_precision is Bridge's recipe
    "params_dtype", "mixed_precision",
}  # fmt: skip


PP_VPP_FULL = [*DENSE_FULL_ITERATION, "--pipeline-model-parallel-size", "2",
               "--virtual-pipeline-model-parallel-size", "2"]  # fmt: skip


def test_full_iteration_with_virtual_stages_reads_megatron_lm_s_p2p_default():
    """(review of 2026-12-04: the check had no p2p flag and no Megatron-LM default, so a
    full-iteration graph with virtual pipeline stages could never pass, nor be followed to a
    pass.) Megatron-LM overlaps p2p with virtual stages, so it batches none; its
    ``--no-overlap-p2p-communication`` batches them, which the capture refuses."""
    code, out = check(PP_VPP_FULL)
    assert code == 0, out
    code, out = check([*PP_VPP_FULL, "--no-overlap-p2p-communication"])
    assert code == 1 and "overlap_p2p_comm (--no-overlap-p2p-communication)" in out
    assert "without --no-overlap-p2p-communication" in out


def test_the_deprecated_moe_layer_recompute_flag_is_read():
    argv = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn", "moe",
            "--num-experts", "8", "--moe-expert-capacity-factor", "1.0",
            "--moe-pad-expert-input-to-capacity"]  # fmt: skip
    assert check(argv)[0] == 0
    code, out = check([*argv, "--moe-layer-recompute"])
    assert code == 1 and "(+moe from --moe-layer-recompute)" in out, out


def test_every_field_a_rule_reads_has_a_check_flag():
    """(the check lacked the parallel sizes, fp16 and the optimizer flags: a real
    Megatron-LM command line exited 2, and a fix it printed could not be followed)"""
    from cudagraph_plugin.config.fields import FIELD_PATHS

    dests = {action.dest for action in build_parser()._actions}
    missing = {
        setting
        for setting, paths in FIELD_PATHS.items()
        if not any(path in dests for path in paths if "." not in path)
    }
    assert missing == NO_FLAG


def test_the_optimizer_graph_fix_can_be_followed_on_the_command_line():
    argv = [
        "--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn", "moe_router",
        "--num-experts", "8", "--optimizer-cuda-graph", "--te-version", "2.12",
    ]  # fmt: skip
    code, out = check(argv)
    assert code == 1 and "fix: use the distributed optimizer" in out
    code, out = check([*argv, "--use-distributed-optimizer"])
    assert "fix: use the distributed optimizer" not in out
    # a Megatron-LM command line's parallel layout and precision are read, not refused
    code, out = check(
        [*argv, "--use-distributed-optimizer", "--tensor-model-parallel-size", "2",
         "--sequence-parallel", "--pipeline-model-parallel-size", "2",
         "--num-virtual-stages-per-pipeline-rank", "2", "--fp16", "--loss-scale", "1024"]
    )  # fmt: skip
    assert code == 1 and "--fp16, --optimizer-cuda-graph = (True, True)" in out


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [("seq_length", "9" * 5000, "ValueError"), ("loss_scale", 10**400, "OverflowError")],
)
def test_a_value_python_cannot_convert_is_a_problem_not_a_traceback(field, value, error):
    """(review of 2026-12-04: an AttributeError from the rules, exit 1 with a traceback)"""
    from cudagraph_plugin import check_config

    config = {"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration", field: value}
    result = check_config(config, te_version=None)
    [problem] = [p for p in result.problems if p.fields == (field,)]
    assert problem.problem.startswith(f"cannot be read ({error}: ")


# -- megatron-core 0.18+'s spelling with an older megatron-core installed -----------------------

NEWER_SPELLINGS = [
    (["--cuda-graph-impl", "full_iteration"], "--cuda-graph-impl=full_iteration",
     "local", "full_iteration"),
    (["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn", "mlp"],
     "--cuda-graph-modules", "transformer_engine", "attn,mlp"),
]  # fmt: skip


@pytest.mark.parametrize("argv, written, impl, scope", NEWER_SPELLINGS)
def test_a_newer_spelling_with_an_older_megatron_core_is_noted(
    monkeypatch, argv, written, impl, scope
):
    """(review of 2026-12-04: ``--cuda-graph-impl full_iteration`` passed the check with
    megatron-core 0.16.1 installed, whose own arguments refuse it, without a word.)"""
    monkeypatch.setattr(environment, "mcore_spells_modules", lambda: False)
    code, out = check(argv)
    assert code == 0, out
    [note] = [line for line in lines(out) if "megatron-core 0.18+'s spelling" in line]
    assert note.startswith(f"note: {written}: megatron-core 0.18+'s spelling, which megatron-core ")
    assert f"reads it as cuda_graph_impl={impl} with cuda_graph_scope={scope} " in note
    monkeypatch.setattr(environment, "mcore_spells_modules", lambda: True)
    assert "0.18+'s spelling" not in check(argv)[1]


@pytest.mark.parametrize(
    "argv",
    [DENSE_FULL_ITERATION, DENSE_TE, ["--cuda-graph-impl", "none", "--cuda-graph-modules", "attn"]],
    ids=["local", "te", "off"],
)
def test_the_older_spelling_or_graphs_off_get_no_spelling_note(monkeypatch, argv):
    monkeypatch.setattr(environment, "mcore_spells_modules", lambda: False)
    assert "0.18+'s spelling" not in check(argv)[1]


def test_the_installed_spelling_is_read_from_megatron_core_as_importing_it_says():
    """The check reads megatron-core's ``TransformerConfig`` as text (no import); it must
    agree with the imported dataclass's fields."""
    from cudagraph_plugin.compat.generation import new_generation

    environment.mcore_spells_modules.cache_clear()
    assert environment.mcore_spells_modules() is new_generation()


def test_a_refused_configuration_gets_no_advice():
    """(review of 2026-12-04: an MoE scope on a dense model was refused with the fix "drop the
    MoE scopes" and advised, beside it, that it "adds memory; widen only after measuring".)"""
    code, out = check(["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "moe"])
    assert code == 1 and "moe needs an MoE model" in out
    assert not [line for line in lines(out) if line.startswith("advice:")]
    code, out = check(["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "mlp"])
    assert code == 0 and "advice: scope mlp is narrower than recommended" in out


def test_a_misspelt_recompute_module_is_refused_with_the_name_meant():
    """(review of 2026-12-04: ``--recompute-modules core_atn`` passed, and hid the dropout
    rule the right name meets; megatron-core asserts at model build.)"""
    argv = [*DENSE_TE, "--recompute-granularity", "selective", "--recompute-modules"]
    code, out = check([*argv, "core_atn"])
    assert code == 1 and "unknown selective-recompute module(s) 'core_atn'" in out
    assert "(did you mean core_attn?)" in out
    code, out = check([*argv, "core_attn", "--attention-dropout", "0"])
    assert code == 0, out


@pytest.mark.parametrize("flag", ["--cuda-graph-buckets", "--cuda-graph-report-json"])
@pytest.mark.parametrize("empty", ["", "  "])
def test_an_empty_bucket_list_or_report_path_is_a_usage_error(capsys, flag, empty):
    """(review of 2026-12-04: an unset variable in a launcher, ``--cuda-graph-report-json
    "$REPORT"``, lost the report without a word.)"""
    with pytest.raises(SystemExit) as raised:
        check([*DENSE_FULL_ITERATION, f"{flag}={empty}"])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert f"an empty value, got {empty!r}: give a value, or leave the flag out" in err


def test_a_host_s_empty_default_is_not_taken_for_an_empty_flag():
    """(review of today's diff: ``parser.set_defaults(cuda_graph_report_json="")``, a host's
    "not set", was refused as if typed.)"""
    import argparse

    from cudagraph_plugin.cli import add_cuda_graph_arguments
    from cudagraph_plugin.config.check import check_config

    parser = argparse.ArgumentParser()
    parser.set_defaults(cuda_graph_report_json="", cuda_graph_buckets="")
    add_cuda_graph_arguments(parser)
    args = parser.parse_args(["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"])
    assert args.cuda_graph_report_json == "" and check_config(args).ok
    with pytest.raises(SystemExit):
        parser.parse_args(["--cuda-graph-report-json", ""])


def test_the_console_script_names_itself_and_a_dash_value_gets_its_hint(tmp_path):
    """(review of 2026-12-04: ``mcgraph-check`` printed ``usage: python -m cudagraph_plugin
    check``, and ``--cuda-graph-buckets -256,512`` said "expected one argument" alone.)"""
    script = Path(sys.executable).with_name("mcgraph-check")
    if not script.exists():
        pytest.skip("the console script is not installed next to this interpreter")
    proc = subprocess.run(
        [str(script), "--cuda-graph-buckets", "-256,512"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.startswith("mcgraph-check: error: argument --cuda-graph-buckets")
    assert "hint: a value starting with '-' is given as --cuda-graph-buckets=VALUE" in proc.stderr
    assert "usage: mcgraph-check [flags]" in proc.stderr


def test_the_recompute_module_names_are_the_installed_megatron_core_s(monkeypatch):
    """(review of today's diff: 0.19's gdn_norm_out passed with 0.16.1 installed, which
    refuses it.) Read from megatron-core's source, as importing it says."""
    from megatron.core.transformer import TransformerConfig

    environment.mcore_recompute_modules.cache_clear()
    known = environment.mcore_recompute_modules()

    def build(name):
        return TransformerConfig(
            num_layers=1, hidden_size=16, num_attention_heads=2,
            recompute_granularity="selective", recompute_modules=[name],
        )  # fmt: skip

    for name in set(known) - {"moe_act", "mla_up_proj"}:  # (those two need more set-up)
        build(name)
    if "gdn_norm_out" not in known:
        with pytest.raises(AssertionError, match="Invalid choices for recompute_modules"):
            build("gdn_norm_out")
    argv = [*DENSE_TE, "--recompute-granularity", "selective", "--recompute-modules"]
    code, out = check([*argv, "gdn_norm_out"])
    assert (code == 0) is ("gdn_norm_out" in known), out
    monkeypatch.setattr(environment, "mcore_recompute_modules", lambda: (*known, "gdn_norm_out"))
    assert check([*argv, "gdn_norm_out"])[0] == 0


def test_the_help_lists_each_spelling_of_a_flag_once():
    """A one-word flag (``--fp16``) has one spelling: the help listed it twice (``--fp16,
    --fp16``), the underscored twin of its dashed form being itself."""
    parser = build_parser()
    for action in parser._actions:
        assert len(set(action.option_strings)) == len(action.option_strings), action
    assert build_parser().parse_args(["--fp16", "--optimizer", "sgd"]).fp16 is True
    # two-word flags keep both spellings
    assert build_parser().parse_args(["--use_distributed_optimizer"]).use_distributed_optimizer


def test_the_check_command_plans_no_warmup_rewrite_for_its_own_string():
    """Its lenient parser keeps the warm-up a string; Megatron-LM's parser has ints: the
    command said "auto-fix: set --cuda-graph-warmup-steps=5 (was '5' ...)" on every line."""
    code, out = check([*DENSE_FULL_ITERATION, "--cuda-graph-warmup-steps", "5"])
    assert code == 0
    assert "cuda-graph-warmup-steps=5 (was" not in out and "warmup=5" in out


def test_te_graphs_read_the_precision_flags_of_the_command_line():
    """Megatron-LM trains in fp32 without --bf16 or --fp16, and megatron-core's TE layer
    graphs fail at the capture then (an H100, 2026-12-05); a pasted line may leave out what
    does not concern the graphs, so without either flag the check notes it, with --fp16 it
    refuses, with --bf16 it says nothing."""
    argv = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn"]
    said = "note: TE graphs need bf16 layers (megatron-core captures them with bfloat16"
    code, out = check(argv)
    assert code == 0 and said in out, out
    # (said at run time too, by argparse hosts without a precision flag: no "pass --bf16")
    assert "a Megatron-LM launcher then trains in fp32 and its capture fails" in out
    code, out = check([*argv, "--bf16"])
    assert code == 0 and "bf16 layers" not in out, out
    code, out = check([*argv, "--fp16"])
    assert code == 1 and said not in out, out
    assert "--cuda-graph-impl, --fp16 = ('transformer_engine', True)" in out
    assert "fix: train in bf16 (pass --bf16; drop --fp16)" in out
    # full-iteration graphs are captured from the run's own tensors: any precision
    code, out = check(["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"])
    assert code == 0 and "TE graphs need bf16 layers" not in out, out
    # (its advice towards TE scopes says what they need: the line says no precision)
    assert "(start with TE attn,mlp on bf16 layers)" in out
    fp16 = ["--fp16", "--loss-scale", "4096"]
    code, out = check(["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration", *fp16])
    assert code == 0 and "start with TE" not in out, out  # they would be refused


def test_check_refuses_buckets_beyond_megatron_lm_s_learned_position_embeddings():
    """Megatron-LM's position embeddings are learned_absolute by default, their table as long
    as --max-position-embeddings (else --seq-length): a bucket beyond it is a problem."""
    argv = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]
    argv += ["--cuda-graph-buckets", "16,32,64", "--seq-length", "48"]
    code, out = check(argv)
    assert code == 1, out
    assert out.startswith("cuda graphs: impl=local scope=full_iteration buckets=16,32,64 ")
    assert "--cuda-graph-buckets, --seq-length, --position-embedding-type = " in out
    assert "('16,32,64', 48, 'learned_absolute')" in out
    assert "fix: give buckets up to 48 (e.g. 16,32,48)" in out
    # (Megatron-LM requires --max-position-embeddings: the fix names it too)
    assert "(Megatron-LM: --max-position-embeddings >= 64)" in out
    code, out = check([*argv, "--max-position-embeddings", "64"])
    assert code == 0, out
    # Megatron-LM's legacy flag for rotary embeddings (its validate_args derives the type)
    code, out = check([*argv, "--use-rotary-position-embeddings"])
    assert code == 0 and "--position-embedding-type rope" in out, out
    code, out = check([*argv, "--position-embedding-type", "rope"])
    assert code == 0 and "go up to" not in out, out


def test_bucket_lengths_given_as_several_values_get_the_comma_joined_flag(capsys):
    """(user trial, 2026-12-05: `--cuda-graph-buckets 256 512` was told only that 512 is "a
    value without a flag".)"""
    with pytest.raises(SystemExit) as raised:
        check([*DENSE_FULL_ITERATION, "--cuda-graph-buckets", "256", "512", "1024", "--bf16"])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    hint = "--cuda-graph-buckets takes one value, the lengths joined by commas"
    assert f"hint: {hint}: --cuda-graph-buckets 256,512,1024\n" in err
    assert err.count(hint) == 1 and "a value without a flag" not in err
    # found where it is a stray (its first occurrence may be another flag's value), and in
    # the underscore spelling too (review of 2026-12-05)
    with pytest.raises(SystemExit):
        check(["--seq-length", "512", *DENSE_FULL_ITERATION, "--cuda_graph_buckets", "256", "512"])
    assert f"hint: {hint}: --cuda-graph-buckets 256,512\n" in capsys.readouterr().err
    # another flag's stray value keeps the general hint (no comma-joined value for it)
    with pytest.raises(SystemExit):
        check([*DENSE_FULL_ITERATION, "--seq-length", "512", "1024"])
    assert "1024: a value without a flag" in capsys.readouterr().err


def test_the_example_hosts_refuse_a_shortened_flag_as_megatron_lm_and_check_do():
    """(user trial, 2026-12-05: `rl_loop.py --cuda-graph-bucket 16,32,48` ran with buckets,
    argparse completing the prefix, while `check` refused it.)"""
    import train_gpt
    from hookspecs import get_plugin_manager

    parser = train_gpt.build_parser(get_plugin_manager())
    with pytest.raises(SystemExit):
        parser.parse_args(["--cuda-graph-bucket", "16,32,48"])
    assert parser.parse_args(["--cuda-graph-buckets", "16,32,48"]).cuda_graph_buckets


def test_the_example_hosts_say_a_broken_command_line_in_one_line(capsys):
    """(user trial, 2026-12-05: a flag typo printed some sixty lines of usage, no
    did-you-mean, unlike the hosts' own refusals and `check`.)"""
    import train_gpt
    from hookspecs import get_plugin_manager

    parser = train_gpt.build_parser(get_plugin_manager())
    with pytest.raises(SystemExit) as raised:
        parser.parse_args(["--cuda-graph-bucket", "16,32"])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        "train_gpt.py: error: unrecognized arguments: --cuda-graph-bucket 16,32 "
        "(--cuda-graph-bucket: did you mean --cuda-graph-buckets?)\n"
        "(train_gpt.py --help lists the flags)\n"
    )


def test_a_config_override_gets_check_config_named(capsys):
    """(user trial, 2026-12-05: a Hydra override, ``actor.megatron.cuda_graph_impl=local``,
    was told it is "a value without a flag".)"""
    for override in ("actor.megatron.cuda_graph_impl=local", "+model.cuda_graph_buckets=[256]"):
        with pytest.raises(SystemExit) as raised:
            check([override, *DENSE_FULL_ITERATION])
        assert raised.value.code == 2
        err = capsys.readouterr().err
        assert f"hint: {override}: a config override; this command reads command-line" in err
        assert "cudagraph_plugin.check_config(cfg.<the section" in err
        assert "a value without a flag" not in err
    # a launch line's environment variable is no config override (review of 2026-12-05)
    with pytest.raises(SystemExit):
        check(["CUDA_DEVICE_MAX_CONNECTIONS=1", *DENSE_FULL_ITERATION])
    err = capsys.readouterr().err
    assert "hint: CUDA_DEVICE_MAX_CONNECTIONS=1: an environment variable" in err
    assert "config override" not in err


def test_a_bucket_problem_names_the_flag_once():
    """(user trial, 2026-12-05: "--cuda-graph-buckets = '512,256,512': cuda_graph_buckets has
    a length twice" named one field two ways.)"""
    code, out = check([*DENSE_FULL_ITERATION, "--cuda-graph-buckets", "512,256,512"])
    assert code == 1
    assert "--cuda-graph-buckets = '512,256,512': it has a length twice: 512 in" in out, out
    assert "cuda_graph_buckets" not in out, out
