"""mcgraph-probe: a plugin written from the docs alone, for the suite's contract tests.

It records every hook it sees, in order, as JSON lines in ``$MCGRAPH_PROBE_OUT`` (and as
log lines of logger ``mcgraph_probe``), with one shutdown implementation in each of the
documented layers: a ``tryfirst`` wrapper, a ``trylast`` wrapper and a plain one.
``MCGRAPH_PROBE_FAIL_AT=HOOK`` makes it raise in that hook.
"""

from __future__ import annotations

__version__ = "0.1.0"
