"""Acceptance: a transformers Trainer fit with CheckFreqTrainer, SIGKILLed and resumed, ends bit-identical.

Each run is ``scripts/hf_train.py`` (a tiny random GPT-2, 2 epochs of 6 optimizer steps, evaluation
every 4 steps, a checkpoint every 3) in a child process. The first run dies at step 5 (restore:
step 3, mid-epoch), the second at step 8 (restore: step 6, the end of epoch 0), the third finishes.
The same script runs under ``torchrun`` on two CPU processes, where one rank is killed at a time. With
``--plain`` it trains with the plain ``Trainer``: a run it saved is continued by CheckFreqTrainer in the
Trainer's own data order, compared step by step with the Trainer's own resume.
Skipped when the ``transformers`` extra is not installed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from checkfreq.errors import UsageError
from checkfreq.pipeline.restore import read_checkpoint
from checkfreq.ranks.rebuild import local_view
from checkfreq.run.state import unflatten
from helpers import assert_state_equal, hf_fit, sample_reads

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

SAMPLES_PER_STEP = 8  # batch 4, gradient accumulation 2
TIMING = ("runtime", "per_second")


def comparable(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in entry.items() if not any(t in k for t in TIMING)} for entry in history]


def test_killed_and_resumed_trainer_is_bit_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference, run = tmp_path / "reference", tmp_path / "run"
    reference.mkdir()
    run.mkdir()
    assert "restored 0 final 12 epoch 2.0" in hf_fit(reference, "final")
    hf_fit(run, "killed1", "--die-at", "5", killed=True)
    with monkeypatch.context() as info:  # transformers says at INFO where it looks for its RNG file
        info.setenv("TRANSFORMERS_VERBOSITY", "info")
        resumed_mid_epoch = hf_fit(run, "killed2", "--die-at", "8", killed=True)  # from step 3
    assert "***** Running training *****" in resumed_mid_epoch  # the Trainer's INFO lines are shown
    assert "Didn't find an RNG file" not in resumed_mid_epoch  # the generators come from checkfreq's checkpoint
    assert "restored 6 final 12 epoch 2.0" in hf_fit(run, "final")

    expected, actual = torch.load(reference / "final.pt"), torch.load(run / "final.pt")
    assert_state_equal(actual["model"], expected["model"])
    assert_state_equal(actual["optimizer"], expected["optimizer"])
    assert actual["scheduler"] == expected["scheduler"]
    assert comparable(actual["log_history"]) == comparable(expected["log_history"])
    assert sum("eval_loss" in entry for entry in actual["log_history"]) == 3
    assert actual["epoch"] == 2.0

    # No sample is read again to find the place: each resumed run reads exactly what the
    # uninterrupted one read from its checkpoint on, until it dies or ends.
    full = sample_reads(reference / "final.log")
    assert sorted(full[:48]) == sorted(full[48:]) == list(range(48))
    assert sample_reads(run / "killed1.log") == full[: 5 * SAMPLES_PER_STEP]
    assert sample_reads(run / "killed2.log") == full[3 * SAMPLES_PER_STEP : 8 * SAMPLES_PER_STEP]
    assert sample_reads(run / "final.log") == full[6 * SAMPLES_PER_STEP :]

    # the export of the final checkpoint is a checkpoint-N/ directory from_pretrained reads
    assert actual["exported_dir"].endswith("checkpoint-12")
    assert (Path(actual["exported_dir"]) / "model.safetensors").exists()
    assert_state_equal(actual["exported"], actual["model"])


def test_ddp_trainer_with_a_rank_killed_resumes_bit_identical(tmp_path: Path) -> None:
    """2 ranks: 3 optimizer steps per epoch, a checkpoint every 2; rank 1 dies at step 3, rank 0 at step 5."""
    reference, run = tmp_path / "reference", tmp_path / "run"
    reference.mkdir()
    run.mkdir()
    assert hf_fit(reference, "final", "--every", "2", ranks=2).count("restored 0 final 6 epoch 2.0") == 2
    hf_fit(run, "killed1", "--every", "2", "--die-at", "3", "--die-rank", "1", killed=True, ranks=2)
    hf_fit(run, "killed2", "--every", "2", "--die-at", "5", "--die-rank", "0", killed=True, ranks=2)
    assert hf_fit(run, "final", "--every", "2", ranks=2).count("restored 4 final 6 epoch 2.0") == 2

    expected, actual = torch.load(reference / "final.pt"), torch.load(run / "final.pt")
    assert_state_equal(actual["model"], expected["model"])
    assert_state_equal(actual["optimizer"], expected["optimizer"])
    assert comparable(actual["log_history"]) == comparable(expected["log_history"])
    assert_state_equal(actual["exported"], actual["model"])
    per_step = SAMPLES_PER_STEP  # per rank: batch 4, gradient accumulation 2
    for rank in (0, 1):
        full = sample_reads(reference / f"final.log.{rank}")
        assert sample_reads(run / f"final.log.{rank}") == full[4 * per_step :]
    for epoch in range(2):  # the ranks' shares make up each epoch, each sample once
        shares = [
            sample_reads(reference / f"final.log.{rank}")[epoch * 3 * per_step : (epoch + 1) * 3 * per_step]
            for rank in (0, 1)
        ]
        assert sorted(shares[0] + shares[1]) == list(range(48))


def trainer_steps(checkfreq_dir: Path) -> dict[int, int]:
    """Each checkfreq checkpoint's step label → the Trainer's ``global_step`` saved in it."""
    steps = {}
    for path in sorted(checkfreq_dir.glob("step_*")):
        manifest, tensors = read_checkpoint(path)
        skeleton, tensors = local_view(manifest, tensors)
        steps[manifest.step] = json.loads(unflatten(skeleton["trainer"], tensors)["trainer_state"])["global_step"]
    return steps


def test_resumed_from_a_trainer_checkpoint_counts_from_its_step(tmp_path: Path) -> None:
    """Resumed from ``checkpoint-5/`` that CheckFreqTrainer's ``save_steps`` wrote (a path, as the stock scripts
    pass it: it goes on in checkfreq's data order, which the checkpoint's note names), killed at step 11 after
    the Trainer saved ``checkpoint-10/``, resumed with ``--resume_from_checkpoint true``: it resumes from checkfreq's
    step 8 and says that checkpoint-10 is newer; checkfreq's labels, ``restored_step`` and the export agree with
    ``global_step``, and the fit ends bit-identical to the uninterrupted one."""
    reference, run = tmp_path / "reference", tmp_path / "run"
    reference.mkdir()
    run.mkdir()
    hf_fit(reference, "final", "--save_strategy", "steps", "--save_steps", "5")
    note = json.loads((reference / "out" / "checkpoint-5" / "checkfreq.json").read_text())
    assert note == {"data_order": "checkfreq"}
    plain = shutil.copytree(reference / "out" / "checkpoint-5", run / "plain" / "checkpoint-5")
    out = hf_fit(
        run,
        "killed",
        "--resume_from_checkpoint",
        str(plain),
        "--die-at",
        "11",
        "--save_strategy",
        "steps",
        "--save_steps",
        "5",
        killed=True,
    )
    assert "restored 5 killed at 11" in out and "holds no checkfreq.json" not in out
    assert trainer_steps(run / "checkfreq") == {8: 8}  # every 3 steps from step 5
    out = hf_fit(run, "final")
    assert "restored 8 final 12 epoch 2.0" in out
    assert "resuming from checkfreq's newest checkpoint, step 8, though the Trainer's" in out
    assert "checkpoint-10 (step 10) is newer" in out
    assert trainer_steps(run / "checkfreq") == {11: 11, 12: 12}

    expected, actual = torch.load(reference / "final.pt"), torch.load(run / "final.pt")
    assert actual["exported_dir"].endswith("checkpoint-12")
    assert json.loads((Path(actual["exported_dir"]) / "trainer_state.json").read_text())["global_step"] == 12
    assert_state_equal(actual["model"], expected["model"])
    assert_state_equal(actual["optimizer"], expected["optimizer"])


def tiny_trainer(output_dir: Path, training: dict[str, Any] | None = None, **checkfreq: Any) -> Any:
    """An in-process CheckFreqTrainer: a 1-layer GPT-2, 16 samples, batch 2, gradient accumulation 2
    (4 optimizer steps); ``training`` overrides TrainingArguments."""
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments, default_data_collator

    from checkfreq.integrations.transformers import CheckFreqTrainer

    ids = torch.randint(0, 32, (16, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2))
    args = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        **{"save_strategy": "no", **(training or {})},
    )
    return CheckFreqTrainer(
        model=model, args=args, train_dataset=data, data_collator=default_data_collator, **checkfreq
    )


def test_a_rerun_without_resume_is_refused_before_training(tmp_path: Path) -> None:
    """A directory holding checkpoints and no resume flag: ExistingCheckpointsError at train(), not at the first
    checkpoint."""
    from checkfreq.errors import ExistingCheckpointsError

    tiny_trainer(tmp_path, checkfreq_policy=2).train()
    trainer = tiny_trainer(tmp_path, checkfreq_policy=1000)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(ExistingCheckpointsError, match="resume_from_checkpoint=True"):
        trainer.train(resume_from_checkpoint="false")
    assert trainer.state.global_step == 0
    assert_state_equal(trainer.model.state_dict(), before)  # not one optimizer step was taken
    assert tiny_trainer(tmp_path).train(resume_from_checkpoint="True").global_step == 4  # resumes at the end


def test_static_torchrun_form_restarts_the_trainer_with_a_group_per_attempt(tmp_path: Path) -> None:
    """``torchrun --master-port P --max-restarts 1``: rank 1 dies at step 3; the restarted workers create
    the default group on keys of their own (docs/huggingface.md) and resume from checkpoint 2."""
    out = hf_fit(
        tmp_path,
        "final",
        "--every",
        "2",
        "--die-at",
        "3",
        "--die-rank",
        "1",
        "--attempt-store",
        ranks=2,
        static_restarts=1,
    )
    assert "restored 0 killed at 3" in out  # the first attempt
    assert out.count("restored 2 final 6 epoch 2.0") == 2  # both ranks of the second


def test_resume_true_without_checkfreq_checkpoints_takes_the_trainers_newest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``resume_from_checkpoint=True`` with no checkfreq checkpoint but the Trainer's ``checkpoint-2/`` in
    output_dir resumes from it, as the plain Trainer would, says so, and ends as the uninterrupted run."""
    save = {"save_strategy": "steps", "save_steps": 2}
    uninterrupted = tiny_trainer(tmp_path, save, checkfreq_policy=1000)
    uninterrupted.train()
    shutil.rmtree(tmp_path / "checkfreq")  # as if the run had begun without checkfreq
    shutil.rmtree(tmp_path / "checkpoint-4")
    resumed = tiny_trainer(tmp_path, save, checkfreq_policy=1000)
    with caplog.at_level("WARNING", logger="checkfreq.integrations.transformers"):
        assert resumed.train(resume_from_checkpoint="true").global_step == 4
    assert resumed.restored_step == 2
    assert "holds no checkfreq checkpoint: resuming from the Trainer's newest checkpoint" in caplog.text
    assert_state_equal(resumed.model.state_dict(), uninterrupted.model.state_dict())


