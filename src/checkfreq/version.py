"""The package's version, apart from ``checkfreq/__init__`` so that any module can read it."""

from __future__ import annotations

import platform

import torch

__version__ = "0.1.0"


def versions() -> dict[str, str]:
    """The versions a checkpoint records: checkfreq's, torch's and Python's."""
    return {"checkfreq": __version__, "torch": torch.__version__, "python": platform.python_version()}
