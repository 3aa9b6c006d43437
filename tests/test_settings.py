"""Reading the CUDA-graph settings from every config shape a host may have (duck-typed)."""

from __future__ import annotations

import argparse
import enum
import warnings
from types import SimpleNamespace as NS

import pytest
from packaging.version import Version

from cudagraph_plugin import compat
from cudagraph_plugin.compat import generation
from cudagraph_plugin.config import environment, vocabulary
from cudagraph_plugin.config.fields import (
    MISSING,
    assign,
    display_name,
    existing_paths,
    lookup,
    resolve,
)
from cudagraph_plugin.config.settings import Settings, read_settings
from cudagraph_plugin.config.values import parse_scope
from cudagraph_plugin.config.vocabulary import DEFAULT_WARMUP_STEPS, SCOPES


class FakeCudaGraphModule(enum.Enum):
    """megatron-core 0.18+'s ``CudaGraphModule`` (not installed here: same member names)."""

    attn = 1
    mlp = 2
    moe = 3
    moe_router = 4
    moe_preprocess = 5
    mamba = 6


def bridge_config(**model):
    """A Megatron-Bridge ``ConfigContainer``-shaped tree."""
    fields = dict(
        cuda_graph_impl="none",
        cuda_graph_scope="full",
        cuda_graph_warmup_steps=3,
        use_te_rng_tracker=False,
        num_moe_experts=None,
        seq_length=4096,
    )
    fields.update(model)
    return NS(
        model=NS(**fields),
        rng=NS(te_rng_tracker=False),
        rerun_state_machine=NS(check_for_nan_in_loss=True),
        ddp=NS(check_for_nan_in_grad=False),
        train=NS(micro_batch_size=2),
        dataset=NS(sequence_length=8192),
    )


def mlm_args(**kwargs):
    """A Megatron-LM ``args`` namespace (its flag names)."""
    fields = dict(
        cuda_graph_impl="none",
        cuda_graph_scope=None,
        cuda_graph_warmup_steps=3,
        te_rng_tracker=False,
        num_experts=None,
        check_for_nan_in_loss_and_grad=True,
        seq_length=2048,
        micro_batch_size=4,
    )
    fields.update(kwargs)
    return argparse.Namespace(**fields)


