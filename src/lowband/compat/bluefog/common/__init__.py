"""BlueFog's ``bluefog.common`` package: :mod:`~lowband.compat.bluefog.common.topology_util`."""
