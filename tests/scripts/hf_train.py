"""A 2-epoch ``transformers.Trainer`` fit of a tiny random GPT-2 with CheckFreqTrainer, for the exact-resume test.

Trains on local text (character tokens), evaluates every 4 steps, logs every 2, checkpoints every
``--every`` (3) optimizer steps (of ``--grad-acc`` (2) batches of 4 per process) and resumes with
``resume_from_checkpoint`` as the stock example scripts pass it: ``TrainingArguments`` parsed by
``HfArgumentParser``, so ``--resume_from_checkpoint
true`` arrives as the string ``"true"`` (a path resumes from a Trainer ``checkpoint-N/``). Any other
``TrainingArguments`` flag (``--save_strategy steps --save_steps 5``) overrides the defaults. Runs as one
process or under ``torchrun`` (DDP over gloo); there ``--die-rank`` says which rank dies, each rank
logs its reads to ``--read-log`` + ``.RANK`` and rank 0 writes ``--out``. With ``--die-at K`` it SIGKILLs
itself at the end of optimizer step K, once the checkpoint in flight is durable. ``--plain`` trains with
the plain ``transformers.Trainer`` instead (no checkfreq) and writes its weights, optimizer and log
history. Every sample the dataset reads is appended to ``--read-log``. At the end it writes the final
weights, optimizer and scheduler state and the log history to ``--out``, exports the newest
checkpoint to ``checkpoint-N/`` and adds the weights ``from_pretrained`` reads from it. With ``--attempt-store``
(torchrun's static launch form) it creates the default process group on keys of its own for each
restart attempt before ``TrainingArguments`` would create it, as docs/huggingface.md shows;
``--die-at`` kills only in the first attempt. ``--noisy-eval`` adds to each evaluation the metric
``eval_noisy``: the evaluation's loss plus a noise that is a function of the step (:data:`NOISE`, the same
in a resumed run), and writes the model's weights at each evaluation to ``--out`` + ``.models/STEP.pt``.
"""

from __future__ import annotations

import argparse
import os
import signal

os.environ["HF_HUB_OFFLINE"] = "1"

import torch
from ddp_train import init_for_this_attempt
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)
from worker_exit import exit_without_teardown  # beside this script

from checkfreq.integrations.transformers import CheckFreqTrainer

TEXT = "checkpoints taken often and cheaply let a killed run go on where it stopped. " * 40
BLOCK = 16


class CharBlocks(torch.utils.data.Dataset):
    """Blocks of character codes of ``TEXT``; each read is logged."""

    def __init__(self, count: int, offset: int, log: str | None) -> None:
        self.count, self.offset, self.log = count, offset, log

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{i}\n")
        start = (self.offset + i * 7) % (len(TEXT) - BLOCK)
        ids = torch.tensor([ord(c) % 96 for c in TEXT[start : start + BLOCK]])
        return {"input_ids": ids, "labels": ids}


NOISE = {4: -2.0, 8: -0.5}
"""Added to the evaluation's loss at a step (else +1): the best is not the newest, the second best neither."""


def noisy_metric(trainer: CheckFreqTrainer):
    """``compute_metrics``: the evaluation's cross-entropy plus the noise of ``trainer``'s step."""

    def metric(prediction) -> dict[str, float]:
        logits, labels = torch.as_tensor(prediction.predictions), torch.as_tensor(prediction.label_ids)
        flat = logits[:, :-1].reshape(-1, logits.shape[-1])
        loss = torch.nn.functional.cross_entropy(flat, labels[:, 1:].reshape(-1))
        return {"noisy": float(loss) + NOISE.get(trainer.state.global_step, 1.0)}

    return metric


class SaveAtEvaluation(TrainerCallback):
    """The weights at each evaluation, by step, to compare a restored best with."""

    def __init__(self, out: str) -> None:
        self.out = out
        os.makedirs(f"{out}.models", exist_ok=True)

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        torch.save(model.state_dict(), f"{self.out}.models/{state.global_step}.pt")


class DieAt(TrainerCallback):
    def __init__(self, step: int | None) -> None:
        self.step, self.trainer = step, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.trainer.checkpointer.wait()
            print(f"restored {self.trainer.restored_step} killed at {state.global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--read-log", required=True)
    parser.add_argument("--die-at", type=int, default=None)
    parser.add_argument("--die-rank", type=int, default=0)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--attempt-store", action="store_true")
    parser.add_argument("--grad-acc", type=int, default=2)
    parser.add_argument("--plain", action="store_true", help="the plain transformers.Trainer, without checkfreq")
    parser.add_argument("--noisy-eval", action="store_true", help="eval_noisy and the weights at each evaluation")
    args, training_flags = parser.parse_known_args()
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.attempt_store:  # before TrainingArguments, which would create the default group on stale keys
        init_for_this_attempt()
    read_log = args.read_log if world_size == 1 else f"{args.read_log}.{rank}"
    torch.set_num_threads(1)
    torch.manual_seed(0)

    model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=BLOCK, n_embd=64, n_layer=2, n_head=2))
    defaults = {
        "output_dir": os.path.join(args.dir, "out"),
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 8,
        "gradient_accumulation_steps": args.grad_acc,
        "num_train_epochs": 2,
        "learning_rate": 3e-3,
        "warmup_steps": 2,
        "eval_strategy": "steps",
        "eval_steps": 4,
        "logging_steps": 2,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 3,
        "dataloader_num_workers": 0,
    }
    flags = [item for name, value in defaults.items() for item in (f"--{name}", str(value))]
    (training,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(args=flags + training_flags)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    die = DieAt(args.die_at if rank == args.die_rank and first_attempt else None)
    data = dict(
        train_dataset=CharBlocks(48, 0, read_log),
        eval_dataset=CharBlocks(16, 5, None),
        data_collator=default_data_collator,
    )
    if args.plain:
        plain = Trainer(model=model, args=training, **data)
        given = training.resume_from_checkpoint  # a path; hf_fit's default "true" means a fresh run here
        plain.train(resume_from_checkpoint=None if given in ("true", "false") else given)
        print(f"plain final {plain.state.global_step}", flush=True)
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": plain.optimizer.state_dict(),
                "log_history": plain.state.log_history,
            },
            args.out,
        )
        return
    callbacks = [die, SaveAtEvaluation(args.out)] if args.noisy_eval else [die]
    trainer = CheckFreqTrainer(
        model=model,
        args=training,
        callbacks=callbacks,
        checkfreq_dir=os.path.join(args.dir, "checkfreq"),
        checkfreq_policy=args.every,
        checkfreq_keep=2,
        **data,
    )
    die.trainer = trainer
    if args.noisy_eval:
        trainer.compute_metrics = noisy_metric(trainer)
    trainer.train(resume_from_checkpoint=training.resume_from_checkpoint)
    exported = trainer.export_checkpoint()
    reloaded = GPT2LMHeadModel.from_pretrained(exported)
    print(f"restored {trainer.restored_step} final {trainer.state.global_step} epoch {trainer.state.epoch}", flush=True)
    if rank != 0:
        return
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.lr_scheduler.state_dict(),
            "exported": reloaded.state_dict(),
            "exported_dir": str(exported),
            "epoch": trainer.state.epoch,
            "log_history": trainer.state.log_history,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # under torchrun
        torch.distributed.destroy_process_group()
    exit_without_teardown()
