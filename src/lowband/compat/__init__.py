"""Compatibility layers: other libraries' public APIs, implemented on lowband.

- :mod:`lowband.compat.bluefog`: BlueFog (``bluefog.common.topology_util`` so far).
"""