def transformer_config(**kwargs):
    from megatron.core.transformer import TransformerConfig

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True)
    base.update(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerConfig(**base)


# -- the lookup primitives --------------------------------------------------------------------


def test_resolve_walks_attributes_and_mapping_items():
    cfg = {"model": NS(inner={"x": 5})}
    assert resolve(cfg, "model.inner.x") == 5
    assert resolve(cfg, "model.inner.y") is MISSING
    assert resolve(cfg, "nope.x") is MISSING
    # A present None is a value, not MISSING.
    assert resolve(NS(a=None), "a") is None


def test_assign_sets_attributes_and_dict_items():
    cfg = {"model": NS(x=1), "flat": 0}
    assign(cfg, "model.x", 2)
    assign(cfg, "flat", 3)
    nested = NS(model={"y": 1})
    assign(nested, "model.y", 4)
    assert cfg["model"].x == 2 and cfg["flat"] == 3 and nested.model["y"] == 4


def test_lookup_first_path_wins_and_none_skips_only_for_graph_fields():
    # Bridge puts seq_length on model and on dataset: model wins.
    value, path = lookup(bridge_config(), "seq_length")
    assert (value, path) == (4096, "model.seq_length")
    # A None impl means "not set" and falls through to the flat field.
    cfg = NS(model=NS(cuda_graph_impl=None), cuda_graph_impl="local")
    assert lookup(cfg, "impl") == ("local", "cuda_graph_impl")
    # For other settings None is a real value (e.g. no capacity factor).
    cfg = NS(model=NS(moe_expert_capacity_factor=None), moe_expert_capacity_factor=1.0)
    assert lookup(cfg, "moe_expert_capacity_factor") == (None, "model.moe_expert_capacity_factor")
    assert lookup(NS(), "impl") == (None, None)


def test_existing_paths_lists_every_place_of_a_setting():
    cfg = bridge_config()
    assert existing_paths(cfg, "model_te_rng_tracker") == ["model.use_te_rng_tracker"]
    assert existing_paths(cfg, "rng_te_rng_tracker") == ["rng.te_rng_tracker"]
    assert existing_paths(mlm_args(), "rng_te_rng_tracker") == ["te_rng_tracker"]
    assert existing_paths(mlm_args(), "model_te_rng_tracker") == []


def test_display_name_is_the_flag_for_a_namespace_and_the_path_otherwise():
    assert display_name(argparse.Namespace(), "cuda_graph_scope") == "--cuda-graph-scope"
    assert display_name(NS(), "cuda_graph_scope") == "cuda_graph_scope"
    assert display_name({}, "model.cuda_graph_scope") == "model.cuda_graph_scope"
    assert display_name(argparse.Namespace(), "model.x_y") == "model.x_y"


# -- scope parsing ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, ()),
        ("", ()),
        ([], ()),
        ("attn", ("attn",)),
        ("attn,mlp", ("attn", "mlp")),
        (" attn , mlp ", ("attn", "mlp")),
        # Empty names (doubled, leading, trailing commas) are kept for validation to report.
        (" attn , mlp ,", ("attn", "mlp", "")),
        ("attn,,mlp", ("attn", "", "mlp")),
        (",attn", ("", "attn")),
        (["attn", ""], ("attn", "")),
        (["attn,mlp", "moe_router"], ("attn", "mlp", "moe_router")),
        (["attn", " moe_router ", "moe_preprocess"], ("attn", "moe_router", "moe_preprocess")),
        (("mlp",), ("mlp",)),
        # Unknown and duplicated names are kept for validation to report.
        ("attn,bogus,attn", ("attn", "bogus", "attn")),
        ("full", ("full",)),
    ],
)
def test_parse_scope_strings_and_lists(value, expected):
    assert parse_scope(value) == expected


@pytest.mark.parametrize("name", SCOPES)
def test_parse_scope_every_valid_name_in_every_spelling(name):
    from megatron.core.transformer.enums import CudaGraphScope

    assert parse_scope(name) == (name,)
    assert parse_scope([name]) == (name,)
    assert parse_scope(CudaGraphScope[name]) == (name,)
    assert parse_scope([CudaGraphScope[name]]) == (name,)
    if name != "full_iteration":  # 0.18+ has no full_iteration module
        assert parse_scope([FakeCudaGraphModule[name]]) == (name,)


def test_parse_scope_mixed_real_enum_fake_enum_and_strings():
    from megatron.core.transformer.enums import CudaGraphScope

    value = [CudaGraphScope.attn, FakeCudaGraphModule.moe_router, "moe_preprocess"]
    assert parse_scope(value) == ("attn", "moe_router", "moe_preprocess")


# -- Megatron-Bridge-style nested config ----------------------------------------------------------


def test_bridge_nested_config_reads_model_rng_rerun_ddp_train_dataset():
    cfg = bridge_config(
        cuda_graph_impl="transformer_engine",
        cuda_graph_scope="attn, mlp",
        cuda_graph_warmup_steps=5,
        use_te_rng_tracker=True,
    )
    s = read_settings(cfg)
    assert s.impl == "transformer_engine"
    assert s.scope == ("attn", "mlp")
    assert s.warmup_steps == 5
    assert s.model_te_rng_tracker is True
    assert s.rng_te_rng_tracker is False
    assert s.check_for_nan_in_loss is True
    assert s.check_for_nan_in_grad is False
    assert s.seq_length == 4096
    assert s.micro_batch_size == 2
    assert s.enabled and not s.full_iteration and not s.is_moe
    assert s.sources["impl"] == "model.cuda_graph_impl"
    assert s.sources["scope"] == "model.cuda_graph_scope"
    assert s.sources["rng_te_rng_tracker"] == "rng.te_rng_tracker"
    assert s.sources["check_for_nan_in_loss"] == "rerun_state_machine.check_for_nan_in_loss"
    assert s.sources["check_for_nan_in_grad"] == "ddp.check_for_nan_in_grad"
    assert s.sources["micro_batch_size"] == "train.micro_batch_size"
    assert s.field("scope") == "model.cuda_graph_scope"
    assert s.field("model_te_rng_tracker") == "model.use_te_rng_tracker"


