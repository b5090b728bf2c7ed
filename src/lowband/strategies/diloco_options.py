"""The ``diloco`` strategy's options (:mod:`lowband.strategies.diloco`): the outer optimizer spec and
the schema every rank's options are checked against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowband.compress.specs import REDUCER_OPTIONS
from lowband.errors import InvalidArgumentError
from lowband.localsgd.costmodel import CostProfile
from lowband.options import Opt, Options, Rule
from lowband.registry import parse_spec
from lowband.strategies.peer_loss import PEER_LOSS_OPTIONS
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
                int,
                min=1,
                words=("auto",),
                unit="steps",
                doc="H: inner optimizer steps between two outer steps; auto: per machine, those fitting the "
                "time the slowest machine takes for base_steps (measured over the first period; machines "
                "within 10 % of each other keep base_steps), the outer average weighted by each machine's steps",
            ),
            "base_steps": Opt(
                int,
                min=1,
                unit="steps",
                doc="with inner_steps=auto: the slowest machine's inner steps per period",
            ),
            "machine_steps": Opt(
                str,
                doc="with inner_steps=auto: fixed inner steps per machine, comma separated (e.g. 20,40,40,40), "
                "instead of measuring",
            ),
            "profile": Opt(
                str,
                objects=(Path, CostProfile),
                what="a JSON path",
                doc="with fragments=auto: DreamDDP's cost profile to choose from (a missing file: measured at "
                "the first step and saved there; none: measured at the first step)",
            ),
            "outer": Opt(
                str,
                parse=parse_outer,
                doc=f"the outer optimizer on the averaged pseudo-gradient, name:key=value;... with name one of "
                f"{sorted(OUTER)} (default {DEFAULT_OUTER}, the paper's)",
            ),
            "fragments": Opt(
                int,
                min=1,
                words=("auto",),
                doc="F: fragments synchronised at staggered inner steps (Streaming DiLoCo); auto: the fewest "
                "whose exchanges (the profile's alpha + beta * bytes, compressed) are hidden by the delay "
                "steps' compute, else the fewest with the least exposed time",
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
        },
        rules=[
            Rule(
                ("fragments", "delay"),
                "fragments=auto needs delay >= 1 (an exchange overlaps the delay steps before it is applied)",
                lambda o: o["fragments"] != "auto" or o["delay"] >= 1,
            ),
            Rule(
                ("fragments", "topology"),
                "fragments=auto models the all-rank average's link (topology=none)",
                lambda o: o["fragments"] != "auto" or _no_topology(o["topology"]),
            ),
            Rule(
                ("fragments", "inner", "profile"),
                "fragments=auto with inner=ddp needs profile= (the link between machines is not the one "
                "a profile at the first step measures)",
                lambda o: o["fragments"] != "auto" or o["inner"] != "ddp" or o["profile"] is not None,
            ),
            Rule(
                ("fragments", "profile"),
                "profile= is read by fragments=auto only",
                lambda o: o["fragments"] == "auto" or o["profile"] is None,
            ),
            Rule(
                ("inner_steps", "topology"),
                "inner_steps=auto weights the all-rank average (topology=none)",
                lambda o: o["inner_steps"] != "auto" or _no_topology(o["topology"]),
            ),
            Rule(
                ("inner_steps", "machine_steps"),
                "machine_steps= goes with inner_steps=auto",
                lambda o: o["inner_steps"] == "auto" or o["machine_steps"] is None,
            ),
        ],
    )
    | REDUCER_OPTIONS
    | PEER_LOSS_OPTIONS
)
DILOCO_OPTIONS = Options(
    DILOCO_OPTIONS.opts,
    [
        *DILOCO_OPTIONS.rules,
        Rule(
            ("on_peer_loss", "inner", "topology", "compressor", "delay", "fragments", "inner_steps"),
            "on_peer_loss=continue goes with inner=local, topology=none, compressor=identity, delay=0 and "
            "fixed fragments and inner_steps (the failed exchange is redone from the ranks' unchanged state)",
            lambda o: (
                o["on_peer_loss"] != "continue"
                or (
                    o["inner"] == "local"
                    and _no_topology(o["topology"])
                    and o["compressor"] == "identity"
                    and o["delay"] == 0
                    and o["fragments"] != "auto"
                    and o["inner_steps"] != "auto"
                )
            ),
        ),
    ],
)


def _no_topology(topology: object) -> bool:
    return isinstance(topology, str) and topology == "none"


__all__ = ["DEFAULT_OUTER", "DILOCO_OPTIONS", "OUTER", "parse_outer"]
