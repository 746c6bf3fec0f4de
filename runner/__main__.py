"""``python -m runner``: the launcher's command line (:mod:`runner.launcher.cli`), as ``mpitrain``."""

from runner.launcher.cli import run

if __name__ == "__main__":
    run()
