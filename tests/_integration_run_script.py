"""A rank of ``lowband run`` (tests/test_integrations_run.py): trains the given strategies through one
framework and through lowband's own loop, and writes this rank's loss sequences to FOLDER/rankR.json.

Usage: _integration_run_script.py lightning|accelerate|transformers FOLDER NAME[,NAME...]
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lowband


def main() -> None:
    framework, folder, names = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    lowband.init()
    module = importlib.import_module(f"test_integrations_{framework}")
    out = module.run_strategies(folder, names)
    Path(folder, f"rank{lowband.rank()}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