def test_bridge_seq_length_falls_back_to_dataset_sequence_length():
    cfg = bridge_config()
    del cfg.model.seq_length
    s = read_settings(cfg)
    assert s.seq_length == 8192
    assert s.sources["seq_length"] == "dataset.sequence_length"


def test_nested_dict_config_reads_the_same_as_namespaces():
    cfg = {
        "model": {
            "cuda_graph_impl": "local",
            "cuda_graph_scope": ["full_iteration"],
            "cuda_graph_warmup_steps": 2,
            "use_te_rng_tracker": True,
            "num_moe_experts": 8,
            "moe_expert_capacity_factor": 1.0,
            "moe_pad_expert_input_to_capacity": True,
        },
        "rng": {"te_rng_tracker": True},
        "rerun_state_machine": {"check_for_nan_in_loss": False},
        "ddp": {"check_for_nan_in_grad": True},
        "train": {"micro_batch_size": 1},
        "dataset": {"sequence_length": 1024},
    }
    s = read_settings(cfg)
    assert (s.impl, s.scope, s.warmup_steps) == ("local", ("full_iteration",), 2)
    assert s.full_iteration and s.is_moe and not s.dropless_moe
    assert s.check_for_nan_in_loss is False and s.check_for_nan_in_grad is True
    assert (s.seq_length, s.micro_batch_size) == (1024, 1)
    assert s.field("scope") == "model.cuda_graph_scope"
    assert s.field("check_for_nan_in_grad") == "ddp.check_for_nan_in_grad"


def test_mcore_default_full_scope_is_read_as_whole_layer_empty():
    s = read_settings(bridge_config())
    assert s.impl == "none" and s.scope == () and not s.enabled


def test_real_cuda_graph_scope_enum_members_in_a_nested_config():
    from megatron.core.transformer.enums import CudaGraphScope

    cfg = bridge_config(
        cuda_graph_impl="transformer_engine",
        cuda_graph_scope=[CudaGraphScope.attn, CudaGraphScope.moe_router],
    )
    assert read_settings(cfg).scope == ("attn", "moe_router")


def test_new_generation_spelling_full_iteration_impl_with_empty_modules():
    cfg = bridge_config(cuda_graph_impl="full_iteration", cuda_graph_modules=[])
    del cfg.model.cuda_graph_scope
    s = read_settings(cfg)
    assert (s.impl, s.scope) == ("local", ("full_iteration",))
    assert s.sources["scope"] == "model.cuda_graph_modules"
    assert s.enabled and s.full_iteration


def test_new_generation_modules_with_fake_cuda_graph_module_members():
    # A 0.19 TransformerConfig after __post_init__: scope None, modules set.
    cfg = NS(
        cuda_graph_impl="transformer_engine",
        cuda_graph_scope=None,
        cuda_graph_modules=[FakeCudaGraphModule.attn, FakeCudaGraphModule.mlp],
    )
    s = read_settings(cfg)
    assert (s.impl, s.scope) == ("transformer_engine", ("attn", "mlp"))
    assert s.field("scope") == "cuda_graph_modules"


def test_new_generation_full_scope_default_with_full_iteration_impl():
    cfg = NS(cuda_graph_impl="full_iteration", cuda_graph_modules="full")
    assert read_settings(cfg).scope == ("full_iteration",)


def test_missing_settings_take_megatron_defaults_and_generic_field_names():
    s = read_settings(NS())
    assert s == Settings()
    assert s.impl == "none" and s.scope == () and s.warmup_steps == DEFAULT_WARMUP_STEPS
    assert s.moe_token_dispatcher_type == "allgather" and s.moe_layer_freq == 1
    assert s.sources == {}
    assert s.field("scope") == "cuda_graph_scope"
    assert s.field("warmup_steps") == "cuda_graph_warmup_steps"
    assert s.field("rng_te_rng_tracker") == "rng.te_rng_tracker"
    assert s.field("variable_seq_lengths") == "variable_seq_lengths"


