"""Resumable data loading: each sample exactly once per epoch, in the same order, after any restart.

``ResumableSampler`` (:mod:`.sampler`) and ``ResumableLoader`` (:mod:`.loader`); the seeds and
checks they share are in :mod:`.order`. Imports: ``errors`` only.

Three rules make a resumed run see exactly what an uninterrupted one would have seen:

* **Order is a pure function.** The *global order* of epoch ``e`` is a permutation of
  ``range(len(dataset))`` computed from ``(seed, e)`` alone (the identity when ``shuffle=False``).
  Rank ``r`` of ``W`` takes every ``W``-th entry starting at ``r``, like
  :class:`torch.utils.data.DistributedSampler`. No generator carries state from one epoch to the next.
* **State is a position, not a history.** :class:`ResumableSampler` keeps ``epoch`` and
  ``consumed``: how many entries of the epoch's global order the training loop has consumed on all
  ranks together. Because ranks stride over the order and step in lockstep, the consumed samples
  are always the prefix ``order[:consumed]``. Resuming starts at ``order[consumed]`` directly: the
  skipped samples are never read, so resuming mid-epoch costs the same as resuming at its start.
* **Randomness is per sample.** Before ``dataset[i]`` is called, Python's ``random``, NumPy's global
  generator and torch's CPU generator are seeded from ``(seed, epoch, i)``, so a random augmentation
  of sample ``i`` is the same whichever worker loads it, with any ``num_workers``, before or after a
  restart. In the main process (``num_workers=0``) the caller's generator states are put back
  afterwards: loading data never disturbs the training loop's random stream.

**Changing the world size.** The remainder of the epoch, ``order[consumed:]``, is re-partitioned
over the new ranks (rank ``r`` of ``W'`` takes ``order[consumed + r :: W']``), so every sample of the
epoch is still seen exactly once. When the remainder is not a multiple of the world size, every
rank still takes the same number of samples, as with ``DistributedSampler``: ``drop_last=False``
repeats the first few remaining samples (at most ``W - 1``) and ``drop_last=True`` leaves the last
few out. With one rank nothing is ever repeated or left out by the sampler.

**Global batches.** With ``global_batch_size=B`` the unit is the optimizer step, whatever the world
size: global batch ``k`` of an epoch is ``order[k*B : (k+1)*B]`` (a tail shorter than ``B`` is left
out with ``drop_last=True``, else completed with the epoch's first samples), and rank ``r`` of ``W``
takes its ``r``-th of ``W`` equal consecutive slices. Which samples make optimizer step ``k``
therefore depends on ``(seed, epoch, B)`` alone; a job resumed at another world size takes the same
global batches from the step where it stopped. A rank's slice that exceeds ``micro_batch_size``
is handed out in equal micro-batches, :attr:`ResumableLoader.accumulation_steps` of them per step.
"""

from checkfreq.data.loader import ResumableLoader
from checkfreq.data.order import sample_seed
from checkfreq.data.sampler import ResumableSampler

__all__ = ["ResumableLoader", "ResumableSampler", "sample_seed"]
