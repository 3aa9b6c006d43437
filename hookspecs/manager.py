"""The plugin manager: specs, the host's default plugin, entry-point discovery, blocking by
environment variable, ``check_pending()``, and one name per plugin.

No global manager exists: every run calls :func:`get_plugin_manager` and gets a fresh one.

**One name per plugin.** A plugin's name is its entry-point name (``steptimer`` in
``[options.entry_points] mcgraph = steptimer = mcgraph_steptimer.plugin``): the name it is
blocked by, and the name log lines and error notes use, followed by its distribution where
one installed it (``steptimer (mcgraph-steptimer 0.1.0)``). An object a plugin registers
from one of its hook implementations (a per-run object, registered from
``mcgraph_configure``) belongs to that plugin: without an explicit name it is registered as
``<plugin>:<ClassName>`` (``steptimer:StepTimer``), and :meth:`McgraphPluginManager.plugin_name`
gives the owning plugin's name for it, so errors it raises name the plugin, not the object.

**Kept outermost.** pluggy puts the ``tryfirst`` wrapper registered last outermost. An
object whose ``mcgraph_outermost`` attribute is ``True`` (the CUDA graph plugin's shutdown
guard; it may implement no historic hook, which each registration would replay to it) is
registered again after every other registration, so its ``tryfirst`` wrappers
stay outside those of objects registered later (a per-run object registered from a hook, an
entry point loaded before the plugin); among such objects the registration order holds.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import logging
import os
import sys
from typing import Any

import pluggy

from hookspecs import host_defaults, spec
from hookspecs.errors import ConfigurationError
from hookspecs.markers import PROJECT_NAME
from hookspecs.ranks import launcher_rank

logger = logging.getLogger(__name__)

BLOCK_ENV_VAR = "MCGRAPH_BLOCK_PLUGINS"
"""Comma-separated plugin (entry-point) names not to load, e.g. ``cudagraph,my_plugin``."""

HOST_DEFAULTS_NAME = "mcgraph-host-defaults"

OUTERMOST_ATTR = "mcgraph_outermost"
"""The attribute (``True``) of a plugin object kept registered last (see the module
docstring)."""


def _outermost(plugin: Any) -> bool:
    try:
        return getattr(plugin, OUTERMOST_ATTR, False) is True
    except Exception:  # (a plugin object whose attribute lookup raises is not one)
        return False


def blocked_plugin_names(environ: dict[str, str] | os._Environ[str] | None = None) -> list[str]:
    """Plugin names listed in :data:`BLOCK_ENV_VAR` (spaces and empty items ignored)."""
    raw = (os.environ if environ is None else environ).get(BLOCK_ENV_VAR, "")
    return [name.strip() for name in raw.split(",") if name.strip()]


def _installed_entry_points() -> dict[str, str | None]:
    """Installed plugin names and the distribution that provides each."""
    return {
        ep.name: ep.dist.name if ep.dist is not None else None
        for ep in importlib.metadata.entry_points(group=PROJECT_NAME)
    }


def _providers() -> dict[str, list[str]]:
    """Each installed plugin name and the distributions (``name version``) that provide it,
    once each (a distribution found twice on the path is one)."""
    found: dict[str, dict[str, str]] = {}
    for ep in importlib.metadata.entry_points(group=PROJECT_NAME):
        dist = ep.dist
        key = _canonical_distribution(dist.name) if dist is not None else f"?{ep.value}"
        shown = f"{dist.name} {dist.version}" if dist is not None else ep.value
        found.setdefault(ep.name, {}).setdefault(key, shown)
    return {name: sorted(dists.values()) for name, dists in found.items()}


def _one_plugin_per_name(pm: McgraphPluginManager) -> None:
    """Refuse two distributions that give a plugin the same name: pluggy loads the first
    it finds (by the order of ``sys.path``) and skips the other without a word, so a
    third-party ``cudagraph`` entry point would replace the CUDA graph plugin."""
    clashes = {
        name: dists
        for name, dists in _providers().items()
        if len(dists) > 1 and not pm.is_blocked(name)
    }
    if clashes:
        raise ConfigurationError(
            "; ".join(
                f"{len(dists)} installed distributions provide a plugin named {name!r} "
                f"({', '.join(dists)})"
                for name, dists in clashes.items()
            )
            + f": only the first found on sys.path would load, the other skipped without "
            f"a word. Fix: uninstall all but one (pip uninstall), or rename the other's "
            f"{PROJECT_NAME!r} entry point"
        )


def _canonical_distribution(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


class McgraphPluginManager(pluggy.PluginManager):
    """pluggy's plugin manager, plus one name per plugin (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(PROJECT_NAME)
        self._owners: dict[str, str] = {}
        # Bumped by every register and unregister: TrainingRun looks again which per-step
        # hooks have implementations only when it moved (see TrainingRun.train_step).
        self.registrations = 0

    def register(self, plugin: Any, name: str | None = None) -> str | None:
        """Register ``plugin``; an object registered from a plugin's hook implementation
        belongs to that plugin, and without ``name`` it is named ``<plugin>:<ClassName>``."""
        owner = self._registering_plugin()
        if name is None:
            kind = _kind(plugin)
            name = self._free_name(f"{owner}:{kind}" if owner is not None else kind)
        registered = super().register(plugin, name)
        self.registrations += 1
        if registered is None:
            return None
        outermost = _outermost(plugin)
        if outermost:
            historic = sorted(
                caller.name for caller in self.get_hookcallers(plugin) or () if caller.is_historic()
            )
            if historic:  # (registered again after every registration: replayed each time)
                super().unregister(plugin, registered)
                raise ValueError(
                    f"{registered}: an object with {OUTERMOST_ATTR} = True implements "
                    f"{', '.join(historic)}, a historic hook, which every registration after "
                    "it would replay to it again; implement it on another object"
                )
        if owner is not None:
            self._owners[registered] = owner
        if not outermost:
            self._keep_outermost_last()
        return registered

    def _keep_outermost_last(self) -> None:
        """Register every ``mcgraph_outermost`` object again, in its order, with its name and
        owner: pluggy then puts its ``tryfirst`` wrappers outside everything registered so
        far. (A hook call in progress keeps the implementations it started with.)"""
        for name, plugin in list(self.list_name_plugin()):
            if plugin is not None and _outermost(plugin):
                super().unregister(plugin, name)
                super().register(plugin, name)

    def unregister(self, plugin: Any | None = None, name: str | None = None) -> Any | None:
        removed_name = name if name is not None else self.get_name(plugin)
        removed = super().unregister(plugin, name)
        self.registrations += 1
        self._owners.pop(removed_name or "", None)
        return removed

    def check_pending(self) -> None:
        """pluggy's check, whose error names an object by its repr: a note names it as
        messages do, with the hook it may have meant."""
        try:
            super().check_pending()
        except pluggy.PluginValidationError as error:
            name = self.get_name(error.plugin)
            hook = str(error).split("'")[1] if str(error).startswith("unknown hook '") else ""
            close = difflib.get_close_matches(hook, [n for n in vars(spec) if n[:7] == "mcgraph"])
            if name is not None:
                error.add_note(
                    f"registered as {name!r}, of plugin {self.describe(name)}"
                    + (f"; did you mean {close[0]}?" if close else "")
                )
            raise

    def plugin_name(self, name: str) -> str:
        """The name of the plugin that the object registered as ``name`` belongs to."""
        return self._owners.get(name, name)

    def distribution(self, name: str) -> str | None:
        """``mcgraph-steptimer 0.1.0``: the distribution that installed the plugin the
        object registered as ``name`` belongs to, or ``None`` (registered in-process)."""
        plugin = self.get_plugin(self.plugin_name(name))
        for registered, dist in self.list_plugin_distinfo():
            if registered is plugin:
                return f"{dist.project_name} {dist.version}"
        return None

    def describe(self, name: str) -> str:
        """``'steptimer' (mcgraph-steptimer 0.1.0)``: how messages name the plugin the
        object registered as ``name`` belongs to."""
        dist = self.distribution(name)
        owner = repr(self.plugin_name(name))
        return owner if dist is None else f"{owner} ({dist})"

    def _free_name(self, base: str) -> str:
        if base not in self._name2plugin or self.is_blocked(base):
            return base
        number = 2
        while f"{base}-{number}" in self._name2plugin:
            number += 1
        return f"{base}-{number}"

    def _registering_plugin(self) -> str | None:
        """The plugin whose hook implementation is calling :meth:`register`, if any: the
        innermost frame on the stack that runs a registered hook implementation."""
        impls: dict[Any, list[pluggy.HookImpl]] = {}
        for caller in vars(self.hook).values():
            if isinstance(caller, pluggy.HookCaller):
                for impl in caller.get_hookimpls():
                    code = getattr(impl.function, "__code__", None)
                    if code is not None:
                        impls.setdefault(code, []).append(impl)
        frame = sys._getframe(2)
        while frame is not None:
            for impl in impls.get(frame.f_code, ()):
                # Two instances of one class share the code: the frame's self decides.
                bound = getattr(impl.function, "__self__", None)
                if bound is None or frame.f_locals.get("self") is bound:
                    return self.plugin_name(impl.plugin_name)
            frame = frame.f_back
        return None


