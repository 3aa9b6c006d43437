"""``python -m cudagraph_plugin check ...`` (see ``cudagraph_plugin.cli.check``)."""

from __future__ import annotations

import sys

from cudagraph_plugin.cli.check import run_check

USAGE = "usage: python -m cudagraph_plugin check [flags]   (check --help lists them)"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] != "check":
        print(f"unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    return run_check(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
