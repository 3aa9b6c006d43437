"""The command-line flags and the performance-harness overrides."""

from __future__ import annotations

import argparse
import copy
import logging
from types import SimpleNamespace as NS

import pytest

from cudagraph_plugin.cli import add_cuda_graph_arguments, apply_overrides, parse_scope_arg
from cudagraph_plugin.config.rules import find_violations
from cudagraph_plugin.config.settings import read_settings
from cudagraph_plugin.config.vocabulary import SCOPES


def parser():
    p = argparse.ArgumentParser(prog="train")
    add_cuda_graph_arguments(p)
    return p


def parse_error(capsys, argv):
    with pytest.raises(SystemExit) as info:
        parser().parse_args(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


# -- add_cuda_graph_arguments ---------------------------------------------------------------------


def test_defaults():
    args = parser().parse_args([])
    assert args.cuda_graph_impl == "none"
    assert args.cuda_graph_scope is None
    assert args.cuda_graph_warmup_steps is None
    assert args.cuda_graph_report_json is None
    assert args.cuda_graph_fallback_on_slowdown is False


@pytest.mark.parametrize("flag", ["--cuda-graph-impl", "--cuda_graph_impl"])
@pytest.mark.parametrize("impl", ["none", "local", "transformer_engine", "full_iteration"])
def test_both_spellings_of_impl(flag, impl):
    assert parser().parse_args([flag, impl]).cuda_graph_impl == impl


def test_the_host_flags_take_megatron_core_0_18_s_spelling_as_the_check_does():
    """(review of 2026-12-04: ``check`` said OK to ``--cuda-graph-impl full_iteration`` and
    ``--cuda-graph-modules``, which every host using these flags refused as a usage error.)"""
    args = parser().parse_args(["--cuda-graph-impl", "full_iteration"])
    settings = read_settings(args)
    assert (settings.impl, settings.scope) == ("local", ("full_iteration",))
    args = parser().parse_args(
        ["--cuda-graph-impl", "transformer_engine", "--cuda_graph_modules", "attn", "mlp"]
    )
    assert args.cuda_graph_modules == ["attn", "mlp"] and args.cuda_graph_scope is None
    assert read_settings(args).scope == ("attn", "mlp")
    both = parser().parse_args(["--cuda-graph-scope", "attn", "--cuda-graph-modules", "mlp"])
    assert read_settings(both).scope_conflict  # refused by the rules, as megatron-core does


def test_both_spellings_of_every_flag():
    dashes = parser().parse_args(
        [
            "--cuda-graph-scope",
            "attn",
            "--cuda-graph-warmup-steps",
            "4",
            "--cuda-graph-report-json",
            "r.json",
            "--cuda-graph-fallback-on-slowdown",
            "--optimizer-cuda-graph",
            "--cuda-graph-buckets",
            "256,512",
            "--cuda-graph-baseline-steps",
            "6",
            "--cuda-graph-accept-eager",
            "--cuda-graph-device-grad-norm",
            "--cuda-graph-log-all-ranks",
            "--cuda-graph-peer-exit-deadline",
            "20",
        ]
    )
    underscores = parser().parse_args(
        [
            "--cuda_graph_scope",
            "attn",
            "--cuda_graph_warmup_steps",
            "4",
            "--cuda_graph_report_json",
            "r.json",
            "--cuda_graph_fallback_on_slowdown",
            "--optimizer_cuda_graph",
            "--cuda_graph_buckets",
            "256,512",
            "--cuda_graph_baseline_steps",
            "6",
            "--cuda_graph_accept_eager",
            "--cuda_graph_device_grad_norm",
            "--cuda_graph_log_all_ranks",
            "--cuda_graph_peer_exit_deadline",
            "20",
        ]
    )
    assert (
        vars(dashes)
        == vars(underscores)
        == {
            "cuda_graph_impl": "none",
            "cuda_graph_scope": ["attn"],
            "cuda_graph_modules": None,
            "cuda_graph_warmup_steps": 4,
            "cuda_graph_report_json": "r.json",
            "cuda_graph_fallback_on_slowdown": True,
            "optimizer_cuda_graph": True,
            "cuda_graph_buckets": "256,512",
            "cuda_graph_baseline_steps": 6,
            "cuda_graph_accept_eager": True,
            "cuda_graph_device_grad_norm": True,
            "cuda_graph_log_all_ranks": True,
            "cuda_graph_peer_exit_deadline": 20.0,
        }
    )


@pytest.mark.parametrize("seconds", ["-1", "0.5", "soon", "1e10"])
def test_a_bad_peer_exit_deadline_exits_2_with_the_fix(capsys, seconds):
    err = parse_error(capsys, ["--cuda-graph-peer-exit-deadline", seconds])
    assert f"got {seconds!r}: give 0 (off) or a number of seconds from 1 to 3600" in err


def test_unknown_impl_exits_2(capsys):
    err = parse_error(capsys, ["--cuda-graph-impl", "full_iter"])
    assert "invalid choice: 'full_iter'" in err


@pytest.mark.parametrize(
    "text, expected",
    [
        ("attn, mlp", ["attn", "mlp"]),
        ("attn,mlp", ["attn", "mlp"]),
        (" attn ,moe_router , moe_preprocess ", ["attn", "moe_router", "moe_preprocess"]),
    ],
)
def test_scope_parsing(text, expected):
    assert parser().parse_args(["--cuda-graph-scope", text]).cuda_graph_scope == expected


@pytest.mark.parametrize(
    "tokens",
    [["attn", "mlp"], ["attn,", "mlp"], ["attn", ",mlp"], ["attn,mlp"], ["attn, mlp"]],
    ids=["megatron-lm", "unquoted-comma-space", "leading-comma", "bridge", "quoted"],
)
def test_scope_takes_megatron_lm_space_separated_lists(tokens):
    for flag in ("--cuda-graph-scope", "--cuda_graph_scope"):
        assert parser().parse_args([flag, *tokens]).cuda_graph_scope == ["attn", "mlp"]


@pytest.mark.parametrize("text", ["attn,", "attn,,mlp", ",attn", "attn, ,mlp"])
def test_empty_scope_name_exits_2(capsys, text):
    err = parse_error(capsys, ["--cuda-graph-scope", text])
    assert f"empty scope name in {text!r}" in err


@pytest.mark.parametrize("name", SCOPES)
def test_every_single_valid_scope(name):
    assert parser().parse_args(["--cuda_graph_scope", name]).cuda_graph_scope == [name]


@pytest.mark.parametrize("text, bad", [("attn,bogus", "bogus"), ("Attn", "Attn")])
def test_unknown_scope_exits_2_naming_the_bad_value(capsys, text, bad):
    err = parse_error(capsys, ["--cuda-graph-scope", text])
    assert "--cuda-graph-scope" in err
    assert f"unknown scope(s) {bad!r}" in err
    assert "valid: full_iteration, attn, mlp, moe, moe_router, moe_preprocess, mamba" in err


@pytest.mark.parametrize("text", ["full", "attn,full"])
def test_deprecated_scope_exits_2_saying_deprecated(capsys, text):
    err = parse_error(capsys, ["--cuda-graph-scope", text])
    assert "is a deprecated megatron-core name ('full' meant whole-layer capture" in err
    assert "unknown" not in err
    assert "name the scopes, e.g. attn mlp" in err


@pytest.mark.parametrize("text", ["full_iteration_inference", "attn,full_iteration_inference"])
def test_deprecated_inference_scope_exits_2_saying_what_it_was(capsys, text):
    """(2026-12-05: it was explained as "'full' meant whole-layer capture", and no word of
    the inference setting it moved to.)"""
    err = parse_error(capsys, ["--cuda-graph-scope", text])
    assert "megatron-core 0.19's deprecated name for inference CUDA graphs" in err
    assert "inference_cuda_graph_scope=block" in err
    assert "whole-layer" not in err


def test_duplicated_scope_is_kept_for_the_settings_to_use_once():
    # megatron-core accepts a scope listed twice: not a usage error (issue 22).
    assert parse_scope_arg("attn,mlp,attn") == ["attn", "mlp", "attn"]
    parser = argparse.ArgumentParser()
    add_cuda_graph_arguments(parser)
    args = parser.parse_args(
        ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn", "mlp", "attn"]
    )
    settings = read_settings(args)
    assert settings.scope == ("attn", "mlp")
    assert settings.duplicated_scopes == ("attn",)


@pytest.mark.parametrize("text", ["", " ", ",", " , "])
def test_empty_scope_exits_2(capsys, text):
    err = parse_error(capsys, ["--cuda-graph-scope", text])
    assert "empty scope" in err


def test_parse_scope_arg_raises_argument_type_error():
    with pytest.raises(argparse.ArgumentTypeError, match="unknown scope"):
        parse_scope_arg("nope")
    assert parse_scope_arg("mamba") == ["mamba"]


@pytest.mark.parametrize("steps", ["0", "3", "12"])
def test_warmup_steps_accepted(steps):
    assert parser().parse_args(["--cuda-graph-warmup-steps", steps]).cuda_graph_warmup_steps == int(
        steps
    )


@pytest.mark.parametrize("steps", ["-1", "-10", "abc", "1.5"])
def test_bad_warmup_steps_exit_2(capsys, steps):
    err = parse_error(capsys, ["--cuda-graph-warmup-steps", steps])
    assert f"expected a non-negative integer, got {steps!r}" in err


def test_parser_keeps_its_own_definition():
    p = argparse.ArgumentParser()
    # A host (e.g. Megatron-LM 0.19) that already knows its own impl names.
    p.add_argument(
        "--cuda-graph-impl",
        choices=["none", "local", "transformer_engine", "full_iteration"],
        default="local",
    )
    p.add_argument("--cuda-graph-warmup-steps", "--cuda_graph_warmup_steps", type=int, default=7)
    add_cuda_graph_arguments(p)  # no argparse conflict error
    assert p.parse_args([]).cuda_graph_impl == "local"
    assert p.parse_args(["--cuda-graph-impl", "full_iteration"]).cuda_graph_impl == "full_iteration"
    # A flag with both spellings taken is not added again: the host's type and default rule.
    assert p.parse_args([]).cuda_graph_warmup_steps == 7
    assert p.parse_args(["--cuda_graph_warmup_steps", "-3"]).cuda_graph_warmup_steps == -3
    # Flags the host does not have are added.
    assert p.parse_args(["--cuda-graph-scope", "attn, mlp"]).cuda_graph_scope == ["attn", "mlp"]


HOST_DEFAULTS = {
    "cuda_graph_impl": "local",
    "cuda_graph_scope": ["full_iteration"],
    "cuda_graph_warmup_steps": 5,
    "cuda_graph_report_json": "r.json",
    "cuda_graph_fallback_on_slowdown": True,
    "cuda_graph_buckets": "256,512",
    "cuda_graph_baseline_steps": 6,
    "cuda_graph_accept_eager": True,
    "cuda_graph_peer_exit_deadline": 20.0,
}


@pytest.mark.parametrize("lenient", [False, True])
def test_defaults_the_host_set_before_the_flags_are_kept(lenient):
    """A launcher's recipe: parser.set_defaults(...) first, the plugin's flags added after."""
    p = argparse.ArgumentParser()
    p.set_defaults(**HOST_DEFAULTS)
    add_cuda_graph_arguments(p, lenient=lenient)
    args = vars(p.parse_args([]))
    assert {dest: args[dest] for dest in HOST_DEFAULTS} == HOST_DEFAULTS
    # the flags the host gave no default keep the plugin's
    assert args["cuda_graph_device_grad_norm"] is False
    assert args["optimizer_cuda_graph"] is False
    # and the command line still wins over the host's defaults
    given = p.parse_args(
        ["--cuda-graph-impl", "transformer_engine", "--cuda_graph_scope", "attn", "mlp"]
    )
    assert given.cuda_graph_impl == "transformer_engine"
    assert given.cuda_graph_scope == (["attn", "mlp"] if not lenient else "attn,mlp")
    assert given.cuda_graph_warmup_steps == 5


def test_host_spelling_owns_the_option_and_no_second_spelling_is_added():
    """A host that defines one spelling (Megatron-LM 0.19 allows impl=full_iteration) keeps
    sole ownership: adding the other spelling with the plugin's choices would make the two
    spellings accept different values."""
    p = argparse.ArgumentParser()
    p.add_argument("--cuda-graph-impl", default="transformer_engine")
    add_cuda_graph_arguments(p)
    host_action = p._option_string_actions["--cuda-graph-impl"]
    assert host_action.choices is None and host_action.default == "transformer_engine"
    assert "--cuda_graph_impl" not in p._option_string_actions
    assert p.parse_args([]).cuda_graph_impl == "transformer_engine"
    assert p.parse_args(["--cuda-graph-impl", "full_iteration"]).cuda_graph_impl == (
        "full_iteration"
    )
    # the other options are still added under both spellings
    assert "--cuda_graph_scope" in p._option_string_actions


# -- apply_overrides: Megatron-Bridge's set_cuda_graph_overrides -----------------------------------


def recipe(**model):
    fields = dict(
        cuda_graph_impl="none",
        cuda_graph_scope=[],
        cuda_graph_warmup_steps=3,
        use_te_rng_tracker=False,
    )
    fields.update(model)
    return NS(
        model=NS(**fields),
        rng=NS(te_rng_tracker=False),
        rerun_state_machine=NS(check_for_nan_in_loss=True),
        ddp=NS(check_for_nan_in_grad=True),
        train=NS(micro_batch_size=1),
    )


def _messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "cudagraph_plugin"]