def _kind(plugin: Any) -> str:
    """A module's or class's own name, else the name of the object's class."""
    name = getattr(plugin, "__name__", None)
    return name if isinstance(name, str) else type(plugin).__name__


def plugin_name(pluginmanager: pluggy.PluginManager, name: str) -> str:
    """The owning plugin's name for the object registered as ``name`` (``name`` itself on a
    manager that is not a :class:`McgraphPluginManager`)."""
    if isinstance(pluginmanager, McgraphPluginManager):
        return pluginmanager.plugin_name(name)
    return name


def describe_plugin(pluginmanager: pluggy.PluginManager, name: str) -> str:
    """How messages name the plugin registered as ``name``: ``'steptimer' (mcgraph-steptimer
    0.1.0)``, or ``'name'`` where no distribution is known."""
    if isinstance(pluginmanager, McgraphPluginManager):
        return pluginmanager.describe(name)
    return repr(name)


def get_plugin_manager(load_entrypoints: bool = True) -> McgraphPluginManager:
    """Create a plugin manager for one run.

    It knows every hook of :mod:`hookspecs.spec`, has the host's default implementations
    of the perform hooks registered (``mcgraph-host-defaults``), and, unless
    ``load_entrypoints`` is false, every plugin installed under the ``mcgraph``
    entry-point group except those named in ``MCGRAPH_BLOCK_PLUGINS``. The plugins it
    loaded are logged once, each with its distribution.

    :raises pluggy.PluginValidationError: if a loaded plugin implements an unknown hook
        or a hook with unknown arguments (``check_pending``).
    :raises hookspecs.ConfigurationError: if two installed distributions give a plugin
        the same name (one not blocked): pluggy would load one and skip the other.
    """
    pm = McgraphPluginManager()
    pm.add_hookspecs(spec)
    pm.register(host_defaults, name=HOST_DEFAULTS_NAME)
    if load_entrypoints:
        _block(pm, _installed_entry_points())
        _one_plugin_per_name(pm)
        pm.load_setuptools_entrypoints(PROJECT_NAME)
        loaded = [
            name if dist is None else f"{name} ({dist})"
            for name, plugin in pm.list_name_plugin()
            if plugin is not None and name != HOST_DEFAULTS_NAME
            for dist in [pm.distribution(name)]
        ]
        # The same on every rank of a job: said once, by the launcher's rank 0.
        level = logging.INFO if launcher_rank()[0] == 0 else logging.DEBUG
        logger.log(level, "%s plugins: %s", PROJECT_NAME, ", ".join(loaded) or "none installed")
    pm.check_pending()
    return pm


