"""Resumable data order: ``ResumableSampler`` and ``ResumableLoader``.

Imports: ``errors`` only.
"""

from checkfreq.data.resumable import ResumableLoader, ResumableSampler, sample_seed

__all__ = ["ResumableLoader", "ResumableSampler", "sample_seed"]
