"""Lightning's Trainer with ``LowbandStrategy`` trains as lowband's own loop does: at 2 ranks, for
powersgd, compressed (1-bit, two-stage), dreamddp, atc and embrace, the losses of 20 steps (two epochs)
equal the loop's (integration_fixtures.check), and a fit saved with ``Trainer.save_checkpoint`` after
the first epoch and resumed with ``fit(ckpt_path=...)`` continues exactly as the uninterrupted loop.
One launch of 2 processes runs every strategy (torch and Lightning imported once per rank)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

import integration_fixtures as fx  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lowband  # noqa: E402
from lowband.errors import InvalidArgumentError  # noqa: E402
from lowband.integrations import strategy_folder  # noqa: E402
from lowband.integrations.lightning import LowbandStrategy  # noqa: E402
from lowband.strategies.checkpoint import rank_file  # noqa: E402
from lowband.testing import run_processes  # noqa: E402


class LitNet(pl.LightningModule):
    """The fixtures' Net as a LightningModule; records every training step's loss."""

    def __init__(self, manual: bool = False, scheduled: bool = False) -> None:
        super().__init__()
        self.net = fx.init_net(fx.Net())
        self.losses: list[float] = []
        self.automatic_optimization = not manual
        self.scheduled = scheduled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = fx.loss_of(self(x), y)
        self.losses.append(float(loss.detach()))
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        opt.step()  # type: ignore[union-attr]
        return None

    def configure_optimizers(self) -> Any:
        opt = fx.optimizer(self.parameters())
        if not self.scheduled:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": fx.step_lr(opt), "interval": "step"}}


def loader(rank: int) -> DataLoader[Any]:
    return DataLoader(TensorDataset(*fx.rank_data(rank)), batch_size=fx.BATCH, shuffle=False)


def trainer(strategy: LowbandStrategy, epochs: int, devices: int | None = None, **kwargs: Any) -> Any:
    """A Trainer of ``devices`` ranks on one machine (given: Lightning's own launcher starts them), else of
    the launcher's ranks (torchrun, lowband run: ranks per machine and machines from the environment)."""
    nodes = 1
    if devices is None:
        devices = int(os.environ.get("LOCAL_WORLD_SIZE", lowband.size()))
        nodes = lowband.size() // devices
    return pl.Trainer(
        accelerator="cpu", devices=devices, num_nodes=nodes, strategy=strategy, max_epochs=epochs,
        use_distributed_sampler=False, enable_checkpointing=False, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kwargs,
    )  # fmt: skip


def _fit(name: str, folder: str, epochs: int, ckpt: str | None = None, **kwargs: Any) -> LitNet:
    model = LitNet(manual=kwargs.pop("manual", False), scheduled=kwargs.pop("scheduled", False))
    strategy = LowbandStrategy(name, **fx.options(name, folder))
    trainer(strategy, epochs, **kwargs).fit(model, loader(lowband.rank()), ckpt_path=ckpt)
    return model


def run_strategies(
    folder: str, names: list[str], scheduled: bool = False
) -> dict[str, dict[str, list[float]]]:
    """The reference, a fit of 20 steps, a fit of the first epoch saved and one resumed, per strategy
    (``scheduled``: with fx.step_lr stepped every step)."""
    rank = lowband.rank()
    out: dict[str, dict[str, list[float]]] = {}
    for name in names:
        ref = fx.reference(name, folder, scheduled=scheduled)
        whole = _fit(name, folder, 2, scheduled=scheduled).losses
        # first epoch, saved; a fresh model and trainer resume the second
        model = LitNet(scheduled=scheduled)
        strategy = LowbandStrategy(name, **fx.options(name, folder))
        tr = trainer(strategy, 1)
        tr.fit(model, loader(rank))
        ckpt = str(Path(folder) / f"{name}{'-scheduled' if scheduled else ''}.ckpt")
        tr.save_checkpoint(ckpt)
        assert rank_file(strategy_folder(ckpt), rank, lowband.size()).is_file()
        resumed = _fit(name, folder, 2, ckpt=ckpt, scheduled=scheduled).losses
        out[name] = {"ref": ref, "whole": whole, "first": model.losses, "resumed": resumed}
        assert strategy.lowband is not None
        strategy.lowband.close()
    return out


def _every_strategy(folder: str) -> dict[str, dict[str, list[float]]]:
    out = run_strategies(folder, list(fx.STRATEGIES))
    # a learning-rate scheduler on a strategy that regroups the parameters (one group per layer)
    out["scheduled"] = run_strategies(folder, ["atc"], scheduled=True)["atc"]
    # manual optimisation; Lightning's accumulation, clipping and bf16 precision plugin
    out["manual"] = {"ref": out["powersgd"]["ref"], "whole": _fit("powersgd", folder, 2, manual=True).losses}
    out["accumulate"] = {
        "ref": fx.reference("compressed", folder, accumulate=2),
        "whole": _fit("compressed", folder, 2, accumulate_grad_batches=2).losses,
    }
    out["clip"] = {
        "ref": fx.reference("powersgd", folder, clip=0.05),
        "whole": _fit("powersgd", folder, 2, gradient_clip_val=0.05).losses,
    }
    out["bf16"] = {
        "ref": fx.reference("dreamddp", folder, bf16=True),
        "whole": _fit("dreamddp", folder, 2, precision="bf16-mixed").losses,
    }
    return out


_RESULTS: dict[str, list[dict[str, dict[str, list[float]]]]] = {}


def _results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, list[float]]]]:
    if "r" not in _RESULTS:
        folder = str(tmp_path_factory.mktemp("lightning"))
        _RESULTS["r"] = run_processes(_every_strategy, 2, folder, timeout=600, comm_timeout=120)
    return _RESULTS["r"]


