"""``python -m lowband ...``: the ``lowband`` command (so ``lowband run -m lowband plan --measure`` runs it
on every rank)."""

import sys

from lowband.cli import main

if __name__ == "__main__":
    sys.exit(main())
