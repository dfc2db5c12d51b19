"""Acceptance: a Lightning fit with CheckFreqCallback, SIGKILLed and resumed, ends bit-identical.

Each run is ``scripts/lightning_train.py`` in a child process: 9 optimizer steps per epoch, a
checkpoint every 3 steps, a validation loop after each epoch, ``EarlyStopping`` on the validation
loss (it stops the fit after epoch 1, at step 18, of at most 4), ``ModelCheckpoint(save_last=True)``
every 4 steps and ``max_time``. In one process the fit dies at step 5 (restore: step 3,
mid-epoch), at step 10 (restore: step 9, taken once epoch 0 and its validation ended) and at step
14 (restore: step 12, where ModelCheckpoint saved too), then finishes; a copy of the checkpoints
re-run with a spent ``max_time`` trains nothing, ``fit(ckpt_path="last")`` is refused, and a fit resumed
from ModelCheckpoint's step-16 file with an empty checkfreq directory ends as Lightning's own resume. Under
DDP (two CPU processes) rank 0 dies at step 10, and the spent ``max_time`` and the resumed fit run
under ``ddp_spawn``. Two more pairs of fits log ``train_loss`` on epoch, killed mid-epoch, and check the
epoch means and the callbacks monitoring them. Skipped when the ``lightning`` extra is not installed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import SCRIPTS, assert_state_equal

pytest.importorskip("lightning")
pytestmark = pytest.mark.slow


SPENT_TIME = ("--max-time", "00:00:00:01")  # less than the 2 s every fit sleeps in step 2


def fit(
    workdir: Path,
    name: str,
    *args: str,
    killed: bool = False,
    ddp: bool = False,
    fails: bool = False,
    ckpt: str = "ckpt",
    log: str = "batches.log",
    devices: int = 2,
) -> str:
    """Run the fit with every callback (4 epochs at most, 2 s asleep in step 2, a day's max_time);
    under DDP a killed rank makes the others fail, and nothing of the job may outlive it."""
    command = [
        sys.executable,
        str(SCRIPTS / "lightning_train.py"),
        "--dir",
        str(workdir / ckpt),
        "--out",
        str(workdir / f"{name}.pt"),
        "--log",
        str(workdir / log),
        "--epochs",
        "4",
        "--callbacks",
        str(workdir / "lightning"),
        "--sleep-at",
        "2",
        "--max-time",
        "01:00:00:00",
        *args,
    ]
    if ddp:
        command += ["--devices", str(devices)]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        _kill_session(proc.pid)
    # A DDP process that ends on an uncaught exception may abort (SIGABRT) while torch tears its
    # process groups down at exit, after the traceback is printed.
    failed = (1, -signal.SIGABRT) if ddp else (1,)
    expected = (1, -signal.SIGKILL) if killed and ddp else (-signal.SIGKILL,) if killed else failed if fails else (0,)
    assert proc.returncode in expected, f"{name}: exit {proc.returncode}\n{out}"
    return out


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def batches(log: Path) -> dict[int, list[int]]:
    """Sample indices per epoch in batch order; a replayed batch must repeat its first attempt."""
    seen: dict[tuple[int, int], list[int]] = {}
    for line in log.read_text().splitlines():
        epoch, batch_idx, *indices = map(int, line.split())
        first = seen.setdefault((epoch, batch_idx), indices)
        assert first == indices, f"epoch {epoch} batch {batch_idx} differs when replayed"
    per_epoch: dict[int, list[int]] = {}
    for epoch, batch_idx in sorted(seen):
        per_epoch.setdefault(epoch, []).extend(seen[epoch, batch_idx])
    return per_epoch


def _relative(value: object, root: Path) -> object:
    """``value`` with the paths under ``root`` (ModelCheckpoint's) made relative to it."""
    if isinstance(value, str):
        return value.replace(str(root), "<run>")
    if isinstance(value, dict):
        return {_relative(k, root): _relative(v, root) for k, v in value.items()}
    return value


def assert_same_end(reference: Path, run: Path, name: str = "final.pt", steps: int = 16) -> None:
    """Weights, optimizer, scheduler and the EarlyStopping and ModelCheckpoint states are bit-identical,
    and ModelCheckpoint left the same files (no ``last-v1.ckpt``)."""
    expected, actual = torch.load(reference / name, weights_only=False), torch.load(run / name, weights_only=False)
    assert_state_equal(actual["model"], expected["model"])
    assert_state_equal(actual["optimizer"], expected["optimizer"])
    assert actual["scheduler"] == expected["scheduler"]
    assert_state_equal(_relative(actual["callbacks"], run), _relative(expected["callbacks"], reference))
    files = [sorted(os.listdir(root / "lightning")) for root in (run, reference)]
    assert files == [[f"epoch=1-step={steps}.ckpt", "last.ckpt"]] * 2
    last = [
        torch.load(root / "lightning" / "last.ckpt", weights_only=False)["global_step"] for root in (run, reference)
    ]
    assert last == [steps, steps]  # ModelCheckpoint saves every 4 steps


def assert_spent_max_time_trains_nothing(run: Path, *args: str, ddp: bool = False) -> None:
    """A copy of the checkpoints, re-run with a max_time the restored fit has already spent, stops at once."""
    shutil.copytree(run / "ckpt", run / "timed")
    out = fit(run, "timed", *SPENT_TIME, *args, ckpt="timed", log="timed.log", ddp=ddp)
    assert "Time limit reached" in out
    assert not list(run.glob("timed.log*")) and not (run / "timed.pt").exists()  # no batch, no on_train_end
    assert sorted(os.listdir(run / "timed")) == sorted(os.listdir(run / "ckpt"))


def assert_ckpt_path_is_refused(run: Path, *args: str, ddp: bool = False) -> None:
    """``fit(ckpt_path="last")`` beside checkfreq's checkpoints (ModelCheckpoint's last.ckpt is older) fails clearly."""
    before = sorted(os.listdir(run / "ckpt"))
    out = fit(run, "refused", "--ckpt-path", "last", *args, fails=True, ddp=ddp)
    assert "UsageError: Trainer.fit(ckpt_path=" in out and "a mix of two checkpoints" in out
    assert sorted(os.listdir(run / "ckpt")) == before


def assert_ckpt_path_resumes_as_lightning_does(root: Path, ckpt: Path) -> None:
    """A Lightning ``.ckpt`` (step 16, mid-epoch 1) passed as ``fit(ckpt_path=...)`` with an empty checkfreq
    directory: Lightning resumes the fit its own way, and it ends as Lightning's resume without checkfreq does,
    checkpointed by checkfreq from step 16 on."""
    own, migrated = root / "own", root / "migrated"
    for workdir in (own, migrated):
        workdir.mkdir()
    assert "restored 0 final 18" in fit(own, "final", "--plain", "--ckpt-path", str(ckpt))
    assert "restored 0 final 18" in fit(migrated, "final", "--ckpt-path", str(ckpt))
    expected, actual = (torch.load(workdir / "final.pt", weights_only=False) for workdir in (own, migrated))
    for part in ("model", "optimizer", "scheduler"):
        assert_state_equal(actual[part], expected[part])
    assert batches(migrated / "batches.log") == batches(own / "batches.log") == {1: batches(own / "batches.log")[1]}
    assert len(batches(own / "batches.log")[1]) == 2 * 8  # batches 7 and 8 of epoch 1: the loader's position
    assert [p.name for p in sorted((migrated / "ckpt").glob("step_*"))] == ["step_000000018"]  # labels go on from 16


def test_killed_and_resumed_fit_is_bit_identical(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    reference.mkdir()
    assert "restored 0 final 18" in fit(reference, "final")

    run = tmp_path / "run"
    run.mkdir()
    fit(run, "killed", "--die-at", "5", killed=True)
    fit(run, "killed", "--die-at", "10", killed=True)
    assert_spent_max_time_trains_nothing(run)
    fit(run, "killed", "--die-at", "14", killed=True)
    assert "restored 12 final 18" in fit(run, "final")
    assert_same_end(reference, run)
    assert_ckpt_path_is_refused(run)
    assert_ckpt_path_resumes_as_lightning_does(tmp_path, reference / "lightning" / "epoch=1-step=16.ckpt")

    order = [tuple(map(int, line.split()[:2])) for line in (run / "batches.log").read_text().splitlines()]
    # Run 1 trains batches 0-4 of epoch 0; run 2 restores step 3, replays batches 3-4 and goes on to
    # batch 0 of epoch 1; run 3 restores step 9 (taken after epoch 0's validation) and replays that
    # batch, run 4 restores step 12 and trains the rest of epoch 1, where EarlyStopping ends the fit.
    assert order == (
        [(0, i) for i in range(5)]
        + [(0, i) for i in range(3, 9)]
        + [(1, 0)]
        + [(1, i) for i in range(5)]
        + [(1, i) for i in range(3, 9)]
    )
    log = batches(run / "batches.log")
    assert log == batches(reference / "batches.log")
    for indices in log.values():
        assert sorted(indices) == list(range(72))


def test_ddp_fit_with_a_rank_killed_resumes_bit_identical(tmp_path: Path) -> None:
    reference, run = tmp_path / "reference", tmp_path / "run"
    reference.mkdir()
    run.mkdir()
    out = fit(reference, "final", ddp=True)
    assert "rank 0 restored 0 final 18" in out and "rank 1 restored 0 final 18" in out
    fit(run, "killed", "--die-at", "10", "--die-rank", "0", killed=True, ddp=True)
    assert_spent_max_time_trains_nothing(run, "--strategy", "ddp_spawn", ddp=True)
    out = fit(run, "final", "--strategy", "ddp_spawn", ddp=True)
    assert "rank 0 restored 9 final 18" in out and "rank 1 restored 9 final 18" in out
    for name in ("final.pt", "final.pt.1"):  # every rank, BatchNorm buffers (per rank under DDP) included
        assert_same_end(reference, run, name)
    assert_ckpt_path_is_refused(run, ddp=True)

    for rank in (0, 1):
        assert batches(run / f"batches.log.{rank}") == batches(reference / f"batches.log.{rank}")
    for epoch in range(2):  # the ranks' shares make up the epoch, each sample once
        shares = [batches(run / f"batches.log.{rank}")[epoch] for rank in (0, 1)]
        assert sorted(shares[0] + shares[1]) == list(range(72))


@pytest.mark.slow
def test_ddp_fit_at_four_ranks_with_defaults_resumes_bit_identical(tmp_path: Path) -> None:
    """Lightning's DDP with its defaults (it rebuilds its gradient buckets): a restore gives them back, so
    every rank of a fit resumed after a rank is killed ends bit-identical (docs/exactness.md)."""
    reference, run = tmp_path / "reference", tmp_path / "run"
    reference.mkdir()
    run.mkdir()
    fit(reference, "final", "--epochs", "2", ddp=True, devices=4)
    fit(run, "killed", "--epochs", "2", "--die-at", "6", "--die-rank", "1", killed=True, ddp=True, devices=4)
    out = fit(run, "final", "--epochs", "2", ddp=True, devices=4)
    assert all(f"rank {rank} restored " in out for rank in range(4)), out[-3000:]
    for name in ("final.pt", "final.pt.1", "final.pt.2", "final.pt.3"):
        assert_same_end(reference, run, name, steps=8)  # 4 steps an epoch at 4 ranks


def _tiny_fit(directory: Path, epochs: int, callbacks: list, **trainer_options: object):  # type: ignore[no-untyped-def]
    """A linear model fitted in this process on 8 batches of 4 random points per epoch; returns the model."""
    import lightning.pytorch as pl

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.losses = torch.nn.Linear(4, 1), []

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            loss = self.net(batch[0]).square().mean()
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=4)
    model = Model()
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **trainer_options,
    )
    trainer.fit(model, train_dataloaders=data)
    return model, trainer


def test_policy_sees_the_loss_of_each_optimizer_step(tmp_path: Path) -> None:
    """The loss training_step returns reaches the policy, once per optimizer step (the last micro-batch's)."""
    from checkfreq.integrations.lightning import CheckFreqCallback
    from checkfreq.policies import Every

    class Recording(Every):
        def should_save(self, ctx):  # type: ignore[no-untyped-def]
            self.seen.append(ctx.loss)
            return super().should_save(ctx)

    policy = Recording(n=3)
    policy.seen = []
    model, _ = _tiny_fit(tmp_path, 1, [CheckFreqCallback(tmp_path, policy=policy)], accumulate_grad_batches=2)
    assert policy.seen == model.losses[1::2] and len(policy.seen) == 4


def test_callbacks_keep_their_setup_and_their_state(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Listed first, the callback runs last without costing the next callback its ``setup``; a callback's
    ``state_dict()`` comes back in the next fit, and a stateful callback the checkpoint lacks is named."""
    import lightning.pytorch as pl

    from checkfreq.integrations.lightning import CheckFreqCallback

    class Counting(pl.Callback):
        def __init__(self, name: str) -> None:
            self.name, self.setups, self.batches = name, 0, 0

        @property
        def state_key(self) -> str:
            return self.name

        def setup(self, trainer, pl_module, stage):  # type: ignore[no-untyped-def]
            self.setups += 1

        def on_train_batch_end(self, *args):  # type: ignore[no-untyped-def]
            self.batches += 1

        def state_dict(self) -> dict:
            return {"batches": self.batches}

        def load_state_dict(self, state: dict) -> None:
            self.batches = state["batches"]

    checkfreq, counting = CheckFreqCallback(tmp_path, policy=3), Counting("a")
    _, trainer = _tiny_fit(tmp_path, 1, [checkfreq, counting])
    assert counting.setups == 1 and trainer.callbacks[-1] is checkfreq

    resumed, added = Counting("a"), Counting("b")
    with caplog.at_level("WARNING", logger="checkfreq.integrations.lightning"):
        _tiny_fit(tmp_path, 2, [CheckFreqCallback(tmp_path, policy=3), resumed, added])
    assert resumed.batches == 16 and added.batches == 8  # 8 restored + 8 trained; 8 trained
    assert "start afresh: b" in caplog.text


def test_a_checkpoint_at_the_end_of_an_epoch_sees_each_epoch_start_once(tmp_path: Path) -> None:
    """The checkpoint of an epoch's last step is taken before the other callbacks' ``on_train_epoch_start``
    of the next epoch, which Lightning calls again when it resumes from it: across a failure each
    epoch start is seen once, as in an uninterrupted fit."""
    import lightning.pytorch as pl

    from checkfreq.integrations.lightning import CheckFreqCallback

    class Starts(pl.Callback):
        def __init__(self, fail_at: int | None = None) -> None:
            self.starts, self.fail_at = 0, fail_at

        def on_train_epoch_start(self, *args):  # type: ignore[no-untyped-def]
            self.starts += 1

        def on_train_batch_end(self, trainer, *args):  # type: ignore[no-untyped-def]
            if trainer.global_step == self.fail_at:
                raise RuntimeError("failed at step 9")

        def state_dict(self) -> dict:
            return {"starts": self.starts}

        def load_state_dict(self, state: dict) -> None:
            self.starts = state["starts"]

    with pytest.raises(RuntimeError, match="failed at step 9"):  # after the checkpoint of step 8, epoch 0's last
        _tiny_fit(tmp_path, 3, [CheckFreqCallback(tmp_path, policy=4), Starts(fail_at=9)])
    checkfreq, starts = CheckFreqCallback(tmp_path, policy=4), Starts()
    _tiny_fit(tmp_path, 3, [checkfreq, starts])
    assert checkfreq.restored_step == 8 and starts.starts == 3


def monitored_fit(workdir: Path, *args: str, killed: bool = False, ddp: bool = False) -> str:
    """A fit of at most 8 epochs that logs ``train_loss`` on step and epoch, with ``EarlyStopping`` and a
    top-1 ``ModelCheckpoint`` (in ``workdir/best``) monitoring its epoch mean ``train_loss_epoch``."""
    command = [
        sys.executable,
        str(SCRIPTS / "lightning_train.py"),
        "--dir",
        str(workdir / "ckpt"),
        "--out",
        str(workdir / "final.pt"),
        "--log",
        str(workdir / "batches.log"),
        "--epochs",
        "8",
        "--monitor-epoch",
        str(workdir / "best"),
        *args,
        *(("--devices", "2") if ddp else ()),
    ]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        _kill_session(proc.pid)  # a rank left behind by the killed one
    expected = ((1, -signal.SIGKILL) if ddp else (-signal.SIGKILL,)) if killed else (0,)
    assert proc.returncode in expected, f"exit {proc.returncode}\n{out}"
    return out


def assert_same_monitored_end(reference: Path, run: Path, ranks: int = 1) -> None:
    """Every rank ends with the uninterrupted fit's callback and logged metrics (the epoch means included),
    EarlyStopping and ModelCheckpoint states, and the same best checkpoint file."""
    for name in ["final.pt", *(f"final.pt.{rank}" for rank in range(1, ranks))]:
        expected, actual = torch.load(reference / name, weights_only=False), torch.load(run / name, weights_only=False)
        assert set(actual["metrics"]["logged"]) == {"train_loss_step", "train_loss_epoch"}
        assert_state_equal(actual["metrics"], expected["metrics"])
        assert_state_equal(_relative(actual["callbacks"], run), _relative(expected["callbacks"], reference))
        assert_state_equal(actual["model"], expected["model"])
    assert os.listdir(run / "best") == os.listdir(reference / "best") == ["epoch=2-step=27.ckpt"]


def test_epoch_metrics_of_a_fit_killed_mid_epoch_are_restored(tmp_path: Path) -> None:
    """Killed at step 14 (restore: step 12, mid-epoch 1), the resumed fit's epoch-1 mean of train_loss covers
    the whole epoch: EarlyStopping(min_delta=0.02) stops at step 36 as uninterrupted (with the mean of steps
    13-18 only, it stopped at step 27), with the same metrics and ModelCheckpoint(monitor=) choice."""
    reference, run = tmp_path / "reference", tmp_path / "run"
    assert "restored 0 final 36" in monitored_fit(reference)
    monitored_fit(run, "--die-at", "14", killed=True)
    assert "restored 12 final 36" in monitored_fit(run)
    assert_same_monitored_end(reference, run)


def test_ddp_epoch_metrics_come_back_to_each_rank(tmp_path: Path) -> None:
    """2 ranks, train_loss logged with sync_dist=True: rank 0 killed at step 23 (restore: step 21, mid-epoch 2,
    the best epoch); each rank restores its own epoch sums, so the synced epoch mean, EarlyStopping's best
    score and ModelCheckpoint's best file are the uninterrupted fit's (without the sums, the best score
    was the mean of steps 22-27)."""
    reference, run = tmp_path / "reference", tmp_path / "run"
    assert monitored_fit(reference, ddp=True).count("restored 0 final 36") == 2
    monitored_fit(run, "--die-at", "23", killed=True, ddp=True)
    assert monitored_fit(run, ddp=True).count("restored 21 final 36") == 2
    assert_same_monitored_end(reference, run, ranks=2)
