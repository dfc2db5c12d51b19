"""Lightning's logged metrics as a stateful object: the running epoch's aggregates and the last values.

A value logged with ``self.log(..., on_epoch=True)`` is accumulated over the epoch in the result
collection of the loop that logged it (a sum and a sample count for a mean, a running max, min or
sum), and reduced (synced over the ranks with ``sync_dist=True``) when the epoch ends. Lightning's
own checkpoints do not hold these sums, so after a resume in the middle of an epoch the epoch value
covers only the batches trained since. :class:`EpochMetrics` saves them, with the Trainer's
``callback_metrics``, ``logged_metrics`` and ``progress_bar_metrics``, and puts them back, so that
the resumed epoch ends on the value the uninterrupted fit logs and every callback that reads it
(``EarlyStopping``, ``ModelCheckpoint(monitor=...)``) decides the same.

Each rank holds the sums of its own batches and saves them per rank; they come back to the rank
that saved them. Restored at another world size, no rank can get the sums of the batches the other
saved ranks trained: the epoch's aggregates then start afresh, with a warning that names the
metrics whose epoch value covers only the batches trained after the resume.
"""

from __future__ import annotations

import builtins
import logging
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import (
    _Metadata,
    _ResultCollection,
    _ResultMetric,
    _Sync,
)

log = logging.getLogger("checkfreq.integrations.lightning")

_REDUCTIONS = {
    f"{module.__name__}.{name}": getattr(module, name)
    for module in (torch, builtins)
    for name in ("mean", "sum", "max", "min")
    if hasattr(module, name)
}
_METADATA = (
    "fx",
    "name",
    "prog_bar",
    "logger",
    "on_step",
    "on_epoch",
    "enable_graph",
    "add_dataloader_idx",
    "dataloader_idx",
    "metric_attribute",
)


class EpochMetrics:
    """The logged metrics of a fit: the epoch aggregates of the train and validation loops and the
    Trainer's last ``callback_metrics``, ``logged_metrics`` and ``progress_bar_metrics``."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self._trainer = trainer

    def _collections(self) -> dict[str, _ResultCollection]:
        epoch_loop = self._trainer.fit_loop.epoch_loop
        return {"train": epoch_loop._results, "validation": epoch_loop.val_loop._results}

    def state_dict(self) -> dict[str, Any]:
        connector = self._trainer._logger_connector
        try:  # the properties add this batch's values, as Lightning does after the batch's hooks
            last = {
                "callback": dict(connector.callback_metrics),
                "logged": dict(connector.logged_metrics),
                "progress_bar": dict(connector.progress_bar_metrics),
            }
        except RuntimeError:  # outside the train and validation loops (Lightning has no active results)
            last = {
                "callback": dict(connector._callback_metrics),
                "logged": dict(connector._logged_metrics),
                "progress_bar": dict(connector._progress_bar_metrics),
            }
        return {
            "world_size": self._trainer.world_size,
            # None at an epoch's start; a mid-epoch restore must not reset the sums at its first batch
            "first_batch": connector._first_loop_iter,
            "collections": {name: _collection_state(results) for name, results in self._collections().items()},
            **last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        trainer, connector = self._trainer, self._trainer._logger_connector
        device = trainer.lightning_module.device
        collections = state["collections"]
        if int(state["world_size"]) != trainer.world_size:
            if running := sorted(
                {entry["name"] for saved in collections.values() for entry in saved.values() if not entry["has_reset"]}
            ):
                log.warning(
                    "the checkpoint was taken on %d rank(s) in the middle of an epoch, this fit runs on %d: each rank "
                    "saved the epoch sums of its own batches, which no rank of this fit can all get back, so the epoch "
                    "values of %s start afresh and cover only the batches trained after the resume",
                    int(state["world_size"]),
                    trainer.world_size,
                    ", ".join(running),
                )
            collections = {name: {} for name in collections}
        for name, results in self._collections().items():
            _load_collection(results, collections.get(name, {}), trainer, device)
        connector._callback_metrics = _to(state["callback"], device)
        connector._logged_metrics = _to(state["logged"], device)
        connector._progress_bar_metrics = dict(state["progress_bar"])
        connector._first_loop_iter = state["first_batch"]
        connector._current_fx = None


def _to(metrics: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}


def _reduction(fn: Any) -> str:
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__name__', '')}"
    if _REDUCTIONS.get(name) is not fn:  # Lightning allows no other reductions
        raise ValueError(f"unexpected reduce_fx {fn!r} of a logged metric")
    return name


def _collection_state(results: _ResultCollection) -> dict[str, Any]:
    """Each logged value's settings (those Lightning compares at its next ``log``) and accumulators."""
    state = {}
    for key, metric in results.items():
        meta = metric.meta
        entry: dict[str, Any] = {field: getattr(meta, field) for field in _METADATA}
        entry.update(
            reduce_fx=_reduction(meta.reduce_fx),
            sync_dist=meta.sync.should,
            rank_zero_only=meta.sync.rank_zero_only,
            custom_group=meta.sync.group is not None,
            is_tensor=metric.is_tensor,
            has_reset=metric.has_reset,
            updates=int(metric._update_count),
        )
        if metric.is_tensor:
            entry["value"] = metric.value
            if meta.is_mean_reduction:
                entry["cumulated_batch_size"] = metric.cumulated_batch_size
            if isinstance(metric._forward_cache, torch.Tensor):
                entry["forward_cache"] = metric._forward_cache
        state[key] = entry
    return state


def _load_collection(
    results: _ResultCollection, saved: dict[str, Any], trainer: pl.Trainer, device: torch.device
) -> None:
    """Rebuild ``results`` as saved; a value that cannot be rebuilt exactly is left out with a warning."""
    results.clear()
    for key, entry in saved.items():
        if entry["has_reset"]:
            continue  # reset at the epoch's end: Lightning creates or refills it when it is logged again
        if not entry["is_tensor"] or entry["custom_group"]:
            what = "a torchmetrics.Metric" if not entry["is_tensor"] else "logged with a sync_dist_group"
            log.warning(
                "the epoch value of %r (%s) is not restored: it covers only the batches trained after the resume",
                entry["name"],
                what,
            )
            continue
        meta = _Metadata(reduce_fx=_REDUCTIONS[entry["reduce_fx"]], **{field: entry[field] for field in _METADATA})
        # as LightningModule.log sets it, so that the next log of this key finds the same settings
        meta.sync = _Sync(
            _should=bool(entry["sync_dist"]), fn=trainer.strategy.reduce, rank_zero_only=bool(entry["rank_zero_only"])
        )
        metric = _ResultMetric(meta, is_tensor=True)
        metric.value = entry["value"].to(device)
        if meta.is_mean_reduction:
            metric.cumulated_batch_size = entry["cumulated_batch_size"].to(device)
        if "forward_cache" in entry:
            metric._forward_cache = entry["forward_cache"].to(device)
        metric._update_count = int(entry["updates"])
        metric.has_reset = False
        results[key] = metric
