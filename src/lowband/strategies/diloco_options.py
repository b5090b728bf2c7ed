"""The ``diloco`` strategy's options (:mod:`lowband.strategies.diloco`): the outer optimizer spec and
the schema every rank's options are checked against."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowband.compress.specs import REDUCER_OPTIONS
from lowband.errors import InvalidArgumentError
from lowband.options import Opt, Options
from lowband.registry import parse_spec
from lowband.topology import DynamicTopology, Topology
from lowband.topology.names import TOPOLOGIES

#: the outer optimizers a spec can name
OUTER: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}
DEFAULT_OUTER = "sgd:lr=0.7;momentum=0.9;nesterov=true"


def parse_outer(spec: object) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """``name:key=value;...`` -> (optimizer class, options), checked by building it on one tensor."""
    name, opts = parse_spec(str(spec), "outer optimizer", semicolons=True)
    cls = OUTER.get(name)
    if cls is None:
        raise InvalidArgumentError(f"outer optimizer {name!r} is not one of {sorted(OUTER)}")
    try:
        cls([nn.Parameter(torch.zeros(1))], **opts)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"outer optimizer spec {spec!r}: {exc}") from exc
    return cls, opts


#: the options of ``diloco`` (the compression framework's reducer options included)
DILOCO_OPTIONS = (
    Options(
        {
            "inner_steps": Opt(
                int, min=1, unit="steps", doc="H: inner optimizer steps between two outer steps"
            ),
            "outer": Opt(
                str,
                parse=parse_outer,
                doc=f"the outer optimizer on the averaged pseudo-gradient, name:key=value;... with name one of "
                f"{sorted(OUTER)} (default {DEFAULT_OUTER}, the paper's)",
            ),
            "fragments": Opt(
                int, min=1, doc="F: fragments synchronised at staggered inner steps (Streaming DiLoCo)"
            ),
            "delay": Opt(
                int, min=0, unit="steps", doc="tau: inner steps between a fragment's send and its update"
            ),
            "alpha": Opt(
                float, min=0, max=1, doc="mixing of the local fragment into the new global one (0: replace)"
            ),
            "topology": Opt(
                str,
                choices=("none", *TOPOLOGIES),
                objects=(Topology, DynamicTopology),
                doc="none: the all-rank average; else a decentralised outer step, each rank averaging its "
                "pseudo-gradient with its neighbours in this graph (dynamic-exp2: one peer per exchange)",
            ),
            "inner": Opt(
                str,
                choices=("local", "ddp"),
                doc="local: each rank alone; ddp: the ranks of a machine average gradients every inner step "
                "(over the machine's link) and only the machines' first ranks run the outer exchange",
            ),
        }
    )
    | REDUCER_OPTIONS
)

__all__ = ["DEFAULT_OUTER", "DILOCO_OPTIONS", "OUTER", "parse_outer"]
