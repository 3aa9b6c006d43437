"""Deprecated: ``cudagraph_plugin.validation`` moved into ``cudagraph_plugin.config``;
the old path re-exports the same objects for one release (0.1.x) and warns on
import. The names now live in:

* ``cudagraph_plugin.config.advice``
* ``cudagraph_plugin.config.environment``
* ``cudagraph_plugin.config.errors``
* ``cudagraph_plugin.config.fixes``
* ``cudagraph_plugin.config.rules``
* ``cudagraph_plugin.config.rules.base``
* ``cudagraph_plugin.config.vocabulary``
"""

from __future__ import annotations

import warnings

from cudagraph_plugin.config.advice import (
    RECOMMENDED_SCOPES,
    advice,
    warmup_warning,
)
from cudagraph_plugin.config.environment import (
    ALLOC_CONF_VARS,
    EXPANDABLE,
    INSTALLED,
    Environment,
    expandable_segments_source,
    parse_te_version,
)
from cudagraph_plugin.config.errors import (
    BRIDGE,
    MCORE,
    MCORE_16,
    MCORE_19,
    MLM,
    CudaGraphConfigError,
    Note,
    Violation,
)
from cudagraph_plugin.config.fixes import (
    AutoFix,
    apply_autofixes,
    plan_autofixes,
    settings_after,
    write_fixes,
)
from cudagraph_plugin.config.rules import (
    evaluate,
    find_violations,
    validate,
)
from cudagraph_plugin.config.rules.base import (
    Rule,
)
from cudagraph_plugin.config.vocabulary import (
    MOE_SCOPES,
    TE_SCOPES,
)

write_autofixes = write_fixes  # its old name

warnings.warn(
    "cudagraph_plugin.validation is deprecated (moved into cudagraph_plugin.config) "
    "and goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "ALLOC_CONF_VARS",
    "BRIDGE",
    "EXPANDABLE",
    "INSTALLED",
    "MCORE",
    "MCORE_16",
    "MCORE_19",
    "MLM",
    "MOE_SCOPES",
    "RECOMMENDED_SCOPES",
    "TE_SCOPES",
    "AutoFix",
    "CudaGraphConfigError",
    "Environment",
    "Note",
    "Rule",
    "Violation",
    "advice",
    "apply_autofixes",
    "evaluate",
    "expandable_segments_source",
    "find_violations",
    "parse_te_version",
    "plan_autofixes",
    "settings_after",
    "validate",
    "warmup_warning",
    "write_autofixes",
    "write_fixes",
]
