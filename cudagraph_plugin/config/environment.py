"""Facts about the machine of the run that the rules need, read without importing torch
or megatron-core: installed versions (package metadata), whether megatron-core has the
optimizer graph (a file), the allocator and NCCL environment variables, and whether
Transformer Engine can be used (asked of the caller, who may know).

:func:`environment_problems` is the environment's part of the verdict (problems and
notes); the environment's automatic fix (``NCCL_GRAPH_REGISTER=0``) is planned and written
by :mod:`cudagraph_plugin.config.fixes`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.metadata
import importlib.util
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from cudagraph_plugin.config.errors import MCORE, Violation
from cudagraph_plugin.config.settings import Settings

# Transformer Engine releases that matter to the constraints.
TE_DELAY_WGRAD_WITH_ATTN = Version("2.12.0")
TE_DELAY_WGRAD_WITH_PARTIAL_GRAPHS = Version("2.10.0")

OPTIMIZER_GRAPH_FIRST_RELEASE = Version("0.17.0")
"""The first megatron-core release with ``OptimizerCudaGraphWrapper`` (checked on PyPI's
0.16.1, 0.17.0, 0.18.x and 0.19.x wheels)."""

INSTALLED = "installed"


def dist_version(*names: str) -> Version | None:
    for name in names:
        try:
            return Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.cache
def mcore_version() -> Version:
    """The installed megatron-core version, for display: from the package metadata, else
    (megatron on ``PYTHONPATH``) from the constants of ``megatron/core/package_info.py``,
    read as text (importing megatron-core would import torch)."""
    version = dist_version("megatron-core", "megatron_core")
    if version is not None:
        return version
    info = _megatron_file("core", "package_info.py")
    if info is None:
        raise RuntimeError("megatron-core is not installed: pip install megatron-core")
    values: dict[str, Any] = {}
    for node in ast.parse(info.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values[target.id] = node.value.value
    parts = (values.get("MAJOR"), values.get("MINOR"), values.get("PATCH"))
    return Version(".".join(map(str, parts)) + str(values.get("PRE_RELEASE") or ""))


def _megatron_file(*parts: str) -> Path | None:
    """A file of the installed megatron package, found without importing it."""
    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location).joinpath(*parts)
        if path.is_file():
            return path
    return None


def installed_te_version() -> Version | None:
    """The installed Transformer Engine version, or None (read from metadata, no import)."""
    return dist_version("transformer-engine", "transformer_engine", "transformer-engine-torch")


def has_optimizer_graph() -> bool | None:
    """Whether the installed megatron-core has ``OptimizerCudaGraphWrapper`` (None: no
    megatron-core found). Looks for the module file, without importing megatron-core."""
    if _megatron_file("core", "__init__.py") is None:
        return None
    return _megatron_file("core", "optimizer", "optimizer_cuda_graph.py") is not None


def _megatron_text(*parts: str) -> str | None:
    """The text of a file of the installed megatron package (None: not found or not
    readable), without importing it."""
    source = _megatron_file(*parts)
    if source is None:
        return None
    try:
        return source.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


@functools.cache
def _transformer_config_source() -> str | None:
    """The text of the installed megatron-core's ``transformer_config.py``, read once."""
    return _megatron_text("core", "transformer", "transformer_config.py")


@functools.cache
def mcore_spells_modules() -> bool | None:
    """Whether the installed megatron-core has 0.18+'s spelling (``cuda_graph_modules``, the
    ``full_iteration`` impl) in its ``TransformerConfig`` (None: no megatron-core found). Reads
    the module's text, without importing megatron-core."""
    text = _transformer_config_source()
    return None if text is None else "cuda_graph_modules" in text


@functools.cache
def mcore_te_samples_in_bf16() -> bool | None:
    """Whether the installed megatron-core builds every layer's TE-graph sample inputs as
    bfloat16, whatever the model's precision (``get_layer_static_inputs`` in
    ``transformer/module.py``: the 0.16 to 0.20 releases; its development branch takes the
    config's dtype since mid-2026). None: no megatron-core found. Reads the module's text,
    without importing megatron-core."""
    text = _megatron_text("core", "transformer", "module.py")
    if text is None:
        return None
    start = text.find("def get_layer_static_inputs")
    if start == -1:
        return False
    end = text.find("\n    def ", start + 1)
    return "dtype=torch.bfloat16" in text[start : end if end != -1 else len(text)]


