"""The package's version, apart from ``checkfreq/__init__`` so that any module can read it."""

__version__ = "0.1.0"