def check_result(name: str, r: dict[str, list[float]], where: str) -> None:
    fx.check(name, r["whole"], r["ref"], f"{where}: fit of 20 steps")
    fx.check(name, r["first"], r["ref"][: fx.EPOCH], f"{where}: first epoch")
    resumed = fx.without_replay(name, r["resumed"], where)
    fx.check(name, resumed, r["ref"][fx.EPOCH :], f"{where}: resumed from Trainer.save_checkpoint")


@pytest.mark.parametrize("name", list(fx.STRATEGIES))
def test_lightning_trains_as_the_loop(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    for rank, res in enumerate(_results(tmp_path_factory)):
        check_result(name, res[name], f"lightning {name} rank {rank}")


@pytest.mark.parametrize(
    "case,name",
    [("manual", "powersgd"), ("accumulate", "compressed"), ("clip", "powersgd"), ("bf16", "dreamddp")],
)
def test_lightning_options_map_onto_the_loop(
    case: str, name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Manual optimisation, accumulate_grad_batches=2, gradient_clip_val and precision="bf16-mixed" train
    as the loop does with accumulate=2, s.clip_grad_norm_ and the forward under bf16 autocast."""
    for rank, res in enumerate(_results(tmp_path_factory)):
        fx.check(name, res[case]["whole"], res[case]["ref"], f"lightning {case} ({name}) rank {rank}")


def test_lightning_lr_scheduler_drives_the_strategy_optimizer(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """StepLR from configure_optimizers (interval "step") on atc, whose optimizer has one group per layer,
    trains as the loop with StepLR on the strategy's optimizer, and resumes with its state."""
    for rank, res in enumerate(_results(tmp_path_factory)):
        check_result("atc", res["scheduled"], f"lightning scheduled atc rank {rank}")


def test_lightning_strategy_checks_its_options_first() -> None:
    with pytest.raises(InvalidArgumentError, match="period"):
        LowbandStrategy("dreamddp", perod=5)
    with pytest.raises(InvalidArgumentError, match="unknown strategy"):
        LowbandStrategy("dreamdpp")
