"""BlueFog-compatible API on lowband: BlueFog's names, arguments, defaults and return types.

Replace ``import bluefog.torch as bf`` with ``import lowband.compat.bluefog.torch as bf`` and
``from bluefog.common import topology_util`` with
``from lowband.compat.bluefog.common import topology_util``. Each module's docstring lists where it
differs from BlueFog.
"""
