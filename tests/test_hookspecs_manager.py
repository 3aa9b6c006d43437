"""get_plugin_manager: entry-point discovery from real distribution metadata, blocking,
and validation of what plugins implement."""

from __future__ import annotations

import importlib.metadata
import logging
import sys
import textwrap
import uuid

import pluggy
import pytest

from hookspecs import BLOCK_ENV_VAR, PROJECT_NAME, TrainingRun, get_plugin_manager
from hookspecs.manager import HOST_DEFAULTS_NAME, blocked_plugin_names

# Plugins really installed in this environment (the project's own ``cudagraph``, perhaps
# example plugins): every test blocks them, so that only the fake distributions it
# installs are loaded, whatever else is installed and whether it imports.
REAL_PLUGINS = sorted({ep.name for ep in importlib.metadata.entry_points(group=PROJECT_NAME)})

PLUGIN_SOURCE = textwrap.dedent(
    """
    from hookspecs import hookimpl

    CALLS = []

    @hookimpl
    def mcgraph_configure(config):
        CALLS.append(("configure", config))

    @hookimpl
    def mcgraph_shutdown(reason):
        CALLS.append(("shutdown", str(reason)))
    """
)


@pytest.fixture
def install(tmp_path, monkeypatch):
    """Install a fake distribution: an importable module plus its ``.dist-info``."""
    created_modules = []

    def _install(ep_name: str, source: str = PLUGIN_SOURCE, dist: str | None = None) -> str:
        module = f"mcgraph_fake_{ep_name}_{uuid.uuid4().hex[:8]}"
        dist = dist or f"fake-{ep_name}".replace("_", "-")
        (tmp_path / f"{module}.py").write_text(source)
        info = tmp_path / f"{dist.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[{PROJECT_NAME}]\n{ep_name} = {module}\n")
        created_modules.append(module)
        return module

    monkeypatch.syspath_prepend(str(tmp_path))
    yield _install
    for module in created_modules:
        sys.modules.pop(module, None)


def block(monkeypatch, value: str) -> None:
    """Set the block list to ``value`` plus the really installed plugins."""
    monkeypatch.setenv(BLOCK_ENV_VAR, ",".join([value, *REAL_PLUGINS]))


def test_installed_plugin_is_registered_under_its_entry_point_name(install, monkeypatch):
    module = install("fakeplug")
    block(monkeypatch, "")

    pm = get_plugin_manager()

    plugin = pm.get_plugin("fakeplug")
    assert plugin is sys.modules[module]
    assert pm.get_name(plugin) == "fakeplug"
    distinfo = dict(pm.list_plugin_distinfo())
    assert distinfo[plugin].project_name == "fake-fakeplug"
    assert pm.has_plugin(HOST_DEFAULTS_NAME)

    with TrainingRun(pm, "the-config", train_iters=0):
        pass
    assert plugin.CALLS == [("configure", "the-config"), ("shutdown", "completed")]


def test_two_distributions_giving_a_plugin_one_name_are_refused(install, monkeypatch, capsys):
    """(review of 2026-12-05: pluggy loaded the first found on sys.path and skipped the
    other without a word; a third-party ``cudagraph`` entry point replaced the CUDA graph
    plugin, and the run went on with no graphs and no report.)"""
    from hookspecs import ConfigurationError

    install("fakeplug", dist="fake-one")
    install("fakeplug", dist="fake-two")
    install("other_fake")
    block(monkeypatch, "")
    with pytest.raises(ConfigurationError) as refused:
        get_plugin_manager()
    assert str(refused.value) == (
        "2 installed distributions provide a plugin named 'fakeplug' (fake-one 0.1, fake-two "
        "0.1): only the first found on sys.path would load, the other skipped without a "
        "word. Fix: uninstall all but one (pip uninstall), or rename the other's 'mcgraph' "
        "entry point"
    )
    import minimal_loop  # a host says it as other refusals: no traceback, exit status 2

    assert minimal_loop.main(["--train-iters", "0"]) == 2
    assert capsys.readouterr().err == f"error: {refused.value}\n"
    block(monkeypatch, "fakeplug")  # blocked: neither loads, nothing to choose
    pm = get_plugin_manager()
    assert not pm.has_plugin("fakeplug") and pm.has_plugin("other_fake")
    assert get_plugin_manager(load_entrypoints=False) is not None


