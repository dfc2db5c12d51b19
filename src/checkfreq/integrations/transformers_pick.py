"""Which checkfreq checkpoint a ``CheckFreqTrainer`` resumes from and keeps as its best: the
``resume_from_checkpoint`` that names one (its path, or ``"best"``) and the evaluation metric
``metric_for_best_model`` ranks checkpoints by (docs/huggingface.md)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from checkfreq.errors import InvalidArgumentError
from checkfreq.storage.format import MANIFEST_NAME, checkpoint_name, typed_checkpoint_step


def best_metric(args: Any) -> tuple[str | None, str]:
    """The evaluation metric ``metric_for_best_model`` names (prefixed ``eval_`` as the Trainer does) and
    ``"max"`` or ``"min"`` by ``greater_is_better`` (unset: lower is better for a loss, as the Trainer's)."""
    metric = getattr(args, "metric_for_best_model", None)
    if not metric:
        return None, "min"
    metric = metric if metric.startswith("eval_") else f"eval_{metric}"
    greater = args.greater_is_better if args.greater_is_better is not None else not metric.endswith("loss")
    return metric, "max" if greater else "min"


def named_step(resume: Any, directory: Path) -> int | str | None:
    """The checkfreq checkpoint ``resume_from_checkpoint`` names: ``"best"``, or the step of a path that is a
    checkpoint of ``directory`` (``<directory>/step_N``); None for anything else (a ``checkpoint-N/`` of the
    Trainer's, a boolean). A checkfreq checkpoint of another directory is refused, naming the way to resume it."""
    if resume == "best":
        return "best"
    if not isinstance(resume, (str, os.PathLike)):
        return None
    path = Path(resume)
    step = typed_checkpoint_step(path.name)
    if step is None or not (path.with_name(checkpoint_name(step)) / MANIFEST_NAME).is_file():
        return None
    if path.parent.resolve() != directory.resolve():
        raise InvalidArgumentError(
            f"resume_from_checkpoint={os.fspath(resume)!r} is a checkfreq checkpoint of {path.parent}, and this "
            f"Trainer checkpoints into checkfreq_dir={os.fspath(directory)!r}: pass checkfreq_dir={str(path.parent)!r} "
            "to resume that run from it"
        )
    return step


def chosen_step(directory: Path, named: int | str | None) -> int | None:
    """The step ``resume_from_checkpoint`` named (``"best"``: the best-scored in ``directory``)."""
    if named != "best":
        return None if named is None else int(named)
    from checkfreq.tools.best import best_checkpoint

    return int(best_checkpoint(directory).read_manifest().step)


__all__ = ["best_metric", "chosen_step", "named_step"]
