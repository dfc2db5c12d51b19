"""State the loop carries (docs/exactness.md): a truncated-BPTT language model without a data loader,
its position, hidden state, hand-annealed learning rate and best loss registered as values, resumes
bit-identical after SIGKILLs; the same loop that does not register its hidden state does not."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import torch
from typer.testing import CliRunner

import checkfreq as cf
from checkfreq.cli import app
from helpers import DOCS, assert_state_equal, docs_example, run_example

PAGE = DOCS / "exactness.md"
CARRIED = 'ckpt["i"], ckpt["hidden"] = i + BPTT, hidden'
TO_THE_END = 10**9


def example() -> str:
    return docs_example(PAGE, "State the loop carries")


def run(workdir: Path, module: str, steps: int, *, killed: bool = False) -> None:
    """Train ``module``'s example until global step ``steps``, then SIGKILL it if ``killed``, else
    save its final weights."""
    final = str(workdir / "final.pt")
    run_example(
        workdir, module, steps, "pass" if killed else f"torch.save(result.state_dict(), {final!r})", killed=killed
    )


def newest(workdir: Path) -> Path:
    return Path(sorted(glob.glob(str(workdir / "ckpt" / "step_*")))[-1])


def test_truncated_bptt_loop_resumes_exactly_when_its_carried_state_is_registered(tmp_path: Path) -> None:
    code = example()
    assert code.count(CARRIED) == 1
    for name in ("reference", "resumed", "forgotten", "forgotten_uninterrupted"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "documented.py").write_text(code)
        (tmp_path / name / "forgotten.py").write_text(code.replace(CARRIED, 'ckpt["i"] = i + BPTT'))

    run(tmp_path / "reference", "documented", TO_THE_END)  # 4 epochs of 10 steps
    run(tmp_path / "resumed", "documented", 10, killed=True)  # right after the step that ends epoch 0
    run(tmp_path / "resumed", "documented", 23, killed=True)  # mid-epoch 2: the newest checkpoint holds step 20
    run(tmp_path / "resumed", "documented", TO_THE_END)
    run(tmp_path / "forgotten", "forgotten", 7, killed=True)  # mid-epoch 0, from checkpoint 5
    run(tmp_path / "forgotten", "forgotten", TO_THE_END)
    run(tmp_path / "forgotten_uninterrupted", "forgotten", TO_THE_END)

    expected = torch.load(tmp_path / "reference" / "final.pt")
    assert_state_equal(torch.load(tmp_path / "resumed" / "final.pt"), expected)
    # not registering the hidden state changes nothing in one process, and the resumed run's weights
    assert_state_equal(torch.load(tmp_path / "forgotten_uninterrupted" / "final.pt"), expected)
    forgotten = torch.load(tmp_path / "forgotten" / "final.pt")
    assert not torch.equal(forgotten["rnn.weight_hh_l0"], expected["rnn.weight_hh_l0"])

    manifest, _ = cf.read_checkpoint(newest(tmp_path / "reference"))
    assert manifest.step == 40 and manifest.state["epoch"] == 4 and manifest.state["lr"] < 3.0  # annealed
    restored = [
        json.loads(line)["step"]
        for line in (tmp_path / "resumed" / "ckpt" / "events.jsonl").open()
        if '"restore"' in line
    ]
    assert restored == [10, 20]
    result = CliRunner().invoke(
        app, ["diff", str(newest(tmp_path / "reference")), str(newest(tmp_path / "resumed")), "--json"]
    )
    assert result.exit_code == 0, result.output
    values = {v["name"] for v in json.loads(result.output)["values"]}
    assert {"lr", "best", "epoch", "i", "hidden"} <= values
