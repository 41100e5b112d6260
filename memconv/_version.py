"""The single source of memconv's version (read by setuptools and by ``memconv --version``)."""

__version__ = "0.1.0"