def test_none_values_fall_back_to_defaults():
    cfg = NS(
        cuda_graph_impl="local",
        cuda_graph_scope="full_iteration",
        cuda_graph_warmup_steps=None,
        attention_dropout=None,
        hidden_dropout=None,
        moe_token_dispatcher_type=None,
        moe_layer_freq=None,
        cpu_offloading=None,
        recompute_modules=["core_attn", "mlp"],
    )
    s = read_settings(cfg)
    assert s.warmup_steps == DEFAULT_WARMUP_STEPS
    assert (s.attention_dropout, s.hidden_dropout) == (0.1, 0.1)  # megatron-core's defaults
    assert s.moe_token_dispatcher_type == "allgather" and s.moe_layer_freq == 1
    assert s.cpu_offloading is False
    assert s.recompute_modules == ("core_attn", "mlp")


def test_warmup_steps_string_is_read_and_a_bad_one_is_a_listed_problem():
    assert read_settings(NS(cuda_graph_warmup_steps="3")).warmup_steps == 3
    s = read_settings(NS(cuda_graph_warmup_steps=-1))
    assert s.warmup_steps == DEFAULT_WARMUP_STEPS  # the default stands in; the value is reported
    (problem,) = s.input_problems
    assert (problem.setting, problem.value) == ("warmup_steps", -1)
    assert problem.problem == "cuda_graph_warmup_steps must be a non-negative integer"


def test_moe_properties():
    def s(**kw):
        return read_settings(NS(**kw))

    assert not s(num_moe_experts=None).is_moe
    assert not s(num_moe_experts=1).is_moe
    assert s(num_moe_experts=8).is_moe
    assert s(num_moe_experts=8).dropless_moe
    assert s(num_moe_experts=8, moe_expert_capacity_factor=1.0).dropless_moe
    assert s(num_moe_experts=8, moe_pad_expert_input_to_capacity=True).dropless_moe
    assert not s(
        num_moe_experts=8, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True
    ).dropless_moe
    assert s().effective_recompute_modules == ("core_attn",)
    assert s(recompute_modules=["mlp"]).effective_recompute_modules == ("mlp",)


# -- a real megatron-core TransformerConfig ---------------------------------------------------


