"""The ``checkfreq`` inspection commands on checkpoints written by a real training run."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import checkfreq as cf
from checkfreq.cli import app
from checkfreq.data import ResumableLoader
from helpers import make_model

STEPS_PER_EPOCH = 4
runner = CliRunner()


def train(directory: Path, epochs: int = 5, width: int = 32) -> dict[str, torch.Tensor]:
    """A real small run: checkpoint every 5 steps; returns the model's final state."""
    model = make_model(width=width)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    loader = ResumableLoader(data, batch_size=16, shuffle=True, seed=1)
    with cf.Checkpointer(
        directory, model=model, optimizer=opt, loader=loader, policy=5, keep=10, values={"note": "cli"}
    ) as ckpt:
        for _ in range(loader.epoch, epochs):
            for x, y in loader:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                ckpt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    directory = tmp_path_factory.mktemp("cli") / "run"
    return directory, train(directory)


@pytest.fixture
def run(trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> Path:
    """A private copy of the trained run, free to damage."""
    return Path(shutil.copytree(trained[0], tmp_path / "run"))


def invoke(*args: str, columns: int | None = None) -> tuple[int, str]:
    """Run the command; ``columns`` sets the terminal width its tables must fit."""
    result = runner.invoke(app, [str(a) for a in args], env=None if columns is None else {"COLUMNS": str(columns)})
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def as_json(*args: str) -> object:
    code, out = invoke(*args, "--json")
    assert code == 0, out
    return json.loads(out)


def data_file(checkpoint: Path) -> Path:
    return checkpoint / "rank00000.safetensors"


def damage(run: Path) -> tuple[Path, Path]:
    """Flip one byte of step 10 (same size) and truncate step 15's data file."""
    flipped, truncated = run / "step_000000010", run / "step_000000015"
    raw = bytearray(data_file(flipped).read_bytes())
    raw[-3] ^= 0xFF
    data_file(flipped).write_bytes(bytes(raw))
    with open(data_file(truncated), "r+b") as f:
        f.truncate(data_file(truncated).stat().st_size - 100)
    return flipped, truncated


def test_ls_lists_every_checkpoint_with_step_epoch_and_validity(run: Path) -> None:
    listing = as_json("ls", run)
    assert [c["step"] for c in listing] == [20, 15, 10, 5]
    # the loader's epoch as the checkpoint holds it: after an epoch's last step (20), the next epoch
    assert [c["epoch"] for c in listing] == [s // STEPS_PER_EPOCH for s in (20, 15, 10, 5)]
    assert all(c["valid"] and c["reason"] is None and c["bytes"] > 1000 for c in listing)
    code, out = invoke("ls", run)
    assert code == 0 and "step_000000020" in out and "4 valid, 0 invalid" in out
    # The size column counts every file of the checkpoint, and says so.
    checkpoint = run / "step_000000020"
    assert listing[0]["bytes"] == sum(f.stat().st_size for f in checkpoint.iterdir())
    assert "size: its data files and manifest.json on disk" in out


def test_ls_marks_invalid_checkpoints_and_says_why(run: Path) -> None:
    flipped, truncated = damage(run)
    listing = {c["name"]: c for c in as_json("ls", run)}
    assert not listing[flipped.name]["valid"] and "checksum" in listing[flipped.name]["reason"]
    assert not listing[truncated.name]["valid"] and "bytes" in listing[truncated.name]["reason"]
    assert listing["step_000000020"]["valid"] and listing["step_000000005"]["valid"]
    # --quick reads no data: it sees the truncation but not the flipped byte.
    quick = {c["name"]: c["valid"] for c in as_json("ls", run, "--quick")}
    assert quick[flipped.name] and not quick[truncated.name]
    code, out = invoke("ls", run)
    assert code == 0 and "INVALID" in out and "2 valid, 2 invalid" in out


def test_verify_exits_nonzero_naming_each_bad_checkpoint(run: Path) -> None:
    assert invoke("verify", run)[0] == 0
    flipped, truncated = damage(run)
    code, out = invoke("verify", run, "--no-set-aside")
    assert code == 1
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 2 and flipped.name in failed[1] and truncated.name in failed[0]
    assert "checksum" in out and "2 of 4 checkpoints verified" in out
    report = as_json_allow_failure("verify", run, "--no-set-aside")
    assert report["ok"] is False and sorted(c["name"] for c in report["checkpoints"] if not c["valid"]) == [
        flipped.name,
        truncated.name,
    ]
    assert invoke("verify", run / "step_000000020")[0] == 0
    assert invoke("verify", run / "step_10", "--no-set-aside")[0] == 1  # unpadded step names resolve too
    # Without --no-set-aside, what fails is set aside: never restored again, not counted by keep=.
    report = as_json_allow_failure("verify", run)
    assert report["ok"] is False and sorted(
        c["set_aside"].split(".")[0] for c in report["checkpoints"] if c["set_aside"]
    ) == [flipped.name, truncated.name]
    assert invoke("verify", run)[0] == 0 and "2 valid, 0 invalid, 2 set aside" in invoke("ls", run, columns=300)[1]


def as_json_allow_failure(*args: str) -> dict:
    return json.loads(invoke(*args, "--json")[1])


def test_verify_real_process_exit_status(run: Path) -> None:
    damage(run)
    proc = subprocess.run(
        [sys.executable, "-m", "checkfreq.cli", "verify", str(run)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED step_000000010" in proc.stdout


def test_verify_of_an_empty_directory_fails(tmp_path: Path) -> None:
    code, out = invoke("verify", tmp_path)
    assert code == 1 and "no checkpoint" in out


def test_inspect_shows_tensors_objects_and_versions(trained: tuple[Path, dict[str, torch.Tensor]]) -> None:
    run, final = trained
    info = as_json("inspect", run / "step_000000020")
    tensors = {t["name"]: t for t in info["tensors"]}
    for key, value in final.items():
        entry = tensors[f"model/{key}"]
        assert entry["shape"] == list(value.shape)
        assert entry["bytes"] == value.numel() * value.element_size()
    assert tensors["model/0.weight"]["dtype"] == "F32" and tensors["model/1.num_batches_tracked"]["dtype"] == "I64"
    assert any(name.startswith("optimizer/state/") for name in tensors)
    # step 20 ends epoch 4: the loader it holds is at the start of epoch 5, and so is the label
    assert info["step"] == 20 and info["epoch"] == 5 and info["versions"]["torch"] == torch.__version__
    assert info["objects"]["note"] == {"tensors": 0, "bytes": 0, "value": "cli"}
    assert info["objects"]["model"]["tensors"] == len(final)
    code, out = invoke("inspect", run)
    assert code == 0 and "model/0.weight" in out and "(32, 8)" in out and torch.__version__ in out


def test_inspect_of_a_run_picks_its_newest_valid_checkpoint(run: Path) -> None:
    raw = bytearray(data_file(run / "step_000000020").read_bytes())
    raw[-1] ^= 1
    data_file(run / "step_000000020").write_bytes(bytes(raw))
    assert as_json("inspect", run)["step"] == 15


def test_export_pt_loads_with_weights_only_into_a_fresh_model(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    run, final = trained
    code, out = invoke("export", run, "--to", tmp_path / "model.pt", "--only", "model")
    assert code == 0, out
    fresh = make_model(seed=123)
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), strict=True)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, final[key]), key
    # The file holds the model only, not the whole data section its tensors were views of.
    assert (tmp_path / "model.pt").stat().st_size < data_file(run / "step_000000020").stat().st_size


def test_export_safetensors_loads_into_a_fresh_model(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    run, final = trained
    result = as_json("export", run, "--to", tmp_path / "model.safetensors", "--only", "model")
    assert result["step"] == 20 and result["tensors"] == len(final) and result["dropped"] == {}
    fresh = make_model(seed=7)
    fresh.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=True)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, final[key]), key


def test_export_of_everything_restores_model_and_optimizer(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    run, _ = trained
    assert invoke("export", run / "step_000000010", "--to", tmp_path / "all.pt")[0] == 0
    state = torch.load(tmp_path / "all.pt", weights_only=True)
    assert set(state) == {"model", "optimizer", "loader", "rng", "note", "checkfreq"}
    model = make_model(seed=3)
    model.load_state_dict(state["model"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt.load_state_dict(state["optimizer"])
    assert state["checkfreq"]["global_step"] == 10 and int(opt.state_dict()["state"][0]["step"]) == 10
    flat = as_json("export", run, "--to", tmp_path / "all.safetensors")
    assert flat["dropped"]["note"] == 1 and "optimizer" in flat["dropped"]
    assert "optimizer/state/0/exp_avg" in load_file(tmp_path / "all.safetensors")


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_files_get_the_permissions_of_any_new_file(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, umask: int
) -> None:
    run, _ = trained
    previous = os.umask(umask)
    try:
        for name in ("model.pt", "model.safetensors"):
            assert invoke("export", run, "--to", tmp_path / name, "--only", "model")[0] == 0
            assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name
    finally:
        os.umask(previous)


def test_export_errors_are_clear(trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    run, _ = trained
    code, out = invoke("export", run, "--to", tmp_path / "model.bin")
    assert code == 2 and ".safetensors" in out
    code, out = invoke("export", run, "--to", tmp_path / "m.pt", "--only", "modle")
    assert code == 2 and "'modle'" in out and "model" in out
    assert not (tmp_path / "m.pt").exists()


def test_diff_reports_which_tensors_differ_and_by_how_much(trained: tuple[Path, dict[str, torch.Tensor]]) -> None:
    run, _ = trained
    code, out = invoke("diff", run / "step_000000020", run)
    assert code == 0 and "0 of" in out
    code, _ = invoke("diff", run / "step_000000005", run / "step_000000010")
    assert code == 1
    result = as_json_allow_failure("diff", run / "step_000000005", run / "step_000000010")
    rows = {t["name"]: t for t in result["tensors"]}
    _, a = cf.read_checkpoint(run / "step_000000005")
    _, b = cf.read_checkpoint(run / "step_000000010")
    weight = rows["model/0.weight"]
    assert weight["status"] == "differs" and weight["numel"] == 256
    assert weight["max_abs"] == pytest.approx(float((a["model/0.weight"] - b["model/0.weight"]).abs().max()))
    expected_rel = float(
        (a["model/0.weight"].double() - b["model/0.weight"].double()).norm() / a["model/0.weight"].double().norm()
    )
    assert weight["rel_l2"] == pytest.approx(expected_rel)
    assert rows["model/1.num_batches_tracked"]["max_abs"] == 5
    assert result["identical"] is False and result["step_a"] == 5 and result["step_b"] == 10


def test_diff_flags_shape_mismatches(trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    run, _ = trained
    other = tmp_path / "narrow"
    model = make_model(width=16)
    with cf.Checkpointer(other, model=model, policy=1) as ckpt:
        ckpt.save(blocking=True)
    rows = {t["name"]: t for t in as_json_allow_failure("diff", run, other)["tensors"]}
    assert rows["model/0.weight"]["status"] == "mismatch" and "(16, 8)" in rows["model/0.weight"]["detail"]
    assert rows["optimizer/state/0/exp_avg"]["status"] == "only_a"


def test_diff_and_inspect_fit_80_columns_with_long_names_and_mismatches(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    run, _ = trained
    other = tmp_path / "narrow"
    long_name = "an_embedding_table_with_a_rather_long_name_for_a_terminal"
    with cf.Checkpointer(other, model=make_model(width=16), policy=1, values={long_name: torch.zeros(3)}) as ckpt:
        ckpt.save(blocking=True)
    code, out = invoke("diff", run, other, columns=80)
    table = out.splitlines()[2:]  # after the A: and B: paths
    assert code == 1 and "…" not in out and max(len(line) for line in table) <= 80
    assert "mismatch: A (32, 8)" in out and "optimizer/state/3/exp_avg_sq" in out
    width = next(line for line in table if line.startswith("tensor")).index("status")
    assert long_name in "".join(line[:width].strip() for line in table)  # folded over lines, but whole
    code, out = invoke("diff", run / "step_000000005", run / "step_000000010", "--all", columns=80)
    assert code == 1 and "…" not in out and "differs" in out and "equal" in out
    code, out = invoke("inspect", other, columns=80)
    tensors = out[out.index("tensors, ") :].splitlines()[1:]
    assert code == 0 and "…" not in "".join(tensors) and max(len(line) for line in tensors) <= 80
    border = next(line for line in tensors if "name" in line).index("┃", 1)
    assert long_name in "".join(line[1:border].strip() for line in tensors)  # folded over lines, not cut


def test_diff_of_a_damaged_checkpoint_names_the_side(run: Path) -> None:
    flipped, _ = damage(run)
    code, out = invoke("diff", run / "step_000000005", flipped)
    assert code == 2 and f"checkpoint B ({flipped})" in out and "fails its checksum" in out
    code, out = invoke("diff", flipped, run / "step_000000005")
    assert code == 2 and f"checkpoint A ({flipped})" in out


def test_help_shows_flags_without_a_value_type() -> None:
    for args in (["--help"], ["ls", "--help"], ["diff", "--help"], ["report", "--help"]):
        code, out = invoke(*args, columns=80)
        assert code == 0 and "--help" in out and "<bool>" not in out, args
    assert "<path>" in invoke("export", "--help", columns=80)[1]  # options that take a value still say which


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    code, out = invoke("ls", tmp_path / "nope")
    assert code == 2 and "does not exist" in out
    code, out = invoke("inspect", tmp_path / "nope")
    assert code == 2 and "nope" in out


def test_commands_take_fsspec_urls(tmp_path: Path) -> None:
    fsspec = pytest.importorskip("fsspec")
    url = f"memory://cli-{tmp_path.name}"
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with cf.Checkpointer(url, model=model, optimizer=opt, policy=5, keep=3) as ckpt:
        for _ in range(15):
            loss = torch.nn.functional.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 3, (16,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            ckpt.step()
    assert [c["step"] for c in as_json("ls", url)] == [15, 10, 5]
    assert as_json("inspect", f"{url}/step_10")["path"] == f"{url}/step_000000010"
    assert invoke("export", url, "--to", tmp_path / "m.safetensors", "--only", "model")[0] == 0
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in load_file(tmp_path / "m.safetensors").items())
    fs = fsspec.filesystem("memory")
    path = f"{url.removeprefix('memory://')}/step_000000010/rank00000.safetensors"
    raw = bytearray(fs.cat_file(path))
    raw[-1] ^= 1
    fs.pipe_file(path, bytes(raw))
    code, out = invoke("verify", url)
    assert code == 1 and "FAILED step_000000010" in out and "checksum" in out
    fs.rm(url.removeprefix("memory://"), recursive=True)


def test_a_checkpoint_without_its_manifest_is_listed_invalid(run: Path) -> None:
    (run / "step_000000005" / "manifest.json").unlink()
    listing = {c["name"]: c for c in as_json("ls", run, "--quick")}
    assert not listing["step_000000005"]["valid"] and "manifest.json is missing" in listing["step_000000005"]["reason"]
    code, out = invoke("verify", run)
    assert code == 1 and "FAILED step_000000005: manifest.json is missing" in out


def test_diff_compares_the_values_that_are_not_tensors(tmp_path: Path) -> None:
    """A learning rate kept as a plain value (or in an optimizer's parameter groups), a position
    or a random state that differs makes two checkpoints differ, though every tensor is equal;
    what the runs measured (the reserved ``checkfreq`` entry) does not."""

    def save(name: str, lr: float, position: int) -> Path:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        with cf.Checkpointer(
            tmp_path / name,
            model=model,
            optimizer=opt,
            policy=1,
            rng=False,
            values={"lr": lr, "position": {"epoch": 2, "batch": position}, "hidden": None},
        ) as ckpt:
            ckpt.save(blocking=True)
        return tmp_path / name

    first, again, other = save("first", 20.0, 7), save("again", 20.0, 7), save("other", 5.0, 8)
    result = as_json_allow_failure("diff", first, other)
    rows = {v["name"]: v for v in result["values"]}
    code, out = invoke("diff", first, again)
    assert code == 0 and "0 of 2 tensors differ" in out and f"0 of {len(rows)} other values differ" in out
    code, out = invoke("diff", first, other, columns=80)
    assert code == 1 and "0 of 2 tensors differ" in out and f"3 of {len(rows)} other values differ" in out
    assert "lr" in out and "20.0" in out and "5.0" in out
    assert result["identical"] is False and all(t["status"] == "equal" for t in result["tensors"])
    assert rows["lr"] == {"name": "lr", "status": "differs", "a": 20.0, "b": 5.0}
    assert rows["optimizer/param_groups/0/lr"]["status"] == "differs"
    assert rows["position/batch"]["a"] == 7 and rows["position/batch"]["b"] == 8
    assert rows["position/epoch"]["status"] == rows["hidden"]["status"] == "equal"
    assert not any(name.startswith("checkfreq") for name in rows)
