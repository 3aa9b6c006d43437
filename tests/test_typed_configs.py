"""Typed config objects: pydantic models, attrs classes and ml_collections ConfigDicts, as
frameworks built on megatron-core keep their settings (user trial of 2026-12-05). The real
libraries (the test extra installs them): CUDA graph fields in the wrong place are said as
in a dict, the check refuses what the run cannot write, a write the field's type converts
is said before the run, and a field named by its alias is read and written."""

from __future__ import annotations

import logging

import attrs
import pytest
from ml_collections import ConfigDict, FrozenConfigDict
from pydantic import AliasChoices, BaseModel, Field, model_validator
from pydantic import ConfigDict as ModelConfig

from cudagraph_plugin import check_config
from cudagraph_plugin.config import environment
from cudagraph_plugin.config.check import CudaGraphConfigError
from cudagraph_plugin.runtime import ranklog
from cudagraph_plugin.runtime.plugin import CudaGraphPlugin

TE = {"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": "attn,mlp"}


@pytest.fixture(autouse=True)
def no_te_no_alloc_conf(monkeypatch):
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "NCCL_GRAPH_REGISTER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(environment, "installed_te_version", lambda: None)


def configure(config):
    """The run's configure step (its writes), outside a run: nothing shuts it down."""
    ranklog.remove(CudaGraphPlugin.configure(config, None).log_filter)


# -- fields where nothing reads them ----------------------------------------------------------


class _Loose(BaseModel):
    model_config = ModelConfig(extra="allow")


class _Top(BaseModel):
    model: _Loose


@attrs.define
class _Train:
    cuda_graph_impl: str = "local"


@attrs.define
class _Job:
    train: _Train


@pytest.mark.parametrize(
    "config, field, fix",
    [
        (
            _Top(model=_Loose(cuda_graphs_impl="local", cuda_graph_scope="full_iteration")),
            "model.cuda_graphs_impl",
            "spell it model.cuda_graph_impl",
        ),
        (_Job(train=_Train()), "train.cuda_graph_impl", "move it to cuda_graph_impl or model."),
        (
            ConfigDict({"model": {"cuda_graphs_impl": "local"}}),
            "model.cuda_graphs_impl",
            "spell it model.cuda_graph_impl",
        ),
    ],
    ids=["pydantic-extra", "attrs", "configdict"],
)
def test_graphs_asked_for_where_nothing_reads_them_are_a_problem_in_typed_configs(
    config, field, fix
):
    """(The walk looked into dicts, namespaces and dataclasses only: each of these said OK
    with impl none, and the run cleared the scope and trained eagerly.)"""
    checked = check_config(config)
    [problem] = checked.problems
    assert problem.fields == (field,) and problem.fix.startswith(fix), problem
    assert "the run would be eager" in problem.problem


# -- writes the run cannot make, seen by the check --------------------------------------------


class _FrozenModel(BaseModel):
    model_config = ModelConfig(frozen=True)
    cuda_graph_impl: str = "transformer_engine"
    cuda_graph_scope: str = "attn,mlp"
    use_te_rng_tracker: bool = False


@attrs.frozen
class _FrozenAttrs:
    cuda_graph_impl: str = "transformer_engine"
    cuda_graph_scope: str = "attn,mlp"
    use_te_rng_tracker: bool = False


@pytest.mark.parametrize(
    "config, why",
    [
        (_FrozenModel(), "(ValidationError: Instance is frozen)"),
        (_FrozenAttrs(), "(FrozenInstanceError: can't set attribute)"),
        (
            FrozenConfigDict({**TE, "use_te_rng_tracker": False}),
            "(AttributeError: FrozenConfigDict is immutable.",
        ),
    ],
    ids=["pydantic-frozen", "attrs-frozen", "frozen-configdict"],
)
def test_a_fix_a_typed_config_refuses_is_a_problem_of_the_check_as_of_the_run(config, why):
    """(check_config said OK; only the run refused.) Seen on a copy: the config itself is
    not touched by the check."""
    checked = check_config(config, environ={})
    [problem] = checked.problems
    assert problem.fields == ("use_te_rng_tracker",)
    assert f"but the config refuses the write {why}" in problem.problem, problem.problem
    assert config.use_te_rng_tracker is False
    with pytest.raises(CudaGraphConfigError, match="use_te_rng_tracker = False: the run must"):
        CudaGraphPlugin.configure(config, None)


def test_a_refused_scope_fix_offers_the_string_every_container_holds():
    """A FrozenConfigDict turns lists into tuples: "set cuda_graph_scope=['attn', 'mlp']
    yourself" could not be followed; the comma string megatron-core reads can."""
    config = FrozenConfigDict(
        {**TE, "cuda_graph_scope": ["attn", " mlp"], "use_te_rng_tracker": True}
    )
    [problem] = check_config(config, environ={}).problems
    assert problem.fields == ("cuda_graph_scope",)
    assert problem.fix.startswith("set cuda_graph_scope='attn,mlp' yourself before the run")


