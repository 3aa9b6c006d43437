"""``check_config``: one side-effect-free verdict, the same one a run gives."""

from __future__ import annotations

import argparse
import copy
import io
import logging
import subprocess
import sys
from types import SimpleNamespace as NS

import pytest

from cudagraph_plugin import compat
from cudagraph_plugin.cli.check import build_parser, run_check
from cudagraph_plugin.config import environment
from cudagraph_plugin.config.settings import read_settings
from cudagraph_plugin.runtime import ranklog
from cudagraph_plugin.runtime.plugin import CudaGraphPlugin

EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


@pytest.fixture(autouse=True)
def no_te_no_alloc_conf(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)
    monkeypatch.setattr(environment, "installed_te_version", lambda: None)


def recipe(impl="transformer_engine", scope="attn,mlp", **model):
    """A Megatron-Bridge-style recipe whose TE RNG tracker flags are off (auto-fixed)."""
    fields = dict(cuda_graph_impl=impl, cuda_graph_scope=scope, use_te_rng_tracker=False)
    fields.update(model)
    return NS(
        model=NS(**fields),
        rng=NS(te_rng_tracker=False),
        rerun_state_machine=NS(check_for_nan_in_loss=True),
        ddp=NS(check_for_nan_in_grad=False),
    )


def records(caplog):
    return [r for r in caplog.records if r.name == "cudagraph_plugin"]


# -- the public API -------------------------------------------------------------------------------


