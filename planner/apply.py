"""``python -m planner.apply``: the command line under the name the README and users know.

The command line lives in :mod:`planner.cli` (``python -m planner.cli`` is the same command);
this module only runs it, so the entry point and the code stay in modules named for them.

    python -m planner.apply --help
"""

from __future__ import annotations

import sys

from planner.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
