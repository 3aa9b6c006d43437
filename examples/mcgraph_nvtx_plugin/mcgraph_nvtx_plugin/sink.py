"""The JSON Lines sink: one line per record, appended, flushed at once.

The path comes from the host's ``--nvtx-report-jsonl`` option (added by this plugin) or,
for hosts without a command line of their own, the ``MCGRAPH_NVTX_REPORT`` environment
variable. ``{rank}`` in the path expands to the ``RANK`` environment variable (``0``
without a launcher), so each rank of a multi-process run can write its own file. A path that
cannot be opened refuses the run with :class:`hookspecs.ConfigurationError`, which hosts say
without a traceback (exit status 2).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hookspecs import ConfigurationError

REPORT_ENV_VAR = "MCGRAPH_NVTX_REPORT"
"""Path of the JSONL file when the host has no ``--nvtx-report-jsonl`` option."""


def report_path(config: Any) -> Path | None:
    """The JSONL path for this run: the option first, then the environment variable."""
    raw = getattr(config, "nvtx_report_jsonl", None) or os.environ.get(REPORT_ENV_VAR)
    if not raw:
        return None
    return Path(str(raw).replace("{rank}", os.environ.get("RANK", "0")))


class JsonlSink:
    """An open JSONL file; every record is flushed so a crashed run keeps what it wrote."""

    def __init__(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8")
        except OSError as exc:
            raise ConfigurationError(
                f"mcgraph-nvtx-plugin cannot open its report file {str(path)!r}: "
                f"{exc.strerror or exc}; point --nvtx-report-jsonl (or {REPORT_ENV_VAR}) "
                "at a writable file"
            ) from exc
        self.path = path

    @property
    def closed(self) -> bool:
        return self._file.closed

    def write(self, record: dict[str, Any]) -> None:
        # default=str: the timeline carries whatever the host put in its hook arguments.
        self._file.write(json.dumps(record, sort_keys=True, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