def test_load_entrypoints_false_loads_nothing(install, monkeypatch):
    install("fakeplug")
    block(monkeypatch, "")
    pm = get_plugin_manager(load_entrypoints=False)
    assert not pm.has_plugin("fakeplug")
    assert [name for name, _ in pm.list_name_plugin()] == [HOST_DEFAULTS_NAME]


@pytest.mark.parametrize(
    "value",
    [
        "fakeplug",
        " fakeplug , ",
        ",, fakeplug,other_fake",
        "no_such_plugin,  fakeplug",
    ],
)
def test_blocked_plugin_is_not_loaded_and_logged(install, monkeypatch, caplog, value):
    module = install("fakeplug")
    install("other_fake")
    block(monkeypatch, value)

    with caplog.at_level(logging.INFO, logger="hookspecs.manager"):
        pm = get_plugin_manager()

    assert not pm.has_plugin("fakeplug")
    assert pm.is_blocked("fakeplug")
    assert module not in sys.modules, "a blocked plugin must not even be imported"
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("'fakeplug'" in msg and BLOCK_ENV_VAR in msg for msg in infos), infos
    assert pm.has_plugin("other_fake") == ("other_fake" not in value)


def test_blocking_an_object_a_plugin_registers_is_said_as_such(install, monkeypatch, caplog):
    """(review of 2026-12-05: ``fakeplug:Timer`` blocked the object, and the log said "no
    installed plugin has that name".)"""
    install("fakeplug")
    block(monkeypatch, "fakeplug:Timer,nosuch:Timer")
    with caplog.at_level(logging.INFO, logger="hookspecs.manager"):
        get_plugin_manager()
    said = {r.levelno: r.getMessage() for r in caplog.records if "Timer" in r.getMessage()}
    assert said[logging.INFO] == (
        f"'fakeplug:Timer', an object plugin 'fakeplug' registers for a run, is blocked by "
        f"{BLOCK_ENV_VAR} (plugin 'fakeplug' itself loads)"
    )
    assert said[logging.WARNING].startswith(
        f"{BLOCK_ENV_VAR} names 'nosuch:Timer', but no installed plugin has that name"
    )


def test_blocking_an_unknown_name_warns_with_the_installed_names(install, monkeypatch, caplog):
    install("fakeplug")
    block(monkeypatch, "no_such_plugin")

    with caplog.at_level(logging.INFO, logger="hookspecs.manager"):
        pm = get_plugin_manager()

    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "'no_such_plugin'" in warnings[0]
    assert BLOCK_ENV_VAR in warnings[0]
    assert "fakeplug" in warnings[0]
    for name in REAL_PLUGINS:
        assert name in warnings[0]
    assert pm.has_plugin("fakeplug")


def test_blocked_plugin_names_parsing():
    assert blocked_plugin_names({}) == []
    assert blocked_plugin_names({BLOCK_ENV_VAR: ""}) == []
    assert blocked_plugin_names({BLOCK_ENV_VAR: " a ,b,, c ,"}) == ["a", "b", "c"]


def test_plugin_with_unknown_hook_fails_check_pending(install, monkeypatch):
    install(
        "typo",
        textwrap.dedent(
            """
            from hookspecs import hookimpl

            @hookimpl
            def mcgraph_post_warmup(step):
                pass
            """
        ),
    )
    block(monkeypatch, "")
    with pytest.raises(pluggy.PluginValidationError, match="mcgraph_post_warmup") as excinfo:
        get_plugin_manager()
    assert excinfo.traceback[-1].name == "check_pending"


def test_optional_unknown_hook_is_accepted(install, monkeypatch):
    install(
        "optional",
        textwrap.dedent(
            """
            from hookspecs import hookimpl

            @hookimpl(optionalhook=True)
            def mcgraph_hook_of_a_newer_host(step):
                pass
            """
        ),
    )
    block(monkeypatch, "")
    assert get_plugin_manager().has_plugin("optional")


def test_plugin_with_unknown_argument_is_refused(install, monkeypatch):
    install(
        "badarg",
        textwrap.dedent(
            """
            from hookspecs import hookimpl

            @hookimpl
            def mcgraph_train_step_start(step, iteration):
                pass
            """
        ),
    )
    block(monkeypatch, "")
    with pytest.raises(pluggy.PluginValidationError, match="iteration"):
        get_plugin_manager()


def test_each_call_returns_a_fresh_manager():
    first = get_plugin_manager(load_entrypoints=False)
    second = get_plugin_manager(load_entrypoints=False)
    assert first is not second
    assert first.get_plugin(HOST_DEFAULTS_NAME) is second.get_plugin(HOST_DEFAULTS_NAME)
