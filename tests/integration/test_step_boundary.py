"""docs/exactness.md, "Where no loader is registered": a loop that prefetches resumes exactly when the
prefetched batch is registered, as the page's example does, and does not when it is drawn anew."""

from __future__ import annotations

from pathlib import Path

import torch

from helpers import DOCS, assert_state_equal, docs_example, run_example

PAGE = DOCS / "exactness.md"
READ_BACK = 'x, y = ckpt["batch"]'


def example() -> str:
    return docs_example(PAGE, "Where no loader is registered")


def run(workdir: Path, module: str, steps: int, out: str, *, killed: bool = False) -> None:
    """Train ``module``'s example to ``steps`` and save its model and optimizer to ``out``; SIGKILL it
    then if ``killed``."""
    path = str(workdir / out)
    saved = f"torch.save({{'model': result[0].state_dict(), 'optimizer': result[1].state_dict()}}, {path!r})"
    run_example(workdir, module, steps, saved, killed=killed)


def test_prefetching_loop_resumes_exactly_when_the_batch_is_registered(tmp_path: Path) -> None:
    code = example()
    assert code.count(READ_BACK) == 1
    for name in ("reference", "resumed", "redrawn"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "documented.py").write_text(code)
        # nanoGPT's own resume: restore, then draw the first batch afresh
        (tmp_path / name / "redrawn.py").write_text(code.replace(READ_BACK, "x, y = get_batch()"))

    run(tmp_path / "reference", "documented", 12, "final.pt")
    run(tmp_path / "resumed", "documented", 7, "killed.pt", killed=True)  # newest checkpoint: step 5
    run(tmp_path / "resumed", "documented", 12, "final.pt")
    run(tmp_path / "redrawn", "documented", 7, "killed.pt", killed=True)
    run(tmp_path / "redrawn", "redrawn", 12, "final.pt")

    expected = torch.load(tmp_path / "reference" / "final.pt")
    resumed = torch.load(tmp_path / "resumed" / "final.pt")
    assert_state_equal(resumed["model"], expected["model"])
    assert_state_equal(resumed["optimizer"], expected["optimizer"])
    redrawn = torch.load(tmp_path / "redrawn" / "final.pt")
    assert not torch.equal(redrawn["model"]["0.weight"], expected["model"]["0.weight"])
