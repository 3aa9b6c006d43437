"""Hydra/OmegaConf configs, as RL trainers built on megatron-core keep them (user trial of
2026-12-05): a whole tree passed as the config, read-only and struct-mode ``DictConfig``,
``???`` values, ``ListConfig`` scopes and buckets, typed structured configs. OmegaConf is
the real one (the test extra installs it); nothing here needs torch beyond the package."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from types import SimpleNamespace as NS
from typing import Any

import omegaconf
import pytest
from omegaconf import OmegaConf
from packaging.version import Version  # (the test extra: without it this file errors, not skips)

from cudagraph_plugin import check_config
from cudagraph_plugin.config import environment, strays
from cudagraph_plugin.config.check import CudaGraphConfigError
from cudagraph_plugin.config.fixes import write_fixes
from cudagraph_plugin.config.strays import DEPTH, stray_fields
from cudagraph_plugin.runtime.plugin import CudaGraphPlugin


@pytest.fixture(autouse=True)
def no_te_no_alloc_conf(monkeypatch):
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "NCCL_GRAPH_REGISTER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(environment, "installed_te_version", lambda: None)


def graphs(**more: Any) -> dict[str, Any]:
    """A Megatron section asking for full-iteration graphs, its NaN checks off."""
    return {
        "cuda_graph_impl": "local",
        "cuda_graph_scope": "full_iteration",
        "check_for_nan_in_loss_and_grad": False,
        **more,
    }


# -- a whole tree passed as the config --------------------------------------------------------


@pytest.mark.parametrize(
    "tree, section",
    [
        ({"actor": {"megatron": graphs()}}, "actor.megatron"),
        ({"policy": {"megatron_cfg": graphs()}}, "policy.megatron_cfg"),  # (NeMo-RL's)
        (
            {"actor_rollout_ref": {"actor": {"megatron": graphs()}}},
            "actor_rollout_ref.actor.megatron",
        ),
    ],
    ids=["two-down", "nemo-rl", "verl-three-down"],
)
def test_graphs_asked_for_in_a_section_nothing_reads_are_a_problem(tree, section):
    """The whole Hydra tree passed: check said OK with impl none, and the run went eagerly
    without a word (its report file not written either)."""
    config = OmegaConf.create(tree)
    checked = check_config(config)
    [problem] = checked.problems
    assert problem.fields == (f"{section}.cuda_graph_impl",) and problem.value == "'local'"
    assert problem.problem.startswith("it asks for CUDA graphs where nothing reads it")
    assert "the run would be eager" in problem.problem
    assert problem.fix.startswith(f"pass the section that holds it, {section}, as the config")
    assert "cuda_graph_impl='none' at the top" in problem.fix
    assert f"{section}.cuda_graph_scope is not read there" in " ".join(checked.notes)
    with pytest.raises(CudaGraphConfigError, match=f"{section}.cuda_graph_impl = 'local'"):
        CudaGraphPlugin.configure(config, None)
    # the section itself is read, and graphs are on
    part = OmegaConf.select(config, section)
    assert check_config(part).ok and check_config(part).settings.impl == "local"
    # graphs said off where the implementation is read: that section may be someone
    # else's, so no problem; but a note (a base YAML's none at the top under a deeper
    # override trained eagerly without a word; review of 2026-12-05)
    config.cuda_graph_impl = "none"
    checked = check_config(config)
    assert checked.ok
    assert (
        f"{section}.cuda_graph_impl is not read there: cuda_graph_impl is read at "
        "cuda_graph_impl or model.cuda_graph_impl, where it turns graphs off (pass the "
        f"section that holds it, {section}, as the config)"
    ) in checked.notes


def test_a_misplaced_or_misspelt_impl_one_section_down_is_a_problem_when_none_is_read():
    checked = check_config({"train": {"cuda_graph_impl": "transformer_engine"}})
    [problem] = checked.problems
    assert problem.fields == ("train.cuda_graph_impl",)
    assert problem.fix.startswith("move it to cuda_graph_impl or model.cuda_graph_impl")
    [problem] = check_config({"model": {"cuda_graphs_impl": "local"}}).problems
    assert problem.fix.startswith("spell it model.cuda_graph_impl")
    # graphs off there, or an implementation read elsewhere: a note, as before
    for quiet in (
        {"train": {"cuda_graph_impl": "none"}},
        {"train": {"cuda_graph_impl": None}},
        {"model": {"cuda_graph_impl": "none"}, "train": {"cuda_graph_impl": "local"}},
    ):
        checked = check_config(quiet)
        assert checked.ok, (quiet, checked.problems)


def test_a_field_handed_out_by_its_parent_is_read_there_and_not_a_stray():
    """Megatron-LM 0.19's GPTModelConfig holds a TransformerConfig in ``transformer`` and
    hands its fields out as its own (``__getattr__``): ``model.transformer.cuda_graph_impl``
    is read as ``model.cuda_graph_impl``. Mirrors that class's proxying."""

    @dataclasses.dataclass
    class Transformer:
        cuda_graph_impl: str = "local"
        cuda_graph_scope: str = "full_iteration"
        check_for_nan_in_loss_and_grad: bool = False

    @dataclasses.dataclass
    class GPTModelConfig:
        transformer: Transformer
        vocab_size: int = 128

        def __getattr__(self, name: str) -> Any:
            if name == "transformer":  # (not set yet: no recursion)
                raise AttributeError(name)
            return getattr(self.transformer, name)

    container = NS(model=GPTModelConfig(Transformer()))
    assert stray_fields(container) == ()
    checked = check_config(container)
    assert checked.ok and checked.settings.impl == "local", checked.problems


