"""One checkpoint's path, one folder per concern, each importing only the folders below it:

* :mod:`~checkfreq.pipeline.save` and :mod:`~checkfreq.pipeline.restore`: what ``step()``,
  ``save()`` and ``restore()`` set going (the Taker, the consistent point, the commit protocol; the
  restore's rounds). Neither imports the other.
* :mod:`~checkfreq.pipeline.tiers`: the places a checkpoint lives (the tier roles, the local and
  remote tiers, the memory tier and its copies on other machines) and the one place they are chosen.
* :mod:`~checkfreq.pipeline.retention`: which checkpoints are kept (the newest, the best).
* :mod:`~checkfreq.pipeline.capture`: the registered state, the snapshot into reused buffers, the
  fence and the background writer.

Imports from outside: ``ranks``, ``run``, ``policies``, ``storage`` and ``errors``.
"""
