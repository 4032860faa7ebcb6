"""``python -m planner``: the same command as ``python -m planner.apply`` and ``sac-plan``.

The command line lives in :mod:`planner.cli`; this module only runs it, so that the package name a
newcomer types first reaches it instead of Python's "No module named planner.__main__".

    python -m planner --help
"""

from __future__ import annotations

import sys

from planner.cli import main

if __name__ == "__main__":
    sys.exit(main())
