"""Restore: the newest checkpoint every rank can read, found in any tier, read and verified.

The same code for one process and for N ranks (:mod:`checkfreq.ranks.collectives`), in rounds that rank
0 leads, so that a rank other than 0 sends and receives a few small messages at any number of ranks:

1. Rank 0 gathers the steps each rank lists (in its local directory or the remote tier) and the
   ranks try the steps every rank lists, newest first.
2. For a step, each rank reads that checkpoint's manifest (no other) and tells rank 0 which data
   files its local directory holds and whether the remote tier lists the checkpoint. Rank 0 checks
   that every file can be had and gives each file one reader: one of the ranks whose directory
   holds it (they take turns, so on one shared directory each rank reads about 1/N of the
   checkpoint) or, for a file no directory holds, a rank that reads it from the remote tier.
3. The readers read and verify their files. A damaged copy goes to a holder in another directory,
   then to the remote tier; every byte read from storage is verified once, by its reader.
4. Each rank gets what it needs from the readers: whole, the data file of the saved rank whose
   private state it restores (its own at the same world size) and, under FSDP2, those holding the
   shards its live blocks overlap (its own at the same layout; at another world size, the few
   whose ``torch.chunk`` blocks meet its own, as the manifest records the layout); and,
   all-gathered over the control group, the replicated tensors (parameters and optimizer state
   under DDP) of every other file: about the size of the replicated state per rank, at any number
   of ranks. A rank whose directory shares its page cache with a file's reader maps the file
   rather than receive it. Each rank checks that the shards it got cover its blocks; if they do
   not on some rank (a layout the manifest does not record), the ranks take the step again, each
   getting every file. When every rank shares one page cache (one machine, one directory), or the
   checkpoint has a version 1 manifest, every rank gets every file whole at once.

If any rank fails, every rank moves on to the next older step. With node-local directories no node
reads another node's files from the remote tier: only what no directory holds intact comes from it.

With a memory tier, its newest snapshot every rank holds wins when it is not older than the
newest checkpoint listed on disk (it reads fastest); it is also the fallback when no checkpoint
on disk is valid.
"""

from checkfreq.pipeline.restore.protocol import Found, Restorer
from checkfreq.pipeline.restore.read import read_checkpoint

__all__ = ["Found", "Restorer", "read_checkpoint"]