def test_overrides_te_scopes_on_a_nested_recipe(caplog):
    config = recipe()
    expected = copy.deepcopy(config)
    expected.model.cuda_graph_impl = "transformer_engine"
    expected.model.cuda_graph_scope = ["attn", "mlp"]
    expected.model.cuda_graph_warmup_steps = 5
    expected.model.use_te_rng_tracker = True
    expected.rng.te_rng_tracker = True
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        changes = apply_overrides(
            config,
            cuda_graph_impl="transformer_engine",
            cuda_graph_scope="attn, mlp",
            cuda_graph_warmup_steps=5,
        )
    assert config == expected
    assert changes == [
        "--cuda-graph-impl: set model.cuda_graph_impl='transformer_engine'",
        "--cuda-graph-scope: set model.cuda_graph_scope=['attn', 'mlp']",
        "--cuda-graph-warmup-steps: set model.cuda_graph_warmup_steps=5",
        "CUDA graphs are on (TE RNG tracker): set model.use_te_rng_tracker=True",
        "CUDA graphs are on (TE RNG tracker): set rng.te_rng_tracker=True",
    ]
    messages = _messages(caplog)
    assert len(messages) == len(changes)
    assert all(any(change in m for m in messages) for change in changes)
    assert find_violations(read_settings(config)) == []