def te_layers_need_bf16() -> bool:
    """TE layer graphs need bf16 layers here: the installed megatron-core builds their sample
    inputs as bfloat16 (:func:`mcore_te_samples_in_bf16`), or none was found to say (the
    released versions do)."""
    return mcore_te_samples_in_bf16() is not False


def full_iteration_scope_turns_graphs_on(s: Settings) -> bool:
    """``cuda_graph_impl`` none with ``full_iteration`` in the scope, where megatron-core reads
    that as graphs on: 0.18+ migrates this deprecated spelling to
    ``cuda_graph_impl=full_iteration``. So where the scope is written in 0.18+'s
    ``cuda_graph_modules``, or the installed megatron-core is 0.18+; with 0.16's spelling on
    0.16 it means graphs off (the scope is cleared, as any scope with graphs off)."""
    if s.impl != "none" or "full_iteration" not in s.scope:
        return False
    written_for_newer = s.paths.get("scope", "").endswith("cuda_graph_modules")
    return written_for_newer or bool(mcore_spells_modules())


@functools.cache
def mcore_offloads_with_full_iteration() -> bool:
    """Whether the installed megatron-core accepts CPU offloading with the full-iteration
    graph (0.19 refuses offloading only with per-layer graphs; 0.16.1 with any graph). Reads
    its ``TransformerConfig`` source for that condition, without importing megatron-core."""
    text = _transformer_config_source() or ""
    return 'self.cpu_offloading and self.cuda_graph_impl != "full_iteration"' in text


RECOMPUTE_MODULES_016 = (
    "core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts",
)  # fmt: skip
"""megatron-core 0.16.1's selective-recompute module names."""


@functools.cache
def mcore_recompute_modules() -> tuple[str, ...]:
    """The selective-recompute module names the installed megatron-core allows (its
    ``allowed_modules`` set, read from its ``TransformerConfig`` source without importing
    it; 0.16.1's where it cannot be read)."""
    text = _transformer_config_source() or ""
    start = text.find("allowed_modules = {")
    end = text.find("}", start)
    if start < 0 or end < 0:
        return RECOMPUTE_MODULES_016
    names = tuple(re.findall(r"[\"']([a-z_]+)[\"']", text[start:end]))
    return names or RECOMPUTE_MODULES_016


def newer_spelling_note(settings: Settings) -> str | None:
    """What to say where the host wrote 0.18+'s spelling and the installed megatron-core is
    older: the plugin reads it, but megatron-core itself (Megatron-LM's own arguments, a
    ``TransformerConfig`` the host builds from these fields) refuses it."""
    if not settings.newer_spelling or mcore_spells_modules() is not False:
        return None
    return (
        f"{' and '.join(settings.newer_spelling)}: megatron-core 0.18+'s spelling, which "
        f"megatron-core {mcore_version()} (installed here) does not know; the plugin reads it "
        f"as cuda_graph_impl={settings.impl} with cuda_graph_scope="
        f"{','.join(settings.scope) or '(empty)'} and configures megatron-core in its own "
        "spelling, but a host that hands these fields to megatron-core itself (Megatron-LM's "
        "own arguments, a TransformerConfig built from them) must write that instead"
    )


@dataclasses.dataclass(frozen=True)
class Environment:
    """The facts about the machine of the run that rules need: the Transformer Engine
    version to check against (None: not known here, so not checked) and where it came from
    (``"installed"`` or ``"given"``); and whether the run's files are written on this
    machine (``paths_here``: a check on a laptop or login node, where the run's filesystem
    may not be mounted, leaves the paths to the run)."""

    te_version: Version | None = None
    te_origin: str = INSTALLED
    paths_here: bool = True

    @classmethod
    def of(cls, te_version: Any = INSTALLED, origin: str = "given") -> Environment:
        """``te_version``: ``"installed"`` (read this machine's metadata), ``None`` (unknown)
        or a version to check against, such as ``"2.12"`` (given by ``origin``)."""
        if te_version == INSTALLED:
            return cls(installed_te_version(), INSTALLED)
        if te_version is None:
            return cls(None, origin)
        return cls(parse_te_version(te_version), origin)

    def te_label(self) -> str:
        return f"{self.te_origin}: {self.te_version}"