def test_real_transformer_config_te_impl_is_accepted_without_te_on_cpu():
    from megatron.core.transformer.enums import CudaGraphScope

    cfg = transformer_config(cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn", "mlp"])
    # 0.16.1's __post_init__ converted the names to enum members.
    assert cfg.cuda_graph_scope == [CudaGraphScope.attn, CudaGraphScope.mlp]
    s = read_settings(cfg)
    assert (s.impl, s.scope, s.warmup_steps) == ("transformer_engine", ("attn", "mlp"), 3)
    assert s.model_te_rng_tracker is False
    assert s.rng_te_rng_tracker is None  # a TransformerConfig has no rng.te_rng_tracker
    assert s.check_for_nan_in_loss is None
    assert s.attention_dropout == 0.1 and s.hidden_dropout == 0.1
    assert s.add_bias_linear is True
    assert s.sources["scope"] == "cuda_graph_scope"
    assert s.field("model_te_rng_tracker") == "use_te_rng_tracker"


def test_real_transformer_config_local_full_iteration():
    cfg = transformer_config(
        cuda_graph_impl="local", cuda_graph_scope="full_iteration", cuda_graph_warmup_steps=1
    )
    s = read_settings(cfg)
    assert (s.impl, s.scope, s.warmup_steps) == ("local", ("full_iteration",), 1)


def test_real_transformer_config_default_is_off_with_whole_layer_scope():
    cfg = transformer_config()
    assert cfg.cuda_graph_scope == []  # "full" became [] in __post_init__
    s = read_settings(cfg)
    assert (s.impl, s.scope, s.enabled) == ("none", (), False)


def test_real_transformer_config_moe_fields():
    cfg = transformer_config(
        num_moe_experts=8,
        moe_router_topk=2,
        moe_token_dispatcher_type="alltoall",
        cuda_graph_impl="transformer_engine",
        cuda_graph_scope=["attn", "moe_router", "moe_preprocess"],
    )
    s = read_settings(cfg)
    assert s.is_moe and s.dropless_moe
    assert s.moe_token_dispatcher_type == "alltoall"
    assert s.scope == ("attn", "moe_router", "moe_preprocess")


def test_bridge_tree_holding_a_real_transformer_config_as_model():
    cfg = bridge_config()
    cfg.model = transformer_config(
        cuda_graph_impl="local", cuda_graph_scope=["full_iteration"], use_te_rng_tracker=True
    )
    s = read_settings(cfg)
    assert (s.impl, s.scope) == ("local", ("full_iteration",))
    assert s.sources["scope"] == "model.cuda_graph_scope"
    assert s.model_te_rng_tracker is True and s.rng_te_rng_tracker is False
    assert s.check_for_nan_in_loss is True


# -- a Megatron-LM argparse namespace -------------------------------------------------------------


def test_megatron_lm_namespace_names_and_flag_display():
    args = mlm_args(
        cuda_graph_impl="transformer_engine",
        cuda_graph_scope=["attn", "moe_router"],
        num_experts=16,
    )
    s = read_settings(args)
    assert s.impl == "transformer_engine" and s.scope == ("attn", "moe_router")
    assert s.num_moe_experts == 16 and s.is_moe
    assert s.rng_te_rng_tracker is False
    assert s.model_te_rng_tracker is None
    assert s.check_for_nan_in_loss is True and s.check_for_nan_in_grad is True
    assert s.field("scope") == "--cuda-graph-scope"
    assert s.field("impl") == "--cuda-graph-impl"
    assert s.field("rng_te_rng_tracker") == "--te-rng-tracker"
    assert s.field("num_moe_experts") == "--num-experts"
    assert s.field("check_for_nan_in_loss") == (
        "check_for_nan_in_loss_and_grad (--no-check-for-nan-in-loss-and-grad)"
    )
    assert s.field("micro_batch_size") == "--micro-batch-size"


def test_namespace_comma_separated_scope_string_with_spaces():
    s = read_settings(mlm_args(cuda_graph_impl="transformer_engine", cuda_graph_scope="attn , mlp"))
    assert s.scope == ("attn", "mlp")


# -- compat: the pure part ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "impl, scope, expected",
    [
        ("none", (), ("none", ())),
        ("none", ("full",), ("none", ())),
        ("local", ("full_iteration",), ("local", ("full_iteration",))),
        ("transformer_engine", ("full",), ("transformer_engine", ())),
        ("transformer_engine", ("attn", "mlp"), ("transformer_engine", ("attn", "mlp"))),
        ("full_iteration", (), ("local", ("full_iteration",))),
        ("full_iteration", ("full",), ("local", ("full_iteration",))),
        # Mixed modules stay visible so validation can reject them.
        ("full_iteration", ("attn",), ("local", ("full_iteration", "attn"))),
    ],
)
def test_canonical_impl_and_scope(impl, scope, expected):
    assert vocabulary.canonical_impl_and_scope(impl, scope) == expected


@pytest.mark.parametrize(
    "installed, expected",
    [
        ({}, None),
        ({"transformer-engine": "2.12.0"}, "2.12.0"),
        ({"transformer_engine": "2.10.1"}, "2.10.1"),
        ({"transformer-engine-torch": "2.11.0"}, "2.11.0"),
    ],
)
def test_te_version_reads_distribution_metadata(monkeypatch, installed, expected):
    import importlib.metadata

    def version(name):
        if name in installed:
            return installed[name]
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(environment.importlib.metadata, "version", version)
    te = environment.installed_te_version()
    assert te == (None if expected is None else Version(expected))


@pytest.mark.parametrize("new", [False, True])
def test_model_config_kwargs_impl_none(monkeypatch, new):
    monkeypatch.setattr(generation, "new_generation", lambda: new)
    # 0.16: the empty scope, so that its default "full" does not warn on every build
    expected = {"cuda_graph_impl": "none", **({} if new else {"cuda_graph_scope": []})}
    assert compat.model_config_kwargs("none", ("attn",), 3) == expected