def test_overrides_local_full_iteration_turns_off_both_nan_checks(caplog):
    config = recipe()
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        changes = apply_overrides(
            config, cuda_graph_impl="local", cuda_graph_scope=["full_iteration"]
        )
    assert config.model.cuda_graph_impl == "local"
    assert config.model.cuda_graph_scope == ["full_iteration"]
    assert config.rerun_state_machine.check_for_nan_in_loss is False
    assert config.ddp.check_for_nan_in_grad is False  # Megatron-LM asserts both off
    assert config.model.use_te_rng_tracker is True and config.rng.te_rng_tracker is True
    nan_change = [c for c in changes if "check_for_nan_in" in c]
    assert nan_change == [
        "full_iteration CUDA graph (the loss cannot be inspected inside the captured "
        "iteration): set rerun_state_machine.check_for_nan_in_loss=False",
        "full_iteration CUDA graph (the gradients cannot be inspected inside the captured "
        "iteration): set ddp.check_for_nan_in_grad=False",
    ]
    assert f"auto-fix: {nan_change[0]}" in _messages(caplog)
    assert find_violations(read_settings(config)) == []


def test_overrides_impl_none_clears_scope_and_leaves_rng_alone(caplog):
    config = recipe(
        cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn"], use_te_rng_tracker=True
    )
    config.rng.te_rng_tracker = True
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        changes = apply_overrides(config, cuda_graph_impl="none")
    assert config.model.cuda_graph_impl == "none"
    assert config.model.cuda_graph_scope == []
    assert config.model.use_te_rng_tracker is True and config.rng.te_rng_tracker is True
    assert changes == [
        "--cuda-graph-impl: set model.cuda_graph_impl='none'",
        "cuda_graph_impl is none: cleared model.cuda_graph_scope (was attn)",
    ]
    assert "auto-fix: cuda_graph_impl is none: cleared model.cuda_graph_scope (was attn)" in (
        _messages(caplog)
    )