def test_graphs_asked_for_deep_down_beside_a_null_implementation_are_a_problem():
    """(review of 2026-12-05: a null at a read place counted as holding the field, so a
    base YAML's ``cuda_graph_impl: null`` hid the deeper request.)"""
    config = OmegaConf.create({"cuda_graph_impl": None, "actor": {"megatron": graphs()}})
    [problem] = check_config(config).problems
    assert problem.fields == ("actor.megatron.cuda_graph_impl",)


def test_only_an_implementation_megatron_core_captures_with_asks_for_graphs():
    """(review of 2026-12-05) A generation server's ``cuda_graph_impl: sglang`` is another
    engine's: a note. A config that turns graphs on by a deprecated flag where it is read
    is refused for that flag, not told it would be eager."""
    rollout = {"seq_length": 128, "rollout": {"cuda_graph_impl": "sglang"}}
    checked = check_config(rollout)
    assert checked.ok and [n for n in checked.notes if "rollout.cuda_graph_impl" in n]
    for impl in ("full_iteration", " Local "):  # (0.18+'s spelling; as the reader reads it)
        [problem] = check_config({"train": {"cuda_graph_impl": impl}}).problems
        assert problem.fields == ("train.cuda_graph_impl",), impl
    deprecated = check_config({"enable_cuda_graph": True, "train": {"cuda_graph_impl": "local"}})
    assert not [p for p in deprecated.problems if "would be eager" in p.problem]


def test_a_mandatory_section_left_unfilled_leaves_the_flat_fields_read():
    """(review of 2026-12-05: ``model: ???`` made every ``model.*`` path a problem, 53 of
    them, and hid the flat fields at the top.)"""
    config = OmegaConf.create({**graphs(), "fp16": True, "model": "???", "optimizer": "???"})
    checked = check_config(config)
    assert checked.settings.impl == "local" and checked.settings.fp16 is True
    assert not [p for p in checked.problems if "MissingMandatoryValue" in p.problem]


def test_the_walk_runs_no_resolver_and_skips_what_it_cannot_list():
    """(review of 2026-12-05: every leaf down to three sections was resolved, running the
    host's OmegaConf resolvers; a mapping whose iteration raises made the check raise.)"""
    calls = []
    # (2.4 renamed register_new_resolver, which now warns; 2.3's register_resolver is the
    # deprecated legacy one)
    newer = Version(omegaconf.__version__) >= Version("2.4")
    register = OmegaConf.register_resolver if newer else OmegaConf.register_new_resolver
    register("mcgraph_track", lambda x: calls.append(x) or x)
    try:
        config = OmegaConf.create({**graphs(), "a": {"b": {"c": {"d": "${mcgraph_track:1}"}}}})
        assert check_config(config).ok and calls == []
    finally:
        OmegaConf.clear_resolver("mcgraph_track")

    class Unlistable(dict):
        def __iter__(self):
            raise RuntimeError("not listable")

    assert check_config({**graphs(), "a": {"b": Unlistable(x=1)}}).ok