def test_model_config_kwargs_old_generation(monkeypatch):
    monkeypatch.setattr(generation, "new_generation", lambda: False)
    assert compat.model_config_kwargs("local", ("full_iteration",), 2) == {
        "cuda_graph_impl": "local",
        "cuda_graph_scope": ["full_iteration"],
        "cuda_graph_warmup_steps": 2,
        "use_te_rng_tracker": True,
    }
    assert compat.model_config_kwargs("transformer_engine", ("attn", "mlp"), 3) == {
        "cuda_graph_impl": "transformer_engine",
        "cuda_graph_scope": ["attn", "mlp"],
        "cuda_graph_warmup_steps": 3,
        "use_te_rng_tracker": True,
    }


def test_model_config_kwargs_new_generation(monkeypatch):
    monkeypatch.setattr(generation, "new_generation", lambda: True)
    assert compat.model_config_kwargs("local", ("full_iteration",), 2) == {
        "cuda_graph_impl": "full_iteration",
        "cuda_graph_scope": None,  # (0.16's name, which a host's base may hold: cleared)
        "cuda_graph_modules": [],
        "cuda_graph_warmup_steps": 2,
        "use_te_rng_tracker": True,
    }
    assert compat.model_config_kwargs("transformer_engine", ("attn", "moe_router"), 3) == {
        "cuda_graph_impl": "transformer_engine",
        "cuda_graph_scope": None,
        "cuda_graph_modules": ["attn", "moe_router"],
        "cuda_graph_warmup_steps": 3,
        "use_te_rng_tracker": True,
    }


@pytest.mark.parametrize(
    "impl, scope",
    [("none", ()), ("local", ("full_iteration",)), ("transformer_engine", ("attn", "mlp"))],
)
def test_model_config_kwargs_0_16_spelling_builds_a_real_transformer_config(
    monkeypatch, impl, scope
):
    monkeypatch.setattr(generation, "new_generation", lambda: False)
    kwargs = compat.model_config_kwargs(impl, scope, 2)
    cfg = transformer_config(**kwargs)
    s = read_settings(cfg)
    assert (s.impl, s.scope) == (impl, scope)
    if impl != "none":
        assert cfg.use_te_rng_tracker is True and cfg.cuda_graph_warmup_steps == 2


@pytest.mark.parametrize(
    "impl, scope",
    [("local", ("full_iteration",)), ("transformer_engine", ("attn", "mlp"))],
)
def test_model_config_kwargs_new_spelling_reads_back_to_the_same_settings(monkeypatch, impl, scope):
    monkeypatch.setattr(generation, "new_generation", lambda: True)
    cfg = NS(**compat.model_config_kwargs(impl, scope, 2))
    s = read_settings(cfg)
    assert (s.impl, s.scope, s.warmup_steps, s.model_te_rng_tracker) == (impl, scope, 2, True)


# -- the accepted forms of every value (README's table) -----------------------------------------