def test_a_plain_trainer_order_no_resume_could_redraw_is_refused(tmp_path: Path) -> None:
    """A ``checkpoint-N/`` without checkfreq's note (the plain Trainer's) whose run drew batches with a
    RandomSampler seeded from the global generator (use_seedable_sampler=False): refused before any step."""
    tiny_trainer(tmp_path, {"save_strategy": "steps", "save_steps": 2}, checkfreq_policy=1000).train()
    (tmp_path / "checkpoint-2" / "checkfreq.json").unlink()  # as the plain Trainer writes it
    shutil.rmtree(tmp_path / "checkfreq")
    trainer = tiny_trainer(tmp_path / "again", {"accelerator_config": {"use_seedable_sampler": False}})
    with pytest.raises(UsageError, match="RandomSampler draws an order that a resume from a checkfreq checkpoint"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert not (tmp_path / "again" / "checkfreq").exists()


def test_a_resume_whose_checkpoints_are_all_damaged_is_refused(tmp_path: Path) -> None:
    """resume_from_checkpoint=True on checkpoints none of which verifies: NoValidCheckpointError, not a fresh start."""
    from checkfreq.errors import NoValidCheckpointError

    tiny_trainer(tmp_path, checkfreq_policy=2).train()
    for data in (tmp_path / "checkfreq").glob("step_*/*.safetensors"):
        raw = bytearray(data.read_bytes())
        raw[-1] ^= 0xFF
        data.write_bytes(bytes(raw))
    with pytest.raises(NoValidCheckpointError, match="step_000000004.*checksum"):
        tiny_trainer(tmp_path).train(resume_from_checkpoint=True)


def test_objects_accelerate_hands_out_register_and_restore(tmp_path: Path) -> None:
    """Accelerate's AcceleratedOptimizer (no step hooks of its own) and its scheduler wrapper checkpoint and restore."""
    from accelerate import Accelerator

    from checkfreq import Checkpointer

    def prepared(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)
        return Accelerator(cpu=True).prepare(model, optimizer, scheduler)

    model, optimizer, scheduler = prepared(0)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler, policy=2) as ckpt:
        for _ in range(4):
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            ckpt.step()
        ckpt.wait()
        saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}

    model, optimizer, scheduler = prepared(1)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler) as ckpt:
        assert ckpt.restore() == 4
    assert_state_equal(model.state_dict(), saved["model"])
    assert_state_equal(optimizer.state_dict(), saved["optimizer"])
    assert scheduler.state_dict() == saved["scheduler"]


