"""The `hetpipe` console script: launch.cli's main behind its imports, which take a second
(torch); Ctrl-C during them ends the command as it does later, in one line with exit 130."""

from __future__ import annotations

import sys

EXIT_INTERRUPTED = 130


def main() -> int:
    try:
        from launch.cli import main as cli_main
    except KeyboardInterrupt:
        print("hetpipe: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return cli_main()
