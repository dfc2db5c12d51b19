"""The public API refuses what it would otherwise silently misread: options, state, closed objects."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from importlib.metadata import requires
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

import checkfreq as cf
from checkfreq.ranks.compat import dtensor_class
from helpers import SCRIPTS, make_model, train_step


@pytest.mark.parametrize(
    ("options", "guess"),
    [
        ({"polcy": 10}, "policy"),
        ({"keep_last": 5}, "keep"),
        ({"remote_dir": "/x"}, "remote"),
        ({"on_signal": (signal.SIGTERM,)}, "save_on_signal"),
        ({"polcy": cf.Every(10)}, "policy"),  # a policy under a misspelled name is not state either
        ({"persist_timout": 5.0}, "persist_timeout"),
        ({"failure_timout": 5.0}, "failure_timeout"),
    ],
)
def test_a_misspelled_option_is_refused_with_the_closest_name(tmp_path: Path, options: dict, guess: str) -> None:
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(options))}'; did you mean '{guess}'"):
        cf.Checkpointer(tmp_path, model=make_model(), **options)
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_a_plain_value_by_keyword_is_refused_with_the_way_to_register_it(tmp_path: Path) -> None:
    with pytest.raises(
        TypeError, match=r"'best_accuracy'.*has no state_dict\(\).*values=\{\.\.\.\} or ckpt\['name'\] = value"
    ):
        cf.Checkpointer(tmp_path, model=make_model(), best_accuracy=0.5)


def test_an_object_under_an_option_name_is_not_taken_as_that_option(tmp_path: Path) -> None:
    model = make_model()
    with pytest.raises(TypeError, match="keep must be an int"):
        cf.Checkpointer(tmp_path, model=model, keep=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="policy must be"):
        cf.Checkpointer(tmp_path, model=model, policy=model)
    with pytest.raises(TypeError, match="rng must be True or False"):
        cf.Checkpointer(tmp_path, model=model, rng=cf.data.ResumableLoader([1, 2]))
    for timeout in (0, -1.0, float("inf"), float("nan"), True, "30"):
        with pytest.raises(TypeError, match="failure_timeout must be a positive number of seconds"):
            cf.Checkpointer(tmp_path, model=model, failure_timeout=timeout)


def test_values_and_item_assignment_register_plain_values(tmp_path: Path) -> None:
    model = make_model()
    with cf.Checkpointer(tmp_path, model=model, values={"best": 0.5, "tags": ["a"]}) as ckpt:
        ckpt["seen"] = torch.arange(3)
        ckpt.save(blocking=True)
    with cf.Checkpointer(tmp_path, model=model, values={"best": 0.0, "tags": []}) as ckpt:
        ckpt["seen"] = torch.zeros(3, dtype=torch.int64)
        ckpt.restore()
        assert ckpt["best"] == 0.5 and ckpt["tags"] == ["a"] and torch.equal(ckpt["seen"], torch.arange(3))
    with pytest.raises(ValueError, match="'best' registered both"):
        cf.Checkpointer(tmp_path, model=model, best=model, values={"best": 1})


def test_a_checkpoint_of_another_optimizer_class_fails_before_anything_changes(tmp_path: Path) -> None:
    model = make_model()
    with cf.Checkpointer(tmp_path, model=model, optimizer=torch.optim.AdamW(model.parameters())) as ckpt:
        train_step(model, ckpt._objects["optimizer"])  # AdamW state exists
        ckpt.save(blocking=True)
    fresh = make_model(seed=1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    sgd = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    with cf.Checkpointer(tmp_path, model=fresh, optimizer=sgd) as ckpt:
        with pytest.raises(
            cf.StateMismatchError, match=r"'optimizer'.*torch\.optim\.adamw\.AdamW.*torch\.optim\.sgd\.SGD"
        ):
            ckpt.restore()
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())  # the model was not loaded
    assert not sgd.state


def test_a_new_run_refuses_to_checkpoint_over_a_run_it_did_not_restore(tmp_path: Path) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with cf.Checkpointer(tmp_path, policy=2, model=model, optimizer=opt) as ckpt:
        for _ in range(6):
            train_step(model, opt)
            ckpt.step()
    before = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_"))
    with cf.Checkpointer(tmp_path, policy=2, model=model, optimizer=opt) as ckpt:
        train_step(model, opt)
        ckpt.step()
        train_step(model, opt)
        with pytest.raises(cf.ExistingCheckpointsError, match="newest at step 6.*restore"):
            ckpt.step()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == before
    with cf.Checkpointer(tmp_path, policy=2, model=model, optimizer=opt) as ckpt:  # resuming is the way out
        assert ckpt.restore() == 6
        train_step(model, opt)
        ckpt.step()
        train_step(model, opt)
        assert ckpt.step()


def test_a_closed_checkpointer_says_so(tmp_path: Path) -> None:
    ckpt = cf.Checkpointer(tmp_path, model=make_model())
    ckpt.close()
    for call in (ckpt.step, ckpt.save, ckpt.restore):
        with pytest.raises(cf.CheckfreqError, match="closed Checkpointer"):
            call()
    ckpt.close()  # closing twice is harmless


@pytest.mark.parametrize("version", ["2.11.0", "2.13.0", "2.15.0"])
def test_the_package_admits_the_torch_users_already_have(version: str) -> None:
    (torch_requirement,) = [
        r for r in map(Requirement, requires("checkfreq") or []) if r.name == "torch" and r.marker is None
    ]
    assert torch_requirement.specifier.contains(version)


def test_the_core_package_does_not_depend_on_cli_or_plotting() -> None:
    core = {Requirement(r).name for r in requires("checkfreq") or [] if "extra ==" not in r}
    assert not core & {"matplotlib", "rich", "typer"}


def test_a_missing_torch_api_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.distributed.tensor", None)  # as on a torch without it
    with pytest.raises(cf.UnsupportedTorchError, match=r"DTensor is not available in torch .*needs torch >= 2\.6"):
        dtensor_class()


def test_the_library_imports_without_the_cli_packages_and_the_command_names_its_extra() -> None:
    blocked = "import sys; sys.modules.update(typer=None, rich=None, matplotlib=None); "
    library = subprocess.run(
        [sys.executable, "-c", blocked + "import checkfreq, checkfreq.data, checkfreq.policies; print('ok')"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert library.returncode == 0 and "ok" in library.stdout, library.stderr
    command = subprocess.run(
        [sys.executable, "-c", blocked + "from checkfreq.command import main; main()"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert command.returncode == 1 and "pip install 'checkfreq[cli]'" in command.stderr


def test_the_lightning_callback_refuses_a_misspelled_option() -> None:
    lightning = pytest.importorskip("checkfreq.integrations.lightning")
    with pytest.raises(TypeError, match="CheckFreqCallback.*'on_signal'; did you mean 'save_on_signal'"):
        lightning.CheckFreqCallback("runs/x", on_signal=(signal.SIGTERM,))
    with pytest.raises(TypeError, match="'polcy'; did you mean 'policy'"):
        lightning.CheckFreqCallback("runs/x", polcy=10)
    lightning.CheckFreqCallback("runs/x", persist_timeout=60.0, values={"note": "ok"})  # forwarded options pass


def test_a_checkpointer_on_rank_0_only_fails_with_the_rule_instead_of_hanging(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(SCRIPTS / "rank0_only.py"),
            str(tmp_path / "ckpt"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    refused = re.search(
        r"refused after (\d+\.\d) s: only 1 of 2 ranks constructed a Checkpointer.*every rank must", result.stdout
    )
    assert refused and float(refused.group(1)) >= 3.0, result.stdout  # it waited the timeout out, then said why


def test_the_transformers_trainer_refuses_a_misspelled_checkfreq_option() -> None:
    transformers = pytest.importorskip("checkfreq.integrations.transformers")
    with pytest.raises(TypeError, match="CheckFreqTrainer.*'remote_dir'; did you mean 'remote'"):
        transformers.CheckFreqTrainer(checkfreq_options={"remote_dir": "/x"})
