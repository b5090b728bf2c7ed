"""Compatibility layers: other libraries' public APIs, implemented on lowband.

- :mod:`lowband.compat.bluefog`: BlueFog (``bluefog.torch`` as :mod:`lowband.compat.bluefog.torch`, and
  ``bluefog.common.topology_util``).
"""
