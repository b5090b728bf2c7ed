"""What one ``lowband bench`` run does: a workload, strategies, a link setting, and the schedule."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowband.errors import InvalidArgumentError
from lowband.testbed.links import DEFAULT_MTU, Layout, build_layout, check_mtu

DEFAULT_STRATEGIES = ("ddp", "powersgd", "localsgd:period=5")


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

        for name in ("world_size", "rounds", "steps_per_round", "threads", "ranks_per_machine"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(f"{name} must be an int >= 1, got {v!r}")
        if isinstance(self.eval_items, bool) or not isinstance(self.eval_items, int) or self.eval_items < 0:
            raise bad(f"eval_items must be an int >= 0 (0: the whole test set), got {self.eval_items!r}")
        from lowband.bench.precision import check_device, check_grad_scaling, check_precision

        check_precision("lowband bench", self.precision, check_device("lowband bench", self.device))
        if not 0 <= self.warmup_rounds < self.rounds:
            raise bad(f"warmup_rounds must be in [0, rounds) = [0, {self.rounds}), got {self.warmup_rounds}")
        if self.collectives is not None:
            from lowband.bench.collectives import collective_names
            from lowband.strategies import parse_strategy_spec

            if not self.collectives:
                raise bad("give at least one collective")
            for spec in self.collectives:
                if parse_strategy_spec(spec)[0] not in collective_names():
                    raise bad(f"unknown collective {spec!r}; available: {', '.join(collective_names())}")
            if not self.sizes or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 4 for v in self.sizes
            ):
                raise bad(f"sizes must be byte counts >= 4, got {self.sizes}")
            if self.reps < 1:
                raise bad(f"reps must be >= 1, got {self.reps}")
            return
        if not self.strategies:
            raise bad("give at least one strategy")
        from lowband.bench.validate import check_strategy_specs, check_workload

        check_workload(self.workload)
        check_strategy_specs(self.strategies)
        if self.precision == "fp16":
            check_grad_scaling("lowband bench", self.strategies)
        if len(set(self.strategies)) != len(self.strategies):
            raise bad(f"strategies repeat: {self.strategies}")
        if self.world_size % self.ranks_per_machine:
            raise bad(f"ranks_per_machine={self.ranks_per_machine} must divide world_size={self.world_size}")
        if self.rates is not None and len(self.rates) != self.world_size // self.ranks_per_machine:
            raise bad(
                f"rates has {len(self.rates)} entries; need one per machine ({self.world_size // self.ranks_per_machine})"
            )
        check_mtu("lowband bench", self.mtu)
        self.layout()  # the rates parse (pure: nothing is built)
        if self.mode not in ("auto", "netns", "loopback"):
            raise bad(f"mode must be auto, netns or loopback, got {self.mode!r}")
        if self.batch_size is not None and self.batch_size < 1:
            raise bad(f"batch_size must be >= 1, got {self.batch_size}")
        if not 0 < self.comm_timeout < float("inf") or not self.delay_ms >= 0:
            raise bad(f"timeout must be > 0 and delay_ms >= 0, got {self.comm_timeout}, {self.delay_ms}")

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