def parse_te_version(value: Any) -> Version:
    """A Transformer Engine version such as ``"2.12"``; ``ValueError`` with the fix if not."""
    if isinstance(value, Version):
        return value
    try:
        return Version(str(value).strip())
    except InvalidVersion:
        raise ValueError(f"{value!r} is not a version number: give one such as 2.12.0") from None


# -- the allocator and NCCL ----------------------------------------------------------------

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch >= 2.9 reads both
EXPANDABLE = "expandable_segments:True"
NCCL_PHRASE = (
    MCORE,
    "Setting NCCL_GRAPH_REGISTER=0 to avoid illegal memory access when using CUDA Graph with "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
)
TE_NOT_CHECKED = (
    "a run needs Transformer Engine (pip install 'megatron-cudagraph-plugin[te]'); not checked here"
)

Fact = bool | Callable[[], bool]


def expandable_segments_source(environ: Any) -> str | None:
    """The allocator variable that turns expandable segments on, if any."""
    for name in ALLOC_CONF_VARS:
        if EXPANDABLE in environ.get(name, ""):
            return name
    return None


def ask(fact: Fact) -> bool:
    """A fact given as a bool or as a query asked only when it matters."""
    return fact() if callable(fact) else fact


def once(fact: Fact) -> Fact:
    """``fact``, asked at most once however often it is needed."""
    if not callable(fact):
        return fact
    answers: list[bool] = []

    def answer() -> bool:
        if not answers:
            answers.append(fact())
        return answers[0]

    return answer


def nccl_register_fixable(
    settings: Settings, environ: Mapping[str, str], nccl_initialized: Fact
) -> str | None:
    """The allocator variable that needs ``NCCL_GRAPH_REGISTER=0`` when setting it now
    still takes effect (NCCL has not read its environment yet), else None."""
    if not settings.enabled:
        return None
    alloc_var = expandable_segments_source(environ)
    if alloc_var and environ.get("NCCL_GRAPH_REGISTER") is None and not ask(nccl_initialized):
        return alloc_var
    return None


def environment_problems(
    settings: Settings,
    environ: Mapping[str, str],
    *,
    nccl_initialized: Fact,
    te_available: Fact | None,
) -> tuple[list[Violation], list[str]]:
    """The environment's problems and notes for ``settings``; changes nothing.

    :param nccl_initialized: NCCL has already read its environment (or a query for it,
        asked only when it matters).
    :param te_available: Transformer Engine's graph support is usable (or a query, asked
        only for TE graphs); None: not known here.
    """
    violations: list[Violation] = []
    notes: list[str] = []
    if not settings.enabled:
        return violations, notes
    spelling = newer_spelling_note(settings)
    if spelling is not None:
        notes.append(spelling)
    alloc_var = expandable_segments_source(environ)
    register = environ.get("NCCL_GRAPH_REGISTER")
    if alloc_var and register is None and ask(nccl_initialized):
        violations.append(
            Violation(
                ("NCCL_GRAPH_REGISTER",),
                "unset",
                f"{alloc_var} has {EXPANDABLE}, so CUDA graphs need NCCL_GRAPH_REGISTER=0, "
                "but NCCL is already initialised and has read its environment",
                "export NCCL_GRAPH_REGISTER=0 before the process starts (or before "
                "init_process_group), or drop expandable_segments:True",
                (NCCL_PHRASE,),
            )
        )
    elif alloc_var and register is not None and register != "0":
        violations.append(
            Violation(
                ("NCCL_GRAPH_REGISTER", alloc_var),
                repr((register, environ[alloc_var])),
                f"{alloc_var} has {EXPANDABLE}, so CUDA graphs need NCCL_GRAPH_REGISTER=0 "
                "(NCCL's buffer registration otherwise makes illegal memory accesses)",
                "export NCCL_GRAPH_REGISTER=0, or drop expandable_segments:True",
                (NCCL_PHRASE,),
            )
        )
    if settings.impl == "transformer_engine":
        if te_available is None:
            notes.append(TE_NOT_CHECKED)
        elif not ask(te_available):
            violations.append(
                Violation(
                    (settings.field("impl"),),
                    repr(settings.impl),
                    "Transformer Engine with its PyTorch part is not importable here",
                    "pip install 'megatron-cudagraph-plugin[te]', or use cuda_graph_impl=local "
                    "with scope full_iteration",
                    ((MCORE, "CUDA Graphs are not supported without TE"),),
                )
            )
    return violations, notes