def test_the_walk_goes_four_sections_down_and_no_further():
    deep: dict[str, Any] = graphs()
    for level in range(DEPTH):  # the deepest sections the walk looks into
        deep = {f"s{level}": deep}
    [problem] = check_config(deep).problems
    assert problem.fields == ("s3.s2.s1.s0.cuda_graph_impl",) and DEPTH == 4
    assert stray_fields({"s4": deep}) == ()  # (one section further)


def test_the_walk_looks_into_a_bounded_number_of_sections(monkeypatch):
    monkeypatch.setattr(strays, "MAX_SECTIONS", 3)  # (the top and two sections)
    config = {f"s{i}": {"cuda_graph_impl": "local"} for i in range(5)}
    assert [s.path for s in stray_fields(config)] == ["s0.cuda_graph_impl", "s1.cuda_graph_impl"]


def test_the_walk_survives_a_cycle():
    loop: dict[str, Any] = {"actor": {"cuda_graph_impl": "local"}}
    loop["actor"]["back"] = loop
    [stray] = stray_fields(loop)
    assert stray.path == "actor.cuda_graph_impl" and stray.asks_for_graphs


# -- values OmegaConf marks, converts or guards -----------------------------------------------


def test_a_mandatory_value_left_unfilled_is_a_problem_not_an_unset_field():
    """``cuda_graph_impl: ???`` ran eagerly with a fix that cleared a scope the user never
    wrote; ``cuda_graph_buckets: ???`` read as no buckets."""
    for field in ("cuda_graph_impl", "cuda_graph_buckets", "seq_length"):
        config = OmegaConf.create({"model": {**graphs(), field: "???"}})
        checked = check_config(config)
        [problem] = checked.problems
        assert problem.fields == (f"model.{field}",)
        assert problem.problem == (
            f"reading it raised MissingMandatoryValue: Missing mandatory value: model.{field}"
        )
        assert problem.fix.startswith("fill in the value that the config marks mandatory")
        assert not checked.autofixes


def test_a_read_only_dictconfig_is_a_problem_of_the_check_with_every_field_at_once():
    """OmegaConf.set_readonly: check said OK, and the run refused one field per attempt."""
    model = {
        "cuda_graph_impl": "transformer_engine",
        "cuda_graph_scope": ["attn", " mlp"],
        "cuda_graph_warmup_steps": "2",
        "use_te_rng_tracker": False,
    }
    config = OmegaConf.create({"model": model, "rng": {"te_rng_tracker": False}})
    OmegaConf.set_readonly(config, True)
    expected = (
        "model.cuda_graph_scope",
        "model.cuda_graph_warmup_steps",
        "model.use_te_rng_tracker",
        "rng.te_rng_tracker",
    )
    checked = check_config(config, environ={})
    assert tuple(p.fields[0] for p in checked.problems) == expected
    assert all(
        "(DictConfig is read-only (OmegaConf.set_readonly))" in p.problem for p in checked.problems
    )
    # the writes themselves, as a run makes them: every refused field named in one error
    with pytest.raises(CudaGraphConfigError) as refused:
        write_fixes(config, list(check_config(OmegaConf.create(config)).autofixes), environ={})
    assert tuple(v.fields[0] for v in refused.value.violations) == expected
    assert "ReadonlyConfigError: Cannot change read-only config container" in str(refused.value)
    OmegaConf.set_readonly(config, False)
    assert check_config(config, environ={}).ok


def test_every_field_a_config_refuses_is_named_and_nothing_stays_written():
    """Not only OmegaConf's: a host whose setters refuse two fields gets both in one error
    (before: the first, then the next on the following attempt)."""

    class Guarded(NS):
        def __setattr__(self, name: str, value: Any) -> None:
            if name in ("use_te_rng_tracker", "te_rng_tracker") and hasattr(self, name):
                raise AttributeError(f"{name} is managed elsewhere")
            super().__setattr__(name, value)

    model = Guarded(cuda_graph_impl="transformer_engine", cuda_graph_scope="attn, mlp",
                    use_te_rng_tracker=False)  # fmt: skip
    rng = Guarded(te_rng_tracker=False)
    config = NS(model=model, rng=rng)
    fixes = list(check_config(config, environ={}).autofixes)
    assert {f.path for f in fixes} >= {"model.cuda_graph_scope", "rng.te_rng_tracker"}
    with pytest.raises(CudaGraphConfigError) as refused:
        write_fixes(config, fixes, environ={})
    named = [v.fields[0] for v in refused.value.violations]
    assert named == ["model.use_te_rng_tracker", "rng.te_rng_tracker"]
    assert model.cuda_graph_scope == "attn, mlp"  # the one written was put back