def _block(pm: McgraphPluginManager, installed: dict[str, str | None]) -> None:
    by_distribution = {
        _canonical_distribution(dist): name for name, dist in installed.items() if dist
    }
    for name in blocked_plugin_names():
        pm.set_blocked(name)
        owner, _, kind = name.partition(":")  # (``plugin:Class``: an object it registers)
        if name in installed:
            logger.info("plugin %r is blocked by %s", name, BLOCK_ENV_VAR)
        elif owner in installed and kind:
            logger.info(
                "%r, an object plugin %r registers for a run, is blocked by %s (plugin %r "
                "itself loads)",
                name,
                owner,
                BLOCK_ENV_VAR,
                owner,
            )
        elif _canonical_distribution(name) in by_distribution:
            plugin = by_distribution[_canonical_distribution(name)]
            logger.warning(
                "%s names %r, the distribution of plugin %r; plugins are blocked by their "
                "name, so %r still loads: set %s=%s",
                BLOCK_ENV_VAR,
                name,
                plugin,
                plugin,
                BLOCK_ENV_VAR,
                plugin,
            )
        else:
            logger.warning(
                "%s names %r, but no installed plugin has that name (installed: %s)",
                BLOCK_ENV_VAR,
                name,
                ", ".join(sorted(installed)) or "none",
            )
