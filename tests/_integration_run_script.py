"""A rank of an integration run started by a launcher (tests/test_integrations_run.py): trains the given
strategies through one framework and through lowband's own loop, and writes this rank's loss sequences
to FOLDER/rankR.json.

Usage: _integration_run_script.py lightning|accelerate|transformers|lightning-launcher FOLDER NAME[,...]

``lightning-launcher``: started as a plain script, Lightning's own launcher (``devices=2``) starts the
second rank; each rank's fit comes first (it makes the process group), lowband's loop after it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import integration_fixtures as fx

import lowband


def lightning_launched(folder: str, names: list[str]) -> dict[str, dict[str, list[float]]]:
    import test_integrations_lightning as t

    rank = int(os.environ.get("LOCAL_RANK", "0"))  # set by Lightning's launcher in the ranks it starts
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        model = t.LitNet()
        t.trainer(t.LowbandStrategy(name, **fx.options(name, folder)), 2, devices=2).fit(
            model, t.loader(rank)
        )
        out[name] = {"whole": model.losses, "ref": fx.reference(name, folder)}
    return out


def main() -> None:
    framework, folder, names = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    if framework == "lightning-launcher":
        out = lightning_launched(folder, names)
    else:
        lowband.init()
        out = importlib.import_module(f"test_integrations_{framework}").run_strategies(folder, names)
    Path(folder, f"rank{lowband.rank()}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
