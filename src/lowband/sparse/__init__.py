"""Sparse (embedding) training: partitioned tables, their exchange and scheduling."""

from lowband.sparse.embedding import PartitionedEmbedding
from lowband.sparse.partition import column_partition, split_rows, unique_rows

__all__ = ["PartitionedEmbedding", "column_partition", "split_rows", "unique_rows"]
