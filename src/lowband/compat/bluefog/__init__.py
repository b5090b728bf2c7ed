"""BlueFog-compatible API on lowband: BlueFog's names, arguments, defaults and return types.

Replace ``from bluefog.common import topology_util`` with
``from lowband.compat.bluefog.common import topology_util``. Each module's docstring lists where it
differs from BlueFog.
"""
