"""Integrations with training frameworks; each module imports its framework only when used.

- :mod:`checkfreq.integrations.lightning`: ``CheckFreqCallback`` for ``lightning.pytorch.Trainer``
  (needs the ``lightning`` extra).
- :mod:`checkfreq.integrations.transformers`: ``CheckFreqTrainer``, a ``transformers.Trainer``
  (needs the ``transformers`` extra).
"""