@pytest.mark.parametrize(
    "model",
    [
        dict(),
        dict(
            cuda_graph_impl="transformer_engine",
            cuda_graph_scope=["attn", "mlp"],
            use_te_rng_tracker=True,
        ),
    ],
    ids=["off", "te"],
)
def test_overrides_none_leave_a_consistent_recipe_unchanged(caplog, model):
    config = recipe(**model)
    if model:
        config.rng.te_rng_tracker = True
    before = copy.deepcopy(config)
    with caplog.at_level(logging.DEBUG, logger="cudagraph_plugin"):
        assert apply_overrides(config) == []
        assert (
            apply_overrides(
                config,
                cuda_graph_impl=None,
                cuda_graph_scope=None,
                cuda_graph_warmup_steps=None,
            )
            == []
        )
    assert config == before
    assert _messages(caplog) == []


def test_override_with_the_recipe_value_is_not_a_change():
    config = recipe(cuda_graph_impl="local", cuda_graph_scope=["full_iteration"])
    changes = apply_overrides(config, cuda_graph_impl="local", cuda_graph_scope="full_iteration")
    assert not any(c.startswith("--cuda-graph") for c in changes)


def test_overrides_write_the_new_generation_field_when_that_is_what_the_recipe_has():
    config = recipe(cuda_graph_scope=None, cuda_graph_modules=["attn"])
    apply_overrides(config, cuda_graph_impl="transformer_engine", cuda_graph_scope="attn,mlp")
    assert config.model.cuda_graph_modules == ["attn", "mlp"]
    assert config.model.cuda_graph_scope is None


