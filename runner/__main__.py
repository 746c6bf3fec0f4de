"""``python -m runner``: the launcher's command line (:mod:`runner.launcher.cli`), as ``mpitrain``."""

import sys

try:
    from runner.launcher.cli import run
except KeyboardInterrupt:  # a Ctrl-C while Python still imports the launcher: nothing started
    print("interrupted (SIGINT) while starting: no job was started", file=sys.stderr)
    sys.exit(130)

if __name__ == "__main__":
    run()