@pytest.mark.parametrize(
    "field, given, setting, expected",
    [
        # numbers as strings (YAML recipes, environment overrides)
        ("num_moe_experts", "8", "num_moe_experts", 8),
        ("num_experts", " 16 ", "num_moe_experts", 16),
        ("num_moe_experts", "none", "num_moe_experts", None),
        ("cuda_graph_warmup_steps", "0", "warmup_steps", 0),
        ("seq_length", "4096", "seq_length", 4096),
        ("micro_batch_size", "2", "micro_batch_size", 2),
        ("recompute_num_layers", "1", "recompute_num_layers", 1),
        ("moe_shared_expert_intermediate_size", "512", "moe_shared_expert_intermediate_size", 512),
        ("moe_expert_capacity_factor", "1.5", "moe_expert_capacity_factor", 1.5),
        ("moe_expert_capacity_factor", "None", "moe_expert_capacity_factor", None),
        ("moe_expert_capacity_factor", "null", "moe_expert_capacity_factor", None),
        ("moe_expert_capacity_factor", 1, "moe_expert_capacity_factor", 1.0),
        ("moe_input_jitter_eps", "0.01", "moe_input_jitter_eps", 0.01),
        ("attention_dropout", "0.0", "attention_dropout", 0.0),
        ("hidden_dropout", "0.1", "hidden_dropout", 0.1),
        # booleans as words or numbers
        ("cpu_offloading", "false", "cpu_offloading", False),
        ("cpu_offloading", "True", "cpu_offloading", True),
        ("moe_permute_fusion", "yes", "moe_permute_fusion", True),
        ("moe_permute_fusion", "off", "moe_permute_fusion", False),
        ("variable_seq_lengths", 0, "variable_seq_lengths", False),
        ("delay_wgrad_compute", "1", "delay_wgrad_compute", True),
        ("use_te_rng_tracker", "false", "model_te_rng_tracker", False),
        ("te_rng_tracker", "null", "rng_te_rng_tracker", None),
        ("check_for_nan_in_loss", "FALSE", "check_for_nan_in_loss", False),
        # names
        ("moe_token_dispatcher_type", " alltoall ", "moe_token_dispatcher_type", "alltoall"),
        ("recompute_granularity", "selective", "recompute_granularity", "selective"),
        ("recompute_granularity", "none", "recompute_granularity", None),
        ("recompute_method", "block", "recompute_method", "block"),
        ("cuda_graph_impl", " transformer_engine ", "impl", "transformer_engine"),
        # lists of names: a list, a comma-separated or a space-separated string
        ("recompute_modules", "core_attn", "recompute_modules", ("core_attn",)),
        ("recompute_modules", "core_attn,mlp", "recompute_modules", ("core_attn", "mlp")),
        ("recompute_modules", "core_attn mlp", "recompute_modules", ("core_attn", "mlp")),
        ("recompute_modules", ["core_attn", "moe"], "recompute_modules", ("core_attn", "moe")),
        ("recompute_modules", [], "recompute_modules", ()),
        # MoE layer frequency: an int, a 0/1 list, or Megatron-LM's --moe-layer-freq string
        ("moe_layer_freq", "2", "moe_layer_freq", 2),
        ("moe_layer_freq", "([0]*1+[1]*3)", "moe_layer_freq", [0, 1, 1, 1]),
        ("moe_layer_freq", "([1]*3+[0]*1)*2", "moe_layer_freq", [1, 1, 1, 0, 1, 1, 1, 0]),
        ("moe_layer_freq", "[0] + [1] * 2", "moe_layer_freq", [0, 1, 1]),
        ("moe_layer_freq", "[0,1,1]", "moe_layer_freq", [0, 1, 1]),
        ("moe_layer_freq", [1, 0], "moe_layer_freq", [1, 0]),
    ],
)
def test_accepted_forms_are_normalised(field, given, setting, expected):
    s = read_settings(NS(**{field: given}))
    assert s.input_problems == ()
    assert getattr(s, setting) == expected
    assert type(getattr(s, setting)) is type(expected)


