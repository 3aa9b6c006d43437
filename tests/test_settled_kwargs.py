"""A host that passes its whole model config as ``run.model_config_kwargs(base=...)``
(Megatron-Bridge's ``cfg.model``, the plugin's own fields in it) gets the plugin's spelling of
those fields, said once, instead of a conflict (user trial of 2026-12-05: a ``ValueError``
through ``hookspecs/answers.py`` even with graphs off); two plugins that disagree are still
refused."""

from __future__ import annotations

import logging
from types import SimpleNamespace as NS

import pytest

from cudagraph_plugin import compat
from cudagraph_plugin.compat import generation
from hookspecs import SettledKwargs, TrainingRun, get_plugin_manager, merge_kwargs

MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, bf16=True)


def bridge_config(impl: str, scope: str) -> NS:
    return NS(
        model=NS(
            cuda_graph_impl=impl,
            cuda_graph_scope=scope,
            cuda_graph_warmup_steps=3,
            use_te_rng_tracker=True,
            **MODEL,
        )
    )


def replaced(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "replaces the host's" in r.getMessage()]


@pytest.mark.parametrize(
    "impl, scope, cuda, answered, why",
    [
        ("local", "full_iteration", True, ("local", ["full_iteration"]), "spelled for"),
        ("local", "full_iteration", False, ("none", []), "no CUDA device"),
        ("transformer_engine", "attn,mlp", False, ("none", []), "no CUDA device"),
    ],
    ids=["full-iteration", "no-device", "te-no-device"],
)
def test_the_plugin_s_fields_in_the_host_s_base_take_the_plugin_s_spelling(
    request, monkeypatch, caplog, impl, scope, cuda, answered, why
):
    from megatron.core.transformer import TransformerConfig

    if cuda:
        request.getfixturevalue("fake_graphs")  # (a device whose graphs are fakes)
    else:
        monkeypatch.setattr(compat, "cuda_available", lambda: False)
    monkeypatch.setattr(generation, "new_generation", lambda: False)  # (0.16's field names)
    config = bridge_config(impl, scope)
    with caplog.at_level(logging.INFO, logger="hookspecs.answers"):
        with TrainingRun(get_plugin_manager(), config=config, train_iters=3) as run:
            kwargs = run.model_config_kwargs(base=vars(config.model))
    assert (kwargs["cuda_graph_impl"], kwargs["cuda_graph_scope"]) == answered
    assert {k: kwargs[k] for k in MODEL} == MODEL  # the host's other fields as they were
    TransformerConfig(**kwargs)  # what the host builds from them
    lines = replaced(caplog)
    assert lines and all(why in line for line in lines), lines
    if not cuda:  # (and the CPU run says what it leaves to a CUDA device)
        [said] = [r.getMessage() for r in caplog.records if "none is available" in r.getMessage()]
        assert "how the loop drives the graphs are checked on a CUDA device only" in said
    assert f"cuda_graph_scope={answered[1]!r} replaces the host's {scope!r}" in " ".join(lines)
    assert len(lines) == len(set(lines))  # each field once


def test_a_settled_answer_replaces_the_host_s_value_only():
    settled = SettledKwargs({"cuda_graph_impl": "none"}, why="graphs off")
    assert settled == {"cuda_graph_impl": "none"} and isinstance(settled, dict)
    merged = merge_kwargs([settled], "TransformerConfig", base={"cuda_graph_impl": "local"})
    assert merged == {"cuda_graph_impl": "none"}
    # another plugin's value is no host's to replace: still a conflict, either way round
    with pytest.raises(ValueError, match="a plugin's 'local' and a plugin's 'none'"):
        merge_kwargs([{"cuda_graph_impl": "local"}, settled], "TransformerConfig")
    with pytest.raises(ValueError, match="a plugin's 'none' and a plugin's 'local'"):
        merge_kwargs([settled, {"cuda_graph_impl": "local"}], "TransformerConfig")
    # a plugin that agreed with the host's value holds it too: refused in either order
    # (review of 2026-12-05: after such a plugin, the settled answer replaced it silently)
    base, agreeing = {"cuda_graph_impl": "local"}, {"cuda_graph_impl": "local"}
    for order in ([agreeing, settled], [settled, agreeing]):
        with pytest.raises(ValueError, match=r"a plugin's '(local|none)' and a plugin's"):
            merge_kwargs(order, "TransformerConfig", base=base)
    # a plain answer against the host's value stays a conflict
    with pytest.raises(ValueError, match="the host's 'local' and a plugin's 'none'"):
        merge_kwargs(
            [{"cuda_graph_impl": "none"}], "TransformerConfig", base={"cuda_graph_impl": "local"}
        )


def test_a_replacement_is_said_by_rank_0_only(monkeypatch, caplog):
    settled = SettledKwargs({"a": 2}, why="because")
    for rank, said in (("1", 0), ("0", 1)):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hookspecs.answers"):
            assert merge_kwargs([settled], "X", base={"a": 1}) == {"a": 2}
        assert len(replaced(caplog)) == said
    assert replaced(caplog) == ["X: a=2 replaces the host's 1: because"]


def test_a_base_in_0_16_s_spelling_gets_the_newer_field_only_on_0_18(monkeypatch, fake_graphs):
    """On megatron-core 0.18+ the plugin answers cuda_graph_modules; a base written for 0.16
    (cuda_graph_scope) kept its key, and 0.18+'s TransformerConfig asserts "cuda_graph_scope
    and cuda_graph_modules cannot be set together" (review of 2026-12-05): cleared."""
    monkeypatch.setattr(generation, "new_generation", lambda: True)
    config = bridge_config("transformer_engine", "attn,mlp")
    with TrainingRun(get_plugin_manager(), config=config, train_iters=3) as run:
        kwargs = run.model_config_kwargs(base=vars(config.model))
    assert kwargs["cuda_graph_scope"] is None
    assert kwargs["cuda_graph_modules"] == ["attn", "mlp"]