def test_a_listconfig_scope_is_respelled_as_a_list_is():
    for scope in (["attn", " mlp"], ["attn,mlp"]):
        config = OmegaConf.create({"model": {"cuda_graph_impl": "transformer_engine",
                                             "cuda_graph_scope": scope}})  # fmt: skip
        [fix] = [f for f in check_config(config, environ={}).autofixes if "scope" in f.path]
        assert fix.value == ["attn", "mlp"]
        write_fixes(config, [fix], environ={})
        assert list(config.model.cuda_graph_scope) == ["attn", "mlp"]
    clean = OmegaConf.create({"model": {"cuda_graph_impl": "transformer_engine",
                                        "cuda_graph_scope": ["attn", "mlp"]}})  # fmt: skip
    assert not [f for f in check_config(clean, environ={}).autofixes if "scope" in f.path]
    # a ListConfig of megatron-core's enum members is its own form, as a list of them is
    # (review of 2026-12-05: respelled, and refused in a read-only config)
    from megatron.core.transformer.enums import CudaGraphScope

    members = OmegaConf.create({"model": {"cuda_graph_impl": "transformer_engine",
                                          "cuda_graph_scope": [CudaGraphScope.attn,
                                                               CudaGraphScope.mlp]}})  # fmt: skip
    assert not [f for f in check_config(members, environ={}).autofixes if "scope" in f.path]


def test_a_list_written_into_a_dictconfig_is_not_said_to_be_converted(caplog):
    """The ListConfig that holds the written list equals it: no "holds ... after the
    write" line (only a value the field's type changed gets one)."""
    config = OmegaConf.create({"model": {"cuda_graph_impl": "transformer_engine",
                                         "cuda_graph_scope": ["attn", " mlp"]}})  # fmt: skip
    [fix] = [f for f in check_config(config, environ={}).autofixes if "scope" in f.path]
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        write_fixes(config, [fix], environ={})
    [said] = [r.getMessage() for r in caplog.records]
    assert said.startswith("auto-fix: set model.cuda_graph_scope=['attn', 'mlp']")
    assert "after the write" not in said


def test_a_write_a_typed_field_converts_back_is_said(caplog):
    """A structured config's ``str`` warm-up takes the int the fix writes and holds "2"
    again: the log said the fix was made."""

    @dataclasses.dataclass
    class Model:
        cuda_graph_impl: str = "local"
        cuda_graph_scope: str = "full_iteration"
        cuda_graph_warmup_steps: str = "2"
        check_for_nan_in_loss_and_grad: bool = False

    config = OmegaConf.structured({"model": Model()})
    checked = check_config(config, environ={})
    [fix] = [f for f in checked.autofixes if "warmup" in f.path]
    # the check says it as the run will, from a write on a copy (review of 2026-12-05)
    [note] = [n for n in checked.notes if "declared type" in n]
    assert note == (
        "model.cuda_graph_warmup_steps: the run's fix writes 2, but the field's declared type "
        "converts it to '2', which megatron-core gets where it reads that field; give the "
        "field the type int"
    )
    assert config.model.cuda_graph_warmup_steps == "2"  # (the check wrote nothing)
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"), warnings.catch_warnings():
        # (OmegaConf 2.4 also warns that it converts: a FutureWarning, 2.3 says nothing)
        warnings.filterwarnings("ignore", "Implicit conversion", FutureWarning)
        write_fixes(config, [fix], environ={})
    [said] = [r.getMessage() for r in caplog.records if "warmup" in r.getMessage()]
    assert said.startswith("auto-fix: set model.cuda_graph_warmup_steps=2 (was '2'")
    assert "but the config holds '2' after the write (its field's type converts" in said
    assert said.endswith("give the field the type int")


def test_listconfig_and_bracketed_string_buckets_are_read():
    for buckets in ([256, 512], "[256, 512]", "256,512", " [256 512] "):
        config = OmegaConf.create({"model": graphs(cuda_graph_buckets=buckets)})
        checked = check_config(config)
        assert checked.ok and checked.settings.buckets == (256, 512), (buckets, checked.problems)
    [problem] = check_config({"model": graphs(cuda_graph_buckets="[256,,512]")}).problems
    assert "an empty length between commas" in problem.problem
