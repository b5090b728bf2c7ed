"""Sparse (embedding) training: partitioned tables, their exchange and scheduling."""
