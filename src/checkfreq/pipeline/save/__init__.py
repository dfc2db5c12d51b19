"""The save path: what ``step()`` decides and the Taker does (:mod:`~.taker`), the consistent point
where a checkpoint is captured (:mod:`~.consistent_point`), the persist on the writer thread
(:mod:`~.saver`), the commit protocol across ranks (:mod:`~.commit`) and the close (:mod:`~.shutdown`)."""
