"""Writes tests/data/pre_layers: a checkpoint of checkfreq 0.1.0 before the layered layout (commit 9982f70).

Run from that tree: ``PYTHONPATH=src python make_fixture.py OUT``; then delete ``OUT/run/.checkfreq.lock``.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

import checkfreq as cf
from checkfreq.data import ResumableLoader

out = Path(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
dataset = torch.utils.data.TensorDataset(torch.randn(40, 6), torch.randint(0, 3, (40,)))
loader = ResumableLoader(dataset, batch_size=4, shuffle=True, seed=7)
ckpt = cf.Checkpointer(
    out / "run",
    model=model,
    optimizer=optimizer,
    scheduler=scheduler,
    loader=loader,
    policy=cf.Auto(),
    keep=1,
    values={"best": 0.25, "tag": "pre-layers"},
)
steps = 0
for x, y in loader:
    loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    steps += 1
    ckpt.step(loss=loss.item())
    if steps == 7:
        break
ckpt["best"] = 0.125
ckpt.save(blocking=True)
ckpt.close()
position = loader.state_dict()
expected = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
for i, (_p, s) in enumerate(zip(model.parameters(), optimizer.state.values(), strict=True)):
    expected[f"optimizer/{i}/exp_avg"] = s["exp_avg"].clone()
    expected[f"optimizer/{i}/exp_avg_sq"] = s["exp_avg_sq"].clone()
expected["rng/torch_rand"] = torch.rand(4)
expected["data/rest_x"] = torch.cat([x for x, _ in loader])
save_file(expected, str(out / "expected.safetensors"))
(out / "expected.json").write_text(
    json.dumps(
        {
            "step": steps,
            "lr": scheduler.get_last_lr(),
            "best": 0.125,
            "tag": "pre-layers",
            "next_batch": position,
            "checkfreq": cf.__version__,
            "torch": torch.__version__,
        },
        indent=1,
    )
)
print(sorted(p.name for p in (out / "run").iterdir()))