class _Coercing(BaseModel):
    model_config = ModelConfig(validate_assignment=True)
    cuda_graph_impl: str = "transformer_engine"
    cuda_graph_scope: tuple[str, ...] = ("attn", " mlp")
    use_te_rng_tracker: bool = True


def test_a_fix_the_field_s_type_converts_is_said_by_the_check_and_the_run(caplog):
    """(The run logged ``set cuda_graph_scope=['attn', 'mlp']`` while the field kept a
    tuple, which megatron-core's TransformerConfig asserts against; a tuple compared equal
    to the list written.)"""
    config = _Coercing()
    checked = check_config(config, environ={})
    assert checked.ok
    assert config.cuda_graph_scope == ("attn", " mlp")  # (the check tried it on a copy)
    [note] = [n for n in checked.notes if "declared type" in n]
    assert note.startswith(
        "cuda_graph_scope: the run's fix writes ['attn', 'mlp'], but the field's declared type "
        "converts it to ('attn', 'mlp')"
    )
    assert note.endswith("give the field the type list")
    with caplog.at_level(logging.WARNING, logger="cudagraph_plugin"):
        configure(config)
    said = [r.getMessage() for r in caplog.records if "after the write" in r.getMessage()]
    assert said and "holds ('attn', 'mlp') after the write" in said[0]
    assert config.cuda_graph_scope == ("attn", "mlp")


# -- fields named by their alias --------------------------------------------------------------


class _Aliased(BaseModel):
    impl: str = Field("none", alias="cuda_graph_impl")
    cuda_graph_scope: str = "attn,mlp"
    te_tracker: bool = Field(False, alias="use_te_rng_tracker")


@attrs.define
class _Private:
    _cuda_graph_impl: str = "none"
    cuda_graph_scope: str = "attn,mlp"
    use_te_rng_tracker: bool = False


@pytest.mark.parametrize(
    "make", [lambda: _Aliased(**TE, use_te_rng_tracker=False), lambda: _Private(**TE)]
)
def test_a_field_named_by_its_alias_is_read_and_written(make):
    """A pydantic ``Field(alias="cuda_graph_impl")`` and an attrs ``_cuda_graph_impl``
    (given as ``cuda_graph_impl``) were not read: impl none, a run eager without a word."""
    config = make()
    checked = check_config(config, environ={})
    assert checked.settings.impl == "transformer_engine" and checked.ok, checked.problems
    assert not [n for n in checked.notes if "cuda_graph" in n], checked.notes  # (review)
    configure(config)
    tracker = config.te_tracker if isinstance(config, _Aliased) else config.use_te_rng_tracker
    assert tracker is True  # the auto-fix wrote the aliased field


class _Choices(BaseModel):
    impl: str = Field("none", validation_alias=AliasChoices("cuda_graph_impl", "graph_impl"))
    cuda_graph_scope: str = "full_iteration"
    check_for_nan_in_loss_and_grad: bool = False
    shown: str = Field("x", serialization_alias="cuda_graph_modules")  # (an output name)


def test_an_alias_choice_is_an_input_name_and_a_serialization_alias_is_not():
    """(review of 2026-12-05: an ``AliasChoices`` member was not read, a run eager without a
    word; a serialization alias was read as the field, a false scope problem.)"""
    checked = check_config(_Choices(graph_impl="local"))
    assert checked.settings.impl == "local" and checked.ok, checked.problems


class _Guarded(BaseModel):
    """A cross-field validator: the tracker may be on only once the scope is respelled."""

    model_config = ModelConfig(validate_assignment=True)
    cuda_graph_impl: str = "transformer_engine"
    cuda_graph_scope: str = "attn, mlp"
    use_te_rng_tracker: bool = False

    @model_validator(mode="after")
    def _respelled_first(self):
        if self.use_te_rng_tracker and " " in self.cuda_graph_scope:
            raise ValueError("respell the scope first")
        return self


def test_the_check_tries_the_writes_in_the_run_s_order_on_one_copy():
    """(review of 2026-12-05: each fix was tried alone on a fresh copy, so a validator that
    reads a field an earlier fix writes refused a config the run writes fine.)"""
    config = _Guarded()
    checked = check_config(config, environ={})
    assert checked.ok, checked.problems
    configure(config)
    assert config.cuda_graph_scope == "attn,mlp" and config.use_te_rng_tracker is True


def test_a_refused_scope_clear_offers_none():
    """Graphs off with a scope: the fix clears it to [], which a str-typed field refuses;
    megatron-core reads None as no scope."""
    config = FrozenConfigDict({"cuda_graph_impl": "none", "cuda_graph_scope": "attn"})
    [problem] = check_config(config, environ={}).problems
    assert problem.fix.startswith("set cuda_graph_scope=None yourself before the run")


def test_a_class_without_a_module_is_read_as_an_object():
    """(review of 2026-12-05: ``__module__ = None`` made the check raise.)"""
    odd = type("Odd", (), {"__module__": None, "cuda_graph_impl": "none"})
    assert check_config({"model": odd()}).ok
