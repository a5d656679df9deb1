"""Wren server bridge: the CPython side of the board link, model calls and the host stream."""
