"""Bench workloads: the reference ones (offline, deterministic) and a user's own.

A workload follows the small protocol of :class:`Workload` (build_model, batches, loss; optional
evaluate, make_optimizer, items, describe). :func:`get_workload` takes a registered name or a user's
spec, ``package.module:factory`` or ``path/to/file.py:factory`` (:mod:`lowband.bench.workloads.loader`).

Usage (``rank``/``world`` from :mod:`lowband`)::

    w = get_workload("fmnist-cnn")
    model = w.build_model(seed=0)                  # same seed on every rank
    opt = w.make_optimizer(model.parameters())       # the workload's, or SGD by default
    for batch in itertools.islice(w.batches(rank, world, w.default_batch_size, seed=0), 100):
        opt.zero_grad()
        w.loss(model, batch).backward()
        opt.step()
    print(w.describe(), w.evaluate(model))

======================  ====================================================  ========
name                    data, model                                           unit
======================  ====================================================  ========
``fmnist-cnn``          Fashion-MNIST (digits fallback), small CNN            samples
``fmnist-resnet``       Fashion-MNIST (digits fallback), small ResNet         samples
``shakespeare-gpt``     Shakespeare characters, nanoGPT-style transformer     tokens
``wordlm``              Shakespeare words, embedding-dominated word LM        tokens
``wordlm-sampled``      Shakespeare words, word LM with sampled softmax: two  tokens
                        embedding tables hold 95% of the parameters
``wordgpt``             Shakespeare words, transformer with an untied input   tokens
                        table and a dense head
``linreg``              synthetic linear regression, ``nn.Linear(d, 1)``      samples
======================  ====================================================  ========
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lowband.bench.workloads.base import (
    Batch,
    DatasetWorkload,
    EvalResult,
    Workload,
    count_params,
    tensor_batches,
)
from lowband.bench.workloads.images import DatasetUnavailableError
from lowband.bench.workloads.loader import canonical_spec, is_spec, load_workload
from lowband.bench.workloads.regression import LinRegWorkload, least_squares, linreg_data, linreg_problem
from lowband.bench.workloads.text import CharLMWorkload
from lowband.bench.workloads.vision import ImageWorkload
from lowband.bench.workloads.wordgpt import WordGPTWorkload
from lowband.bench.workloads.wordlm import WordLMWorkload
from lowband.bench.workloads.wordlm_sampled import SampledWordLMWorkload
from lowband.options import Opt, Options, Rule
from lowband.registry import Registry

#: name -> workload factory(**options)
WORKLOADS: Registry[Callable[..., Workload]] = Registry("workload")


def _size(doc: str, minimum: int = 1) -> Opt:
    return Opt(int, min=minimum, doc=doc)


_LR = Options({"lr": Opt(float, gt=0, doc="the default optimizer's learning rate")})
_IMAGES = _LR | Options(
    {
        "dataset": Opt(str, doc="auto (Fashion-MNIST, else the digits), fmnist or digits"),
        "data_dir": Opt(str, objects=(Path,), what="a folder", doc="Fashion-MNIST's idx.gz files"),
    }
)
_GPT = _LR | Options(
    {
        "block_size": _size("tokens of context"),
        "n_layer": _size("transformer blocks"),
        "n_head": _size("attention heads"),
        "n_embd": _size("embedding width (a multiple of n_head)"),
    },
    rules=[
        Rule(
            ("n_embd", "n_head"),
            "n_embd must be a multiple of n_head",
            lambda o: o["n_embd"] % o["n_head"] == 0,
        )
    ],
)
_WORDS = Options(
    {
        "vocab_size": _size("the most frequent words kept (the rest: <unk>)", 2),
        "embed_dim": _size("embedding width"),
        "context": _size("words of context"),
        "hidden": _size("hidden width"),
    }
)
WORKLOADS.register(
    "fmnist-cnn", functools.partial(ImageWorkload, "cnn", "fmnist-cnn"), "CNN on Fashion-MNIST", _IMAGES
)
WORKLOADS.register(
    "fmnist-resnet",
    functools.partial(ImageWorkload, "resnet", "fmnist-resnet"),
    "ResNet on Fashion-MNIST",
    _IMAGES,
)
WORKLOADS.register("shakespeare-gpt", CharLMWorkload, "character GPT on Shakespeare", _GPT)
WORKLOADS.register(
    "wordlm", WordLMWorkload, "word-level language model",
    _LR | _WORDS | Options({"tied": Opt(bool, doc="the output layer reads the input table")}),
)  # fmt: skip
WORKLOADS.register(
    "wordlm-sampled", SampledWordLMWorkload, "word LM trained with a sampled softmax",
    _LR | _WORDS | Options({"negatives": _size("sampled negatives per batch")}),
)  # fmt: skip
WORKLOADS.register(
    "wordgpt", WordGPTWorkload, "word-level transformer with an untied input table",
    _GPT | Options({"vocab_size": _WORDS.opts["vocab_size"]}),
)  # fmt: skip
WORKLOADS.register(
    "linreg", LinRegWorkload, "linear regression with a closed-form optimum",
    _LR | Options(
        {
            "dim": _size("features"),
            "rows": _size("training rows"),
            "test_rows": _size("held-out rows"),
            "data_seed": Opt(int, min=0, doc="seeds the data set"),
        }
    ),
)  # fmt: skip


def workload_names() -> list[str]:
    """The registered workload names, sorted."""
    return WORKLOADS.names()


def get_workload(name: str, **options: Any) -> Workload:
    """The workload registered as ``name``, or a user's (``module:factory``, ``file.py:factory``), built
    with keyword ``options`` (e.g. ``dataset="digits"``)."""
    if is_spec(name):
        return load_workload(name, **options)
    factory = WORKLOADS.get(name)
    return factory(**WORKLOADS.check_options(name, options))


__all__ = [
    "WORKLOADS",
    "Batch",
    "CharLMWorkload",
    "DatasetUnavailableError",
    "DatasetWorkload",
    "EvalResult",
    "ImageWorkload",
    "LinRegWorkload",
    "SampledWordLMWorkload",
    "WordGPTWorkload",
    "WordLMWorkload",
    "Workload",
    "canonical_spec",
    "count_params",
    "get_workload",
    "is_spec",
    "least_squares",
    "linreg_data",
    "linreg_problem",
    "load_workload",
    "tensor_batches",
    "workload_names",
]