@pytest.mark.parametrize(
    "field, given, problem, fix",
    [
        ("num_moe_experts", "eight", "must be a non-negative integer", "such as 8"),
        ("num_moe_experts", "8.0", "must be a non-negative integer", "such as 8"),
        ("num_moe_experts", -2, "must be a non-negative integer", "such as 8"),
        ("num_moe_experts", True, "must be a non-negative integer", "such as 8"),
        ("seq_length", "0", "must be an integer >= 1", "such as 4096"),
        ("cuda_graph_warmup_steps", "x", "must be a non-negative integer", "default: 3"),
        ("moe_expert_capacity_factor", "big", "not a number", "such as 0.1"),
        ("attention_dropout", "nan", "not a finite number", "such as 0.1"),
        ("cuda_graph_peer_exit_deadline", "inf", "not a finite number", "from 1 to 3600"),
        ("hidden_dropout", None, None, None),  # None: megatron-core's default stands
        ("cpu_offloading", "maybe", "not a boolean", "use true or false"),
        ("cpu_offloading", 2, "not a boolean", "use true or false"),
        ("te_rng_tracker", "sure", "not a boolean", "use true or false"),
        ("moe_token_dispatcher_type", "all2all", "not a known value", "allgather, alltoall, flex"),
        ("recompute_granularity", "Full", "not a known value", "use one of full, selective"),
        ("recompute_method", "even", "not a known value", "use one of uniform, block"),
        ("recompute_modules", 3, "not a list of names", "comma-separated string"),
        ("recompute_modules", ["core_attn", 3], "holds a value that is not a name", "a list"),
        ("moe_layer_freq", "([0]*1+[1]*x)", "not an integer or a layer pattern", "([0]*1+[1]*3)"),
        ("moe_layer_freq", "__import__('os')", "not an integer or a layer pattern", "pattern"),
        ("moe_layer_freq", "[0,2]", "non-empty list of 0 and 1", "1 = MoE"),
        ("moe_layer_freq", "[]", "non-empty list of 0 and 1", "1 = MoE"),
        ("moe_layer_freq", "[0]*1000000", "pattern too long", "pattern"),
        ("moe_layer_freq", 0, "must be an integer >= 1", "one MoE layer every N layers"),
    ],
)
def test_unreadable_values_are_field_problems_never_exceptions(field, given, problem, fix):
    s = read_settings(NS(**{field: given}))
    if problem is None:
        assert s.input_problems == ()
        return
    (p,) = s.input_problems
    assert p.value == given
    assert problem in p.problem
    assert fix in p.fix
    assert s.field(p.setting) == field


def test_a_bad_value_keeps_the_default_so_rules_never_crash():
    # Before: num_moe_experts="8" reached `num_moe_experts > 1` and raised a bare TypeError.
    s = read_settings(NS(num_moe_experts="eight", moe_layer_freq="x", cpu_offloading="maybe"))
    assert (s.num_moe_experts, s.moe_layer_freq, s.cpu_offloading) == (None, 1, False)
    assert [p.setting for p in s.input_problems] == [
        "num_moe_experts",
        "moe_layer_freq",
        "cpu_offloading",
    ]


def test_field_problems_name_the_flag_on_a_command_line():
    s = read_settings(argparse.Namespace(num_experts="eight", moe_layer_freq="[2]"))
    assert [s.field(p.setting) for p in s.input_problems] == ["--num-experts", "--moe-layer-freq"]


def test_deprecated_full_scope_and_both_scope_fields_are_recorded():
    assert read_settings(NS(cuda_graph_scope="full")).deprecated_full_scope
    assert not read_settings(NS(cuda_graph_scope="attn")).deprecated_full_scope
    s = read_settings(NS(model=NS(cuda_graph_scope=["attn"], cuda_graph_modules="attn,mlp")))
    assert s.scope_conflict == (
        ("model.cuda_graph_scope", "['attn']"),
        ("model.cuda_graph_modules", "'attn,mlp'"),
    )
    # A 0.19 TransformerConfig after __post_init__ (scope None) or MCore's "full" default
    # next to the other field is not a conflict.
    assert (
        read_settings(NS(cuda_graph_scope=None, cuda_graph_modules=["attn"])).scope_conflict == ()
    )
    assert (
        read_settings(NS(cuda_graph_scope="full", cuda_graph_modules=["attn"])).scope_conflict == ()
    )


def test_command_line_origin_is_recorded():
    assert read_settings(argparse.Namespace()).from_command_line
    assert not read_settings(NS()).from_command_line


def test_a_scope_the_0_18_impl_adds_is_not_one_the_user_listed_twice():
    s = read_settings(NS(cuda_graph_impl="full_iteration", cuda_graph_modules=["full_iteration"]))
    assert (s.impl, s.scope, s.duplicated_scopes) == ("local", ("full_iteration",), ())
    s = read_settings(NS(cuda_graph_impl="full_iteration", cuda_graph_modules="mlp,mlp"))
    assert (s.scope, s.duplicated_scopes) == (("full_iteration", "mlp"), ("mlp",))
