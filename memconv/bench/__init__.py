"""Measurement tooling: engines, fresh-process workers, ``memconv compare``/``bench``.

Depends on the core package, never the other way round.
"""