def test_overrides_create_missing_fields_under_model():
    config = NS(model=NS(), rng=NS(te_rng_tracker=False))
    apply_overrides(config, cuda_graph_impl="transformer_engine", cuda_graph_scope="attn")
    assert config.model.cuda_graph_impl == "transformer_engine"
    assert config.model.cuda_graph_scope == ["attn"]
    assert config.rng.te_rng_tracker is True
    assert not hasattr(config, "cuda_graph_impl")


def test_overrides_on_a_megatron_lm_namespace(caplog):
    args = argparse.Namespace(
        cuda_graph_impl="none",
        cuda_graph_scope=None,
        cuda_graph_warmup_steps=3,
        te_rng_tracker=False,
        check_for_nan_in_loss_and_grad=True,
    )
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        changes = apply_overrides(
            args,
            cuda_graph_impl="local",
            cuda_graph_scope="full_iteration",
            cuda_graph_warmup_steps=2,
        )
    assert vars(args) == {
        "cuda_graph_impl": "local",
        "cuda_graph_scope": ["full_iteration"],
        "cuda_graph_warmup_steps": 2,
        "te_rng_tracker": True,
        "check_for_nan_in_loss_and_grad": False,
    }
    assert "--cuda-graph-impl: set --cuda-graph-impl='local'" in changes
    assert (
        "CUDA graphs are on (TE RNG tracker): set te_rng_tracker=True (on the command line: "
        "pass --te-rng-tracker)" in changes
    )
    assert any(
        "set check_for_nan_in_loss_and_grad=False (on the command line: pass "
        "--no-check-for-nan-in-loss-and-grad)" in c
        for c in changes
    )
    assert len(_messages(caplog)) == len(changes)
    assert find_violations(read_settings(args)) == []


def test_overrides_from_parsed_flags_round_trip():
    args = parser().parse_args(
        ["--cuda_graph_impl", "transformer_engine", "--cuda_graph_scope", "attn, mlp"]
    )
    config = recipe()
    apply_overrides(
        config,
        cuda_graph_impl=args.cuda_graph_impl,
        cuda_graph_scope=args.cuda_graph_scope,
        cuda_graph_warmup_steps=args.cuda_graph_warmup_steps,
    )
    s = read_settings(config)
    assert (s.impl, s.scope, s.warmup_steps) == ("transformer_engine", ("attn", "mlp"), 3)
    assert find_violations(s) == []


def test_a_scope_flag_given_twice_keeps_the_last_and_says_which_was_dropped(caplog):
    p = parser()
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        args = p.parse_args(["--cuda-graph-scope", "attn", "--cuda_graph_scope", "mlp"])
    assert args.cuda_graph_scope == ["mlp"]
    (record,) = [r for r in caplog.records if r.name == "cudagraph_plugin"]
    assert record.getMessage().startswith(
        "--cuda_graph_scope given twice: using the last (mlp); the earlier one (attn) is dropped"
    )
    assert vars(args).keys() == vars(p.parse_args([])).keys()  # nothing added to the args
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        p.parse_args(["--cuda-graph-scope", "attn"])  # the same parser, a new command line
        p.parse_args(["--cuda-graph-scope", "attn", "mlp"])
    assert [r for r in caplog.records if r.name == "cudagraph_plugin"] == []


def test_a_host_namespace_without_weak_references_still_parses():
    args = parser().parse_args(["--cuda-graph-scope", "attn"], namespace=NS())
    assert args.cuda_graph_scope == ["attn"]
