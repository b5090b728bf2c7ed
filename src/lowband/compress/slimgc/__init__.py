"""SlimGC ("SlimGC: Gradient Compression Optimization Strategy For Distributed Deep Learning"): the
communication threshold table (:mod:`.table`), the reduction pipeline (run off the training thread by
a lane of the communication engine, :mod:`lowband.comm.engine`) that applies the threshold (:mod:`.pipeline`) and the model
backup (:mod:`.backup`). The strategy is ``lowband.strategies.slimgc``."""

from lowband.compress.slimgc.backup import ModelBackup
from lowband.compress.slimgc.pipeline import SlimGCReducer
from lowband.compress.slimgc.table import (
    Row,
    Samples,
    ThresholdTable,
    build_table,
    compress_mask,
    compressed_step,
    parse_comm_threshold,
)

__all__ = [
    "ModelBackup", "Row", "Samples", "SlimGCReducer", "ThresholdTable",
    "build_table", "compress_mask", "compressed_step", "parse_comm_threshold",
]  # fmt: skip
