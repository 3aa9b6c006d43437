"""mcgraph-nvtx-plugin: NVTX ranges, memory log lines and a JSONL report sink.

An example of a third-party plugin for Megatron-Core training loops that host mcgraph
plugins. It is a separate distribution that registers under the ``mcgraph`` entry-point
group and depends only on the public hook contract (``hookspecs``, from the
``mcgraph-hookspecs`` distribution) and torch.

Modules:

* ``plugin`` — the entry-point module (group ``mcgraph``, name ``nvtx``): adds
  ``--nvtx-report-jsonl`` and registers one :class:`~mcgraph_nvtx_plugin.tracer.RunTracer`
  per run.
* ``tracer`` — the hook implementations of one run: NVTX ranges, memory log lines and
  the event timeline.
* ``sink`` — where the report and the timeline go: a JSON Lines file.
"""

from __future__ import annotations

__version__ = "0.1.0"