def test_public_names_from_the_package():
    import cudagraph_plugin
    from cudagraph_plugin import AutoFix, ConfigCheck, CudaGraphConfigError, Violation, check_config

    assert issubclass(CudaGraphConfigError, ValueError)
    assert callable(check_config) and ConfigCheck and AutoFix and Violation
    assert {"check_config", "CudaGraphConfigError", "ConfigCheck"} <= set(cudagraph_plugin.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        cudagraph_plugin.nope  # noqa: B018


def test_importing_the_api_stays_light():
    code = (
        "import sys\n"
        "import cudagraph_plugin\n"
        "light = 'cudagraph_plugin.config.check' not in sys.modules\n"
        "from cudagraph_plugin import check_config\n"
        "check_config({'cuda_graph_impl': 'local', 'cuda_graph_scope': 'full_iteration'})\n"
        "heavy = sorted(m for m in sys.modules\n"
        "               if m.split('.')[0] in ('torch', 'megatron', 'transformer_engine'))\n"
        "print('LIGHT', light, 'HEAVY', heavy)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "LIGHT True HEAVY []" in proc.stdout


# -- side-effect free ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, harness",
    [
        (recipe(), None),
        (recipe("local", "full_iteration"), None),
        (recipe("none", ["attn"]), None),
        (
            argparse.Namespace(
                cuda_graph_impl="local",
                cuda_graph_scope="full_iteration",
                te_rng_tracker=False,
                check_for_nan_in_loss_and_grad=True,
            ),
            None,
        ),
        ({"model": {"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": ["attn"]}}, True),
    ],
    ids=["te", "full-iteration", "impl-none", "megatron-lm-args", "dict"],
)
def test_check_changes_nothing_and_logs_nothing(caplog, config, harness):
    from cudagraph_plugin import check_config

    before = copy.deepcopy(config)
    environ = dict(EXPANDABLE)
    with caplog.at_level(logging.DEBUG):
        result = check_config(config, environ=environ, harness=harness)
    assert config == before
    assert environ == EXPANDABLE
    assert records(caplog) == []
    assert result.autofixes  # each case needs at least one
    assert result.ok is (not result.problems)


def test_autofixes_are_reported_and_the_settings_are_as_the_run_sees_them():
    from cudagraph_plugin import check_config

    config = recipe()
    result = check_config(config, environ=EXPANDABLE)
    assert result.ok, result.problems
    assert [fix.message for fix in result.autofixes] == [
        "CUDA graphs are on (TE RNG tracker): set model.use_te_rng_tracker=True",
        "CUDA graphs are on (TE RNG tracker): set rng.te_rng_tracker=True",
        "set NCCL_GRAPH_REGISTER=0: PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True and "
        "CUDA graphs are on (NCCL is not initialised yet, so it takes effect)",
    ]
    assert [fix.environment for fix in result.autofixes] == [False, False, True]
    assert result.settings.model_te_rng_tracker is True
    assert result.settings.rng_te_rng_tracker is True
    assert read_settings(config).model_te_rng_tracker is False  # still untouched


def test_apply_writes_the_autofixes_and_logs_each(caplog):
    from cudagraph_plugin import check_config

    config = recipe()
    environ = dict(EXPANDABLE)
    result = check_config(config, environ=environ)
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        changes = result.apply(config, environ)
    assert changes == [fix.message for fix in result.autofixes]
    assert config.model.use_te_rng_tracker is True and config.rng.te_rng_tracker is True
    assert environ == {**EXPANDABLE, "NCCL_GRAPH_REGISTER": "0"}
    assert [r.getMessage() for r in records(caplog)] == [
        f"auto-fix: {changes[0]}",
        f"auto-fix: {changes[1]}",
        f"preflight: {changes[2]}",
    ]
    assert read_settings(config) == result.settings
    assert check_config(config, environ=environ).autofixes == ()


@pytest.mark.parametrize(
    "broken",
    [
        dict(cuda_graph_impl="transformer_engin"),  # an impl typo
        dict(cpu_offloading=True),
        dict(num_moe_experts="eight"),
    ],
    ids=["impl-typo", "cpu-offloading", "unreadable-value"],
)
def test_apply_refuses_an_invalid_configuration_and_writes_nothing(caplog, broken):
    from cudagraph_plugin import CudaGraphConfigError, check_config

    config = recipe(**broken)
    before = copy.deepcopy(config)
    result = check_config(config)
    assert not result.ok
    assert result.autofixes  # planned ...
    with caplog.at_level(logging.DEBUG), pytest.raises(CudaGraphConfigError) as info:
        result.apply(config)
    assert config == before  # ... but not written
    assert records(caplog) == []
    assert list(info.value.violations) == list(result.problems)


def test_notes_say_what_is_not_checked_here():
    from cudagraph_plugin import check_config

    # (megatron-core takes delayed weight gradients only with expert-parallel overlap)
    wgrad = dict(
        scope="attn",
        delay_wgrad_compute=True,
        overlap_moe_expert_parallel_comm=True,
        gradient_accumulation_fusion=True,
        add_bias_linear=False,
    )
    result = check_config(recipe(**wgrad))
    assert result.ok
    assert any("Transformer Engine >= 2.12.0: not checked here" in note for note in result.notes)
    assert any(note.startswith("a run needs Transformer Engine") for note in result.notes)
    result = check_config(
        recipe(**wgrad),
        te_version="2.11",
        te_available=True,
    )
    assert result.notes == ()
    assert "Transformer Engine >= 2.12.0 (given: 2.11)" in result.problems[0].problem


def test_harness_autofix_only_for_command_lines_by_default():
    from cudagraph_plugin import check_config

    fixes = check_config(recipe("local", "full_iteration")).autofixes
    assert not any(fix.setting == "check_for_nan_in_loss" for fix in fixes)
    fixes = check_config(recipe("local", "full_iteration"), harness=True).autofixes
    assert [fix.path for fix in fixes if fix.setting == "check_for_nan_in_loss"] == [
        "rerun_state_machine.check_for_nan_in_loss"
    ]


# -- the run gives the same verdict --------------------------------------------------------------


def test_the_run_leaves_an_invalid_configuration_untouched():
    # Before: an impl typo still flipped both TE RNG tracker flags, then validation failed.
    config = recipe("transformer_engin")
    with pytest.raises(ValueError, match="unknown CUDA graph implementation 'transformer_engin'"):
        CudaGraphPlugin.configure(config, None)
    assert config.model.use_te_rng_tracker is False
    assert config.rng.te_rng_tracker is False


VERDICT_CASES = [
    recipe(),
    recipe("local", "full_iteration"),
    recipe("local", "full_iteration", cpu_offloading=True, num_moe_experts="x"),
    recipe(scope="attn,,mlp"),
    recipe(scope="full,attn"),
    recipe(num_moe_experts="8", moe_layer_freq="([1]*4)", cuda_graph_scope="attn,mlp"),
    recipe(recompute_granularity="full", recompute_num_layers="1", cuda_graph_scope="mlp"),
    argparse.Namespace(
        cuda_graph_impl="local",
        cuda_graph_scope="full_iteration",
        te_rng_tracker=False,
        check_for_nan_in_loss_and_grad=True,
    ),
]


@pytest.mark.parametrize("config", VERDICT_CASES, ids=range(len(VERDICT_CASES)))
def test_check_and_run_give_the_same_verdict(monkeypatch, config):
    from cudagraph_plugin import CudaGraphConfigError, check_config

    monkeypatch.setattr(compat, "cuda_available", lambda: False)
    result = check_config(copy.deepcopy(config))
    try:
        plugin = CudaGraphPlugin.configure(config, None)
    except CudaGraphConfigError as exc:
        assert not result.ok
        assert str(exc) == str(CudaGraphConfigError(list(result.problems)))
    else:
        ranklog.remove(plugin.log_filter)  # a plugin outside a run is never shut down
        assert result.ok, result.problems
        assert plugin.settings == result.settings
        assert read_settings(config) == result.settings


@pytest.mark.parametrize(
    "argv",
    [
        ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn", "mlp"],
        ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"],
        [
            "--cuda-graph-impl",
            "transformer_engine",
            "--cuda-graph-scope",
            "mlp",
            "--num-experts",
            "8",
            "--recompute-granularity",
            "full",
            "--moe-layer-freq",
            "x",
        ],
    ],
)
def test_the_check_command_prints_check_configs_verdict(argv):
    from cudagraph_plugin import CudaGraphConfigError, check_config

    out = io.StringIO()
    code = run_check(argv, out=out)
    result = check_config(build_parser().parse_args(argv), environ={}, te_available=None)
    assert code == (0 if result.ok else 1)
    label = "auto-fix" if result.ok else "auto-fix (once the problems are fixed)"
    for fix in result.autofixes:
        assert f"  {label}: {fix.message}\n" in out.getvalue()
    if not result.ok:
        assert str(CudaGraphConfigError(list(result.problems))) in out.getvalue()


@pytest.mark.parametrize(
    "field, given, written",
    [
        ("cuda_graph_scope", "attn, mlp", "attn,mlp"),
        ("cuda_graph_scope", ("attn", "mlp"), ["attn", "mlp"]),
        ("cuda_graph_scope", ("attn", " mlp"), ["attn", "mlp"]),
        ("cuda_graph_scope", ["attn", " mlp"], ["attn", "mlp"]),
        ("cuda_graph_scope", ["attn,mlp"], ["attn", "mlp"]),
        ("cuda_graph_impl", " transformer_engine ", "transformer_engine"),
    ],
    ids=["spaces", "tuple", "tuple-spaces", "list-spaces", "list-joined", "impl-spaces"],
)
def test_a_spelling_only_the_plugin_reads_is_written_in_megatron_core_s(
    caplog, field, given, written
):
    """A provider's own impl/scope fields are parsed by megatron-core, which splits the scope
    on commas alone (``KeyError: ' mlp'``) and asserts a string or a list: the plugin, which
    reads the other spellings too, writes megatron-core's back and says so."""
    from megatron.core.transformer import TransformerConfig

    from cudagraph_plugin import check_config

    config = recipe(**{field: given})
    result = check_config(config)
    assert result.ok and (result.settings.impl, result.settings.scope) == (
        "transformer_engine",
        ("attn", "mlp"),
    )
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        result.apply(config)
    assert getattr(config.model, field) == written
    assert f"set model.{field}={written!r} (was {given!r}" in caplog.text
    mcore = dict(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True)
    fields = {name: getattr(config.model, name) for name in ("cuda_graph_impl", "cuda_graph_scope")}
    TransformerConfig(**mcore, **fields, use_te_rng_tracker=True)  # parses what was written
    with pytest.raises((KeyError, AssertionError)):  # ... and not what was given
        TransformerConfig(**mcore, **{**fields, field: given}, use_te_rng_tracker=True)


def test_respelling_keeps_the_settings_read_from_megatron_core_0_18_s_impl():
    from cudagraph_plugin import check_config

    config = recipe(impl=" full_iteration ", scope=None)
    result = check_config(config)
    assert (result.settings.impl, result.settings.scope) == ("local", ("full_iteration",))
    assert [(fix.path, fix.value) for fix in result.autofixes if fix.setting == "impl"] == [
        ("model.cuda_graph_impl", "full_iteration")
    ]


class _Raises:
    """A host config part whose property raises when read (a provider not built yet)."""

    def __init__(self, name: str, **fields) -> None:
        self._name = name
        self.__dict__.update(fields)

    def __getattr__(self, name: str):
        if name == self._name:
            raise RuntimeError(f"{name} is not built yet")
        raise AttributeError(name)


@pytest.mark.parametrize(
    "field, shown",
    [
        ("num_moe_experts", "model.num_moe_experts"),
        ("cuda_graph_scope", "model.cuda_graph_scope"),
        ("use_te_rng_tracker", "model.use_te_rng_tracker"),
    ],
)
def test_a_field_whose_reading_raises_is_a_listed_problem_and_nothing_is_written(
    caplog, field, shown
):
    """(review of 2026-12-04: a host property that raised went through ``check_config`` and
    the run's configure as a bare traceback.) It is one more listed problem, naming the field
    and the error; the run refuses and writes nothing."""
    from cudagraph_plugin import check_config

    fields = dict(
        cuda_graph_impl="local", cuda_graph_scope="full_iteration", use_te_rng_tracker=False
    )
    fields.pop(field, None)
    config = recipe()
    config.model = _Raises(field, **fields)
    result = check_config(config)
    [problem] = [p for p in result.problems if "reading it raised" in p.problem]
    assert problem.fields == (shown,)
    assert problem.problem == f"reading it raised RuntimeError: {field} is not built yet"
    assert "a property must not raise when it is read" in problem.fix
    assert not result.ok and not result.advice
    with pytest.raises(ValueError, match=f"{shown} = <unreadable>: reading it raised"):
        CudaGraphPlugin.configure(config, None)
    assert config.rng.te_rng_tracker is False  # nothing written


def test_a_section_whose_reading_raises_is_one_problem_naming_the_section():
    """(user trial, 2026-12-05: a ``model`` property raising gave one problem per setting
    read through it, about fifty, each repeating the error.)"""
    from cudagraph_plugin import check_config

    class Host:
        cuda_graph_impl = "local"

        @property
        def model(self):
            raise ValueError("model section not built yet")

    [problem] = check_config(Host()).problems
    assert problem.fields == ("model",)
    assert problem.problem == "reading it raised ValueError: model section not built yet"


# -- config objects of other shapes (review of 2026-12-05, a config-object user) ------------


def test_an_optimizer_section_without_an_optimizer_name_is_not_taken_for_the_name():
    """``optimizer`` is read at ``optimizer.optimizer``, then at the top: a section without
    the field was itself refused, "optimizer = {'lr': 0.0003}: not an optimizer name"."""
    from cudagraph_plugin import check_config

    model = {"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": "attn"}
    result = check_config({"model": model, "optimizer": {"lr": 3e-4}})
    assert result.problems == () and result.settings.optimizer == "adam"
    assert check_config({"model": model, "optimizer": NS(lr=3e-4)}).problems == ()
    named = check_config({"model": model, "optimizer": "sgd"})  # a flat config's name
    assert named.settings.optimizer == "sgd"


def test_a_setting_given_two_values_in_two_sections_is_said():
    """The first path was read without a word; megatron-core picks the loss scaler from
    OptimizerConfig.fp16, which the check did not read."""
    from cudagraph_plugin import check_config

    model = {"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration", "fp16": False}
    result = check_config({"model": model, "optimizer": {"fp16": True}})
    assert [n for n in result.notes if "disagree" in n] == [
        "model.fp16=False and optimizer.fp16=True disagree: the check reads the first, while "
        "megatron-core reads each where the part it builds is given it (OptimizerConfig's "
        "fp16 picks the loss scaler, say). Make them agree"
    ]
    agreeing = check_config({"model": model, "optimizer": {"fp16": False}})
    assert not [n for n in agreeing.notes if "disagree" in n]


@pytest.mark.parametrize(
    "top, model, fields, values, by_mcore",
    [
        (
            dict(cuda_graph_impl="local", cuda_graph_scope="full_iteration"),
            dict(cuda_graph_impl="none"),
            ("model.cuda_graph_impl", "cuda_graph_impl"),
            "('none', 'local')",
            True,
        ),
        (
            dict(cuda_graph_scope="attn"),
            dict(cuda_graph_impl="local", cuda_graph_scope="full_iteration"),
            ("model.cuda_graph_scope", "cuda_graph_scope"),
            "('full_iteration', 'attn')",
            True,
        ),
        (
            dict(cuda_graph_buckets=[128, 1024]),
            dict(
                cuda_graph_impl="local",
                cuda_graph_scope="full_iteration",
                cuda_graph_buckets="256,512",
            ),
            ("model.cuda_graph_buckets", "cuda_graph_buckets"),
            "((256, 512), [128, 1024])",
            False,
        ),
    ],
    ids=["impl", "scope", "buckets"],
)
def test_a_cuda_graph_setting_given_two_values_in_two_places_is_a_problem(
    top, model, fields, values, by_mcore
):
    """Only one place is read: a top-level cuda_graph_impl=local beside a nested config's
    model.cuda_graph_impl='none' ran eagerly, with a note only (user trial, 2026-12-05)."""
    from cudagraph_plugin import check_config

    result = check_config({**top, "model": model})
    [problem] = result.problems
    assert (problem.fields, problem.value) == (fields, values)
    assert f"{fields[0]} is the one read" in problem.text
    assert ("by megatron-core too" in problem.text) is by_mcore
    assert problem.fix.startswith(f"give it once: set {fields[0]}=")
    assert not [n for n in result.notes if "disagree" in n]
    # the same value in both places is no such problem
    agreeing = {**top, "model": {**model, **top}}
    assert not [p for p in check_config(agreeing).problems if "given twice" in p.text]


def test_megatron_core_s_default_scope_in_the_other_place_is_no_disagreement():
    from cudagraph_plugin import check_config

    model = {"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration"}
    for default in ([], "full", None):  # (megatron-core's defaults: 0.16's "full", 0.19's [])
        assert check_config({"cuda_graph_scope": default, "model": model}).problems == ()


def test_the_plugin_s_own_fields_are_read_beside_the_model_s_cuda_graph_fields():
    """They were read at the top only: under ``model.`` they were ignored without a word."""
    from cudagraph_plugin import check_config

    model = {
        "cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration",
        "cuda_graph_fallback_on_slowdown": "maybe", "cuda_graph_baseline_steps": 4,
    }  # fmt: skip
    result = check_config({"model": model})
    assert [(p.fields, p.problem) for p in result.problems] == [
        (("model.cuda_graph_fallback_on_slowdown",), "not a boolean")
    ]
    assert result.settings.baseline_steps == 4


def test_auto_fixes_are_written_all_or_nothing():
    """A field the config refuses (a frozen section) raised FrozenInstanceError after the
    fixes before it were written and logged: the config was left half-changed, although a
    configuration that fails is left as it was."""
    from cudagraph_plugin import CudaGraphConfigError, check_config

    class GuardedRng:  # (a section whose setter refuses: the check cannot see that coming)
        @property
        def te_rng_tracker(self) -> bool:
            return False

        @te_rng_tracker.setter
        def te_rng_tracker(self, value: bool) -> None:
            raise AttributeError("read-only: set by the launcher")

    config = NS(
        model=NS(cuda_graph_impl="transformer_engine", cuda_graph_scope="attn, mlp"),
        rng=GuardedRng(),
    )
    checked = check_config(config, environ={})
    assert checked.ok and len(checked.autofixes) >= 2
    environ: dict[str, str] = {}
    with pytest.raises(CudaGraphConfigError) as refused:
        checked.apply(config, environ)
    assert (config.model.cuda_graph_scope, vars(config.model).get("use_te_rng_tracker")) == (
        "attn, mlp",
        None,
    )
    [problem] = refused.value.violations
    assert problem.fields == ("rng.te_rng_tracker",)
    assert "but the config refuses the write (AttributeError: read-only" in problem.problem
    assert problem.fix.startswith("set rng.te_rng_tracker=True yourself before the run")


def test_a_frozen_section_the_run_must_write_is_a_problem_of_the_check():
    """(user trial, 2026-12-05: check_config said OK for a frozen dataclass whose fields the
    run must set; only the run's apply refused it.) A read-only mapping alike."""
    import dataclasses
    from types import MappingProxyType

    from cudagraph_plugin import check_config

    @dataclasses.dataclass(frozen=True)
    class FrozenRng:
        te_rng_tracker: bool = False

    model = {"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": "attn,mlp"}
    checked = check_config(NS(model=NS(**model), rng=FrozenRng()), environ={})
    [problem] = checked.problems
    assert problem.fields == ("rng.te_rng_tracker",) and problem.value == "False"
    assert "but the config refuses the write (FrozenRng is a frozen dataclass)" in problem.problem
    assert problem.fix.startswith("set rng.te_rng_tracker=True yourself before the run")
    flat = MappingProxyType({**model, "use_te_rng_tracker": False})
    [problem] = check_config(flat, environ={}).problems
    assert "(mappingproxy is a read-only mapping)" in problem.problem
    # a section that can be written, or one holding the value already, is no problem
    assert check_config(NS(model=NS(**model), rng=NS(te_rng_tracker=False))).ok
    assert check_config(NS(model=NS(**model), rng=FrozenRng(te_rng_tracker=True))).ok
    # an attribute of a frozen dataclass's subclass that is no field of it can be set (review
    # of 2026-12-05: refused by the check, written fine by the run)

    @dataclasses.dataclass(frozen=True)
    class FrozenModel:
        cuda_graph_impl: str = "transformer_engine"
        cuda_graph_scope: str = "attn,mlp"

    class Host(FrozenModel):
        def __init__(self) -> None:
            super().__init__()
            object.__setattr__(self, "use_te_rng_tracker", False)

    host = Host()
    checked = check_config(host, environ={})
    assert checked.ok, checked.problems
    checked.apply(host, environ={})
    assert host.use_te_rng_tracker is True


def test_an_auto_fix_into_any_mutable_mapping_is_written_as_an_item():
    """(review of 2026-12-05: a UserDict got the fix as an attribute, the item unchanged,
    while the log said it was written.)"""
    from collections import UserDict

    from cudagraph_plugin import check_config

    config = UserDict(
        cuda_graph_impl="local", cuda_graph_scope="full_iteration", use_te_rng_tracker=False
    )
    check_config(config, environ={}).apply(config, environ={})
    assert config["use_te_rng_tracker"] is True and "use_te_rng_tracker" not in vars(config)


def test_a_report_path_that_is_not_a_path_is_a_problem_of_the_check():
    """``cuda_graph_report_json=True`` passed the check, then failed when the run started,
    "TypeError: expected str, bytes or os.PathLike object, not bool"."""
    from pathlib import Path

    from cudagraph_plugin import check_config

    graphs = {"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration"}
    [problem] = check_config({**graphs, "cuda_graph_report_json": True}).problems
    assert (problem.fields, problem.value, problem.problem) == (
        ("cuda_graph_report_json",),
        "True",
        "not a file path (bool)",
    )
    assert check_config({**graphs, "cuda_graph_report_json": Path("r.json")}).ok


@pytest.mark.parametrize("path", ["r\0.json", "reports/\0/r.json"])
def test_a_report_path_with_a_nul_is_a_problem_of_the_check(path, tmp_path, monkeypatch):
    """A NUL passed the writability check (``Path.exists`` says False for it) and the run
    trained to its end, then the JSON's write raised ``ValueError: embedded null byte``."""
    from cudagraph_plugin import check_config

    monkeypatch.chdir(tmp_path)
    graphs = {"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration"}
    [problem] = check_config({**graphs, "cuda_graph_report_json": path}).problems
    assert problem.fields == ("cuda_graph_report_json",)
    assert problem.problem == "a file path with a NUL character in it"


@pytest.mark.parametrize("spelling", ["tuple of members", "mixed list", "set"])
def test_scope_forms_megatron_core_refuses_are_rewritten_and_then_build(spelling):
    """A tuple of enum members, a list mixing members and names, a set: the check said OK
    and planned no rewrite, and megatron-core's TransformerConfig asserted on each ("must
    be a string that can be converted to a list of CudaGraphScope"). A string warm-up was
    left a string, which megatron-core's TE helper computes with (TypeError)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import CudaGraphScope

    from cudagraph_plugin import check_config

    attn, mlp = CudaGraphScope.attn, CudaGraphScope.mlp
    scope = {"tuple of members": (attn, mlp), "mixed list": [attn, "mlp"], "set": {"attn"}}
    model = {
        "cuda_graph_impl": "transformer_engine", "cuda_graph_scope": scope[spelling],
        "cuda_graph_warmup_steps": "5",
    }  # fmt: skip

    def build():  # (megatron-core parses the scope whatever the impl; local needs no TE)
        fields = dict(model, cuda_graph_impl="local")
        return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **fields)

    with pytest.raises(AssertionError, match="cuda_graph_scope must be"):
        build()
    config = {"model": model}
    check_config(config, te_version="2.12", environ={}).apply(config, environ={})
    assert model["cuda_graph_warmup_steps"] == 5 and isinstance(model["cuda_graph_scope"], list)
    built = build()
    assert set(built.cuda_graph_scope) <= {attn, mlp} and built.cuda_graph_warmup_steps == 5


def test_with_graphs_off_buckets_and_the_baseline_are_said_and_change_nothing():
    """(review of 2026-12-05: an eager baseline of a bucketed recipe was refused, "buckets
    are full-iteration graphs", beside fallback's note, which was a problem with buckets
    too; and --cuda-graph-baseline-steps 5 moved the warm-up answer to 6, the post-warmup
    step of other plugins with it, in a run that captures nothing.)"""
    from cudagraph_plugin import check_config

    model = {"cuda_graph_impl": "none", "cuda_graph_warmup_steps": 0, "cuda_graph_buckets": "8,16"}
    config = {"model": model, "cuda_graph_baseline_steps": 5, "cuda_graph_fallback_on_slowdown": 1}
    result = check_config(config)
    assert result.ok and result.settings.warmup_steps == 0
    assert [n.split(" has ")[0] for n in result.notes if "nothing to do" in n] == [
        "model.cuda_graph_buckets",
        "cuda_graph_fallback_on_slowdown",
        "cuda_graph_baseline_steps",
    ]
    graphs_on = dict(model, cuda_graph_impl="local", cuda_graph_scope="full_iteration")
    assert (
        check_config({"model": graphs_on, "cuda_graph_baseline_steps": 5}).settings.warmup_steps
        == 6
    )


def test_second_review_of_the_config_object_changes():
    """(review of this session's second batch) An int or None in a scope tuple crashed the
    check in the respelling (AttributeError) where it is a listed problem; a set was
    rewritten in hash order; a list and a tuple of the same items, or a path and its
    string, were said to disagree; ``cuda_graph_report_json: false`` (a YAML "off") was
    refused."""
    from pathlib import Path

    from cudagraph_plugin import check_config

    for scope in (("attn", 3), ["attn", None]):
        refused = check_config(NS(cuda_graph_impl="transformer_engine", cuda_graph_scope=scope))
        assert not refused.ok
    fixed = check_config({"model": {"cuda_graph_impl": "transformer_engine",
                                    "cuda_graph_scope": {"mlp", "attn"}}}, environ={})  # fmt: skip
    [respelled] = [f for f in fixed.autofixes if f.path == "model.cuda_graph_scope"]
    assert respelled.value == ["attn", "mlp"]
    alike = {
        "model": {"moe_layer_freq": [1, 0], "cuda_graph_report_json": "a.json"},
        "moe_layer_freq": (1, 0), "cuda_graph_report_json": Path("a.json"),
    }  # fmt: skip
    assert not [n for n in check_config(alike).notes if "disagree" in n]
    off = check_config({"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration",
                        "cuda_graph_report_json": False})  # fmt: skip
    assert off.ok and not off.settings.report_json


@pytest.mark.parametrize(
    "config, said",
    [
        (
            {"model": {"cuda_graph_impl": "none"}, "cuda_graph_bucket": [128, 1024]},
            [
                "cuda_graph_bucket is not a field the CUDA graph checks read (did you mean "
                "cuda_graph_buckets?)"
            ],
        ),
        (
            # (the implementation said where it is read: where none is, graphs asked for
            # elsewhere are a problem, tests/test_omegaconf_configs.py)
            {
                "model": {"cuda_graph_impl": "none", "cuda_graphs_impl": "local"},
                "train": {"cuda_graph_impl": "local"},
            },
            [
                "model.cuda_graphs_impl is not a field the CUDA graph checks read (did you "
                "mean model.cuda_graph_impl?)",
                "train.cuda_graph_impl is not read there: cuda_graph_impl is read at "
                "cuda_graph_impl or model.cuda_graph_impl",
            ],
        ),
        (
            {"model": {"optimizer_cuda_graph": True}, "train": {"cuda_graph_buckets_x": 1}},
            [
                "model.optimizer_cuda_graph is not read there: optimizer_cuda_graph is read at "
                "optimizer.optimizer_cuda_graph or optimizer_cuda_graph",
                "train.cuda_graph_buckets_x is not a field the CUDA graph checks read (did "
                "you mean cuda_graph_buckets or model.cuda_graph_buckets?)",
            ],
        ),
    ],
    ids=["misspelt-at-the-top", "misspelt-and-misplaced", "misplaced"],
)
def test_cuda_graph_fields_where_nothing_reads_them_are_said(config, said):
    """(user trial, 2026-12-05: train.cuda_graph_impl, model.cuda_graphs_impl,
    model.optimizer_cuda_graph and cuda_graph_bucket were ignored without a word, the run
    eager or without the feature.)"""
    from cudagraph_plugin import check_config

    notes = check_config(config).notes
    assert [n for n in notes if " read there: " in n or "not a field the" in n] == said


def test_megatron_core_s_own_cuda_graph_fields_are_not_taken_for_strays():
    """A TransformerConfig, OptimizerConfig and DDP config hold CUDA graph fields the checks
    do not read (cuda_graph_use_single_mempool, ...): no note for them, flat or nested."""
    import dataclasses

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    from cudagraph_plugin.config.strays import stray_fields

    def names(cls: type) -> dict[str, None]:
        return {f.name: None for f in dataclasses.fields(cls) if "cuda_graph" in f.name}

    sections = {
        "model": names(TransformerConfig),
        "optimizer": names(OptimizerConfig),
        "ddp": names(DistributedDataParallelConfig),
    }
    assert "cuda_graph_use_single_mempool" in sections["model"]  # (what the test is about)
    assert stray_fields(sections) == ()
    assert stray_fields({k: v for section in sections.values() for k, v in section.items()}) == ()
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    assert stray_fields(config) == ()
