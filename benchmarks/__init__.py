"""checkfreq's benchmark suite: ``python -m benchmarks.run`` (see ``--help``).

Measures checkfreq against the limits of the machine (raw ``copy_``, raw write+fsync, raw read)
and against what users would otherwise use (``torch.save``, ``safetensors``, DCP), in one run,
interleaved and repeated, and writes the results into ``docs/performance.md``.
"""
