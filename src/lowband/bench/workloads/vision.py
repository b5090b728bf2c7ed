"""Image classification workloads: a small CNN and a small ResNet on Fashion-MNIST (digits fallback)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lowband.bench.workloads.base import (
    Batch,
    DatasetWorkload,
    count_params,
    resolve_lr,
    seeded_init,
    to_device,
)
from lowband.bench.workloads.images import NUM_CLASSES, ImageData, load_images
from lowband.errors import InvalidArgumentError


class SmallCNN(nn.Module):
    """Two 3x3 conv blocks (40, 80 channels, each followed by 2x2 max-pooling) and a 2-layer classifier."""

    def __init__(self, num_classes: int = NUM_CLASSES, width: int = 40, hidden: int = 128) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc1 = nn.Linear(2 * width * 7 * 7, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # 28 -> 14
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # 14 -> 7
        logits: torch.Tensor = self.fc2(F.relu(self.fc1(x.flatten(1))))
        return logits


class BasicBlock(nn.Module):
    """The ResNet basic block: two 3x3 conv + batch-norm, with a 1x1 projection when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """A CIFAR-style ResNet for 28x28 grey images: a stem, one BasicBlock per stage, global pooling."""

    def __init__(self, num_classes: int = NUM_CLASSES, widths: tuple[int, ...] = (32, 64, 128)) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0])
        )
        blocks: list[nn.Module] = []
        cin = widths[0]
        for i, w in enumerate(widths):
            blocks.append(BasicBlock(cin, w, stride=1 if i == 0 else 2))
            cin = w
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.stem(x)), 2)  # 28 -> 14
        x = self.blocks(x)
        logits: torch.Tensor = self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        return logits


_MODELS: dict[str, tuple[str, Callable[[], nn.Module]]] = {
    "cnn": ("CNN", SmallCNN),
    "resnet": ("ResNet", SmallResNet),
}


class ImageWorkload(DatasetWorkload):
    """Image classification: cross-entropy, SGD with momentum 0.9, top-1 accuracy.

    ``dataset`` is ``"auto"`` (Fashion-MNIST if its files are in ``data_dir``, else scikit-learn digits),
    ``"fashion-mnist"`` or ``"digits"``.
    """

    unit = "samples"
    default_batch_size = 32

    def __init__(
        self,
        model: str,
        name: str,
        *,
        dataset: str = "auto",
        data_dir: str | Path | None = None,
        lr: float = 0.02,
    ) -> None:
        if model not in _MODELS:
            raise InvalidArgumentError(
                f"image workload model {model!r} is unknown; choose one of {sorted(_MODELS)}"
            )
        self.name = name
        self.default_lr = float(lr)  # options checked by the workload's schema (get_workload)
        self.model_kind = model
        self.data: ImageData = load_images(dataset, data_dir)

    def describe(self) -> str:
        label, factory = _MODELS[self.model_kind]
        params = count_params(seeded_init(self.name, factory, 0))
        sizes = f"{self.num_train} train / {self.num_test} test"
        return f"{self.data.name} ({sizes}), {label} {params / 1e6:.2f} M params"

    def build_model(self, seed: int) -> nn.Module:
        return seeded_init(f"{self.name}.build_model", _MODELS[self.model_kind][1], seed)

    def make_optimizer(
        self, params: Iterable[nn.Parameter], lr: float | None = None
    ) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            params, lr=resolve_lr(f"{self.name}.make_optimizer", lr, self.default_lr), momentum=0.9
        )

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = to_device(model, batch)
        return F.cross_entropy(model(x), y)

    def items(self, batch: Batch) -> int:
        return int(batch[1].shape[0])

    def _num_train(self) -> int:
        return int(self.data.train_y.shape[0])

    def _num_test(self) -> int:
        return int(self.data.test_y.shape[0])

    def _train_batch(self, idx: torch.Tensor) -> Batch:
        return self.data.normalise(self.data.train_x[idx]), self.data.train_y[idx]

    def _test_batch(self, idx: torch.Tensor) -> Batch:
        return self.data.normalise(self.data.test_x[idx]), self.data.test_y[idx]

    def _eval_batch(self, model: nn.Module, batch: Batch) -> tuple[float, int | None]:
        x, y = to_device(model, batch)
        logits = model(x)
        loss = F.cross_entropy(logits, y, reduction="sum")
        return float(loss), int((logits.argmax(dim=1) == y).sum())
