"""Front ends that run lowband's strategies inside the training frameworks people already use.

Each module maps one framework's extension points onto the strategy protocol
(:mod:`lowband.strategies.base`: ``zero_grad``, a forward through ``s.module``, ``backward``,
``clip_grad_norm_``, ``step``, ``save``/``load``) and adds nothing below it:

- :mod:`lowband.integrations.lightning`: ``LowbandStrategy``, a Lightning ``Strategy`` (a
  ``DDPStrategy`` whose model is the lowband strategy's module);
- :mod:`lowband.integrations.accelerate`: an ``Accelerator`` helper (``prepare_strategy``) and the DDP
  comm-hook route (``comm_hook_kwargs``);
- :mod:`lowband.integrations.transformers`: ``LowbandTrainer``, a ``transformers.Trainer`` whose
  training step and checkpoints go through a lowband strategy.

Importing :mod:`lowband` or this package imports none of the frameworks: each module imports its own
framework when it is imported itself (install them with ``pip install -e ".[integrations]"``).
"""

from __future__ import annotations

from pathlib import Path


def strategy_folder(checkpoint: str | Path) -> Path:
    """The folder next to a framework's checkpoint (file or folder) where every rank's lowband state
    goes (``s.save``): ``CHECKPOINT.lowband``."""
    p = Path(checkpoint)
    return p.with_name(p.name + ".lowband")


__all__ = ["strategy_folder"]