def test_a_dataloader_accelerate_prepared_is_refused_with_the_remedy(tmp_path: Path) -> None:
    from accelerate import Accelerator

    from checkfreq import Checkpointer

    loader = Accelerator(cpu=True).prepare(torch.utils.data.DataLoader(torch.arange(8.0), batch_size=2))
    with pytest.raises(ValueError, match="ResumableLoader"):
        Checkpointer(tmp_path, loader=loader)
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_policy_sees_each_optimizer_steps_loss(tmp_path: Path) -> None:
    """The loss of each optimizer step (summed over its micro-batches) reaches the policy, as the Trainer logs it."""
    from checkfreq.policies import Every

    class Recording(Every):
        def should_save(self, ctx):  # type: ignore[no-untyped-def]
            self.seen.append(ctx.loss)
            return super().should_save(ctx)

    policy = Recording(n=2)
    policy.seen = []
    trainer = tiny_trainer(tmp_path, checkfreq_policy=policy)
    trainer.train()
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(policy.seen) == len(logged) == 4
    assert policy.seen == pytest.approx(logged, abs=1e-3)


def test_a_run_begun_with_the_plain_trainer_goes_on_in_its_data_order(tmp_path: Path) -> None:
    """``checkpoint-5/`` saved by the plain ``transformers.Trainer`` (mid-epoch 0), resumed through CheckFreqTrainer
    and killed twice (restores: step 6, an epoch's end, and step 8, mid-epoch 1): each step trains the samples
    of the Trainer's own resume from checkpoint-5, with the same loss, and the weights end bit-identical."""
    plain, own, run = tmp_path / "plain", tmp_path / "own", tmp_path / "run"
    hf_fit(plain, "final", "--plain", "--save_strategy", "steps", "--save_steps", "5", "--logging_steps", "1")
    for target in (own, run):
        shutil.copytree(plain / "out" / "checkpoint-5", target / "checkpoint-5")
    assert "plain final 12" in hf_fit(
        own, "final", "--plain", "--resume_from_checkpoint", str(own / "checkpoint-5"), "--logging_steps", "1"
    )
    resume = ("--resume_from_checkpoint", str(run / "checkpoint-5"), "--logging_steps", "1", "--every", "1")
    out = hf_fit(run, "killed1", *resume, "--die-at", "7", killed=True)
    assert "restored 5 killed at 7" in out and "holds no checkfreq.json, so the plain Trainer saved it" in out
    assert "restored 6 killed at 9" in hf_fit(
        run, "killed2", "--logging_steps", "1", "--every", "1", "--die-at", "9", killed=True
    )
    assert "restored 8 final 12 epoch 2.0" in hf_fit(run, "final", "--logging_steps", "1", "--every", "1")

    expected, actual = torch.load(own / "final.pt"), torch.load(run / "final.pt")
    assert_state_equal(actual["model"], expected["model"])
    assert_state_equal(actual["optimizer"], expected["optimizer"])
    losses = [
        [(e["step"], e["loss"]) for e in history if "loss" in e]
        for history in (actual["log_history"], expected["log_history"])
    ]
    assert losses[0] == losses[1] and [step for step, _ in losses[0]] == list(range(1, 13))
    # The Trainer's own resume read steps 6-12 in its sampler's order; each run read on from its restored step
    # (a killed run's last read may be the batch accelerate's loader fetched ahead).
    full = sample_reads(own / "final.log")
    for name, start, steps in (("killed1", 0, 2), ("killed2", 1, 3)):
        reads = sample_reads(run / f"{name}.log")
        assert reads == full[start * SAMPLES_PER_STEP :][: len(reads)] and len(reads) >= steps * SAMPLES_PER_STEP
    assert sample_reads(run / "final.log") == full[3 * SAMPLES_PER_STEP :]
