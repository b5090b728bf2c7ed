"""What one ``lowband bench`` run does: a workload, strategies, a link setting, and the schedule."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowband.errors import InvalidArgumentError
from lowband.options import Opt, Options, Rule
from lowband.testbed.links import DEFAULT_MTU, Layout, build_layout, check_mtu

DEFAULT_STRATEGIES = ("ddp", "powersgd", "localsgd:period=5")

#: the bench's own numbers and choices (:mod:`lowband.options`); the rates, MTU, device, precision,
#: workload and strategies are checked by the functions that parse them
SETTINGS = Options(
    {
        "world_size": Opt(int, min=1, doc="ranks"),
        "rounds": Opt(int, min=1, doc="rounds, strategies alternated in each"),
        "steps_per_round": Opt(int, min=1, doc="steps of each strategy per round"),
        "warmup_rounds": Opt(int, min=0, doc="first rounds left out of the timing statistics"),
        "threads": Opt(int, min=1, doc="torch threads per rank"),
        "ranks_per_machine": Opt(int, min=1, doc="ranks sharing a machine (two-tier layout)"),
        "eval_items": Opt(int, min=0, doc="held-out items evaluated after each round (0: all)"),
        "batch_size": Opt(int, None, min=1, doc="per-rank batch (None: the workload's)"),
        "delay_ms": Opt(float, min=0, doc="one-way delay per rank"),
        "comm_timeout": Opt(float, gt=0, doc="communication timeout (seconds)"),
        "mode": Opt(str, choices=("auto", "netns", "loopback"), doc="the testbed"),
        "reps": Opt(int, min=1, doc="timed ops per op, size and round (--collectives)"),
    },
    rules=[
        Rule(
            ("warmup_rounds", "rounds"), "warmup_rounds must be in [0, rounds)",
            lambda o: o["warmup_rounds"] < o["rounds"],
        ),
        Rule(
            ("ranks_per_machine", "world_size"), "ranks_per_machine must divide world_size",
            lambda o: o["world_size"] % o["ranks_per_machine"] == 0,
        ),
    ],
)  # fmt: skip
_SIZE = Opt(int, min=4, what="a byte count")


#: the default wall-clock cap on one bench (``lowband bench --time-limit``): a backstop, every
#: communication has its own timeout. 6 h: 600 steps of 4 strategies and the compute-only run on a 27 MB
#: model at 10 Mbit/s take over an hour here.
TIME_LIMIT_S = 6 * 3600.0


@dataclass
class BenchConfig:
    workload: str = "fmnist-cnn"
    strategies: list[str] = field(default_factory=lambda: list(DEFAULT_STRATEGIES))
    world_size: int = 4
    #: per-rank link rate ("100mbit"); None = unshaped. ``rates`` (one per machine) overrides it.
    rate: str | None = "100mbit"
    rates: list[str] | None = None
    ranks_per_machine: int = 1
    intra_rate: str | None = None
    delay_ms: float = 0.0
    #: MTU of the emulated links (see lowband.testbed.links.DEFAULT_MTU)
    mtu: int = DEFAULT_MTU
    #: "auto" (network namespaces when root, else loopback), "netns" or "loopback"
    mode: str = "auto"
    batch_size: int | None = None
    lr: float | None = None
    rounds: int = 4
    steps_per_round: int = 20
    #: the first ``warmup_rounds`` rounds train but are left out of the timing statistics
    warmup_rounds: int = 1
    #: held-out items evaluated after each round (0: the whole test set)
    eval_items: int = 500
    seed: int = 0
    target_loss: float | None = None
    #: strategy (label or name) the speed-up ratios are computed against; default: every baseline present
    baselines: list[str] = field(default_factory=lambda: ["ddp", "localsgd"])
    threads: int = 1
    #: where each rank computes: "auto" (cuda when available, else cpu), "cpu" or "cuda" (cuda:LOCAL_RANK)
    device: str = "auto"
    #: "fp32", or "bf16" / "fp16" autocast (float32 parameters; fp16 with a loss scaler)
    precision: str = "fp32"
    comm_timeout: float = 120.0
    out_dir: str = "results/bench"
    #: collectives mode (``lowband bench --collectives``): time these ops instead of training
    collectives: list[str] | None = None
    #: message sizes in bytes for the collectives mode; each timed ``reps`` times per round
    sizes: list[int] = field(default_factory=lambda: [1_000_000, 4_000_000, 16_000_000])
    reps: int = 5
    #: link drift (``--rate-change``, :mod:`lowband.testbed.schedule`): "30s:m1=10mbit,...", seconds
    #: after the ranks are launched
    rate_change: str | None = None

    def layout(self) -> Layout:
        """The link layout this run asks for (pure: parses the rates, builds nothing)."""
        return build_layout(
            self.world_size,
            rate=self.rate,
            rates=self.rates,
            ranks_per_machine=self.ranks_per_machine,
            intra_rate=self.intra_rate,
            delay_ms=self.delay_ms,
            where="lowband bench",
        )

    def validate(self) -> None:
        def bad(what: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"lowband bench: {what}")

        SETTINGS.check("lowband bench", {k: getattr(self, k) for k in SETTINGS.names()})
        from lowband.bench.precision import check_device, check_grad_scaling, check_precision

        check_precision("lowband bench", self.precision, check_device("lowband bench", self.device))
        if self.collectives is not None:
            from lowband.bench.collectives import check_collective

            if not self.collectives:
                raise bad("give at least one collective")
            for spec in self.collectives:
                check_collective(spec)  # the name and the options, by the op's schema
            self._check_rate_change()
            if not self.sizes:
                raise bad("give at least one message size")
            for v in self.sizes:
                _SIZE.convert("lowband bench", "each of sizes", v)
            return
        if not self.strategies:
            raise bad("give at least one strategy")
        from lowband.bench.validate import check_fixed_steps, check_strategy_specs, check_workload

        check_workload(self.workload)
        check_strategy_specs(self.strategies)
        check_fixed_steps(self.strategies)
        if self.precision == "fp16":
            check_grad_scaling("lowband bench", self.strategies)
        if len(set(self.strategies)) != len(self.strategies):
            raise bad(f"strategies repeat: {self.strategies}")
        if self.rates is not None and len(self.rates) != self.world_size // self.ranks_per_machine:
            raise bad(
                f"rates has {len(self.rates)} entries; need one per machine ({self.world_size // self.ranks_per_machine})"
            )
        check_mtu("lowband bench", self.mtu)
        self._check_rate_change()

    def _check_rate_change(self) -> None:
        from lowband.testbed.schedule import check_spec

        if self.rate_change:
            check_spec(
                self.rate_change, self.layout(), self.mode, "lowband bench: --rate-change", probe=False
            )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BenchConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidArgumentError(f"bench config: unknown keys {unknown}")
        return cls(**d)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: Path) -> BenchConfig:
        return cls.from_json(json.loads(path.read_text()))
