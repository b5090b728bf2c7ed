"""Offline image-classification data: Fashion-MNIST from its idx files, scikit-learn digits as a fallback.

Fashion-MNIST comes from the Debian package ``dataset-fashion-mnist``
(``/usr/share/datasets/fashion-mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz``), parsed here
with gzip + numpy. Where those files are absent, scikit-learn's bundled 8x8 digits (1,797 images, 10
classes) stand in, upsampled to 28x28 so that the same models apply. Images are kept as uint8 and
normalised per batch; every load is cached in-process.
"""

from __future__ import annotations

import functools
import gzip
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from lowband.errors import InvalidArgumentError, LowbandError

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
IMAGE_SIZE = 28
NUM_CLASSES = 10
_DIGITS_TEST = 297  # held-out digits (1,500 train / 297 test), a fixed seeded split
_DIGITS_SPLIT_SEED = 1797


class DatasetUnavailableError(LowbandError):
    """A dataset a workload needs is not installed on this machine."""


@dataclass(frozen=True)
class ImageData:
    """Images as uint8 ``(N, 1, 28, 28)`` and int64 labels, split into train and test."""

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    mean: float  # of the training pixels scaled to [0, 1]
    std: float

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 images -> float32, zero mean and unit variance over the training set."""
        return (x.float().div_(255.0) - self.mean) / self.std


def _read_idx(path: Path) -> np.ndarray:
    """Parse one gzip'd idx file (big-endian header: magic 0x0000 08 <ndim>, then the dimensions)."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DatasetUnavailableError(f"{path}: not an idx file of unsigned bytes (magic {raw[:4].hex()})")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    offset = 4 + 4 * ndim
    expected = int(np.prod(dims))
    if len(raw) - offset != expected:
        raise DatasetUnavailableError(
            f"{path}: header says {dims} ({expected} bytes), file holds {len(raw) - offset}"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=offset).reshape(dims)


def _fashion_files(directory: Path) -> dict[str, Path]:
    return {
        f"{split}_{kind}": directory / f"{prefix}-{kind_name}-ubyte.gz"
        for split, prefix in (("train", "train"), ("test", "t10k"))
        for kind, kind_name in (("x", "images-idx3"), ("y", "labels-idx1"))
    }


def fashion_mnist_available(directory: Path) -> bool:
    """Whether all four Fashion-MNIST idx files exist in ``directory``."""
    return all(p.is_file() for p in _fashion_files(directory).values())


def _stats(train_x: torch.Tensor) -> tuple[float, float]:
    scaled = train_x.double() / 255.0
    return float(scaled.mean()), float(scaled.std())


@functools.lru_cache(maxsize=4)
def load_fashion_mnist(directory: Path) -> ImageData:
    """Fashion-MNIST (60,000 train / 10,000 test) from the idx files in ``directory``."""
    files = _fashion_files(directory)
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise DatasetUnavailableError(
            f"Fashion-MNIST files missing: {', '.join(missing)} "
            "(install the Debian package dataset-fashion-mnist)"
        )
    arrays = {k: torch.from_numpy(_read_idx(p).copy()) for k, p in files.items()}
    for split in ("train", "test"):
        x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
        if x.dim() != 3 or x.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE) or y.shape != (x.shape[0],):
            raise DatasetUnavailableError(
                f"Fashion-MNIST {split}: unexpected shapes {tuple(x.shape)}, {tuple(y.shape)}"
            )
    train_x = arrays["train_x"].unsqueeze(1)
    mean, std = _stats(train_x)
    return ImageData(
        name="Fashion-MNIST",
        train_x=train_x,
        train_y=arrays["train_y"].long(),
        test_x=arrays["test_x"].unsqueeze(1),
        test_y=arrays["test_y"].long(),
        mean=mean,
        std=std,
    )


@functools.lru_cache(maxsize=1)
def load_digits_28() -> ImageData:
    """scikit-learn's 8x8 digits upsampled (bilinear) to 28x28 uint8, split 1,500 / 297 with a fixed seed."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    small = torch.from_numpy(digits.images.astype(np.float32)).unsqueeze(1) / 16.0  # values 0..16
    big = F.interpolate(small, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)
    images = (big.clamp(0.0, 1.0) * 255.0).round().to(torch.uint8)
    labels = torch.from_numpy(digits.target.astype(np.int64))
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(_DIGITS_SPLIT_SEED))
    test, train = perm[:_DIGITS_TEST], perm[_DIGITS_TEST:]
    mean, std = _stats(images[train])
    return ImageData(
        name="scikit-learn digits (8x8 upsampled to 28x28)",
        train_x=images[train],
        train_y=labels[train],
        test_x=images[test],
        test_y=labels[test],
        mean=mean,
        std=std,
    )


def _auto(directory: Path) -> ImageData:
    return load_fashion_mnist(directory) if fashion_mnist_available(directory) else load_digits_28()


_SOURCES: dict[str, Callable[[Path], ImageData]] = {
    "auto": _auto,
    "fashion-mnist": load_fashion_mnist,
    "digits": lambda _directory: load_digits_28(),
}


def load_images(dataset: str = "auto", data_dir: str | Path | None = None) -> ImageData:
    """The image data set: ``"fashion-mnist"``, ``"digits"``, or ``"auto"`` (Fashion-MNIST if installed).

    ``data_dir`` is the Fashion-MNIST directory (default :data:`FASHION_MNIST_DIR`).
    """
    source = _SOURCES.get(dataset)
    if source is None:
        raise InvalidArgumentError(f"image dataset {dataset!r} is unknown; choose one of {sorted(_SOURCES)}")
    directory = Path(data_dir) if data_dir is not None else FASHION_MNIST_DIR
    return source(directory.resolve())
