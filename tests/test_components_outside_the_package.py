"""Extension by config: a model, a data set, a loss and a metric written outside the package,
each one module of the user's and one YAML in a config dir of theirs, trained with 2 real ranks,
with no edit of src/. This is the promise of the README's "Make it yours".

It is also the self-launch end to end (`python -m hydra_ddp.train dist.nproc_per_node=2`: the
job starts its own 2 workers and hands them the composed config, user classes included): one
job dir, one .hydra/, the launching process's train.log next to each worker's log."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
from conftest import FAST, ok, only_job_dir, python_train, summary, user_env

USER_CODE = {
    "my_models.py": """
        import torch.nn as nn

        class Wide(nn.Module):
            def __init__(self, in_features: int, out_features: int, width: int):
                super().__init__()
                self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, width), nn.ReLU(),
                                         nn.Linear(width, out_features))

            def forward(self, x):
                return self.net(x)
        """,
    "my_data.py": '''
        import numpy as np
        from hydra_ddp.data import InMemoryArrays

        class Blobs(InMemoryArrays):
            """Three Gaussian blobs in `dim` dimensions, made in code."""

            def __init__(self, rows: int, dim: int, seed: int):
                rng = np.random.default_rng(seed)
                centres = rng.normal(0, 3, size=(3, dim))
                y = rng.integers(0, 3, size=rows)
                x = (centres[y] + rng.normal(size=(rows, dim))).astype(np.float32)
                cut = {"val": slice(0, rows // 5), "test": slice(rows // 5, 2 * rows // 5),
                       "train": slice(2 * rows // 5, rows)}
                self.arrays = {s: (x[c], y[c]) for s, c in cut.items()}
                self.spec = {"in_features": dim, "out_features": 3}
        ''',
    "my_losses.py": '''
        import torch
        import torch.nn.functional as F

        class Focal(torch.nn.Module):
            """Focal loss (Lin et al., 2017): cross-entropy that down-weights easy examples."""

            def __init__(self, gamma: float):
                super().__init__()
                self.gamma = gamma

            def forward(self, logits, target):
                logp = F.log_softmax(logits.float(), dim=-1).gather(-1, target[:, None])[:, 0]
                return (-(1 - logp.exp()) ** self.gamma * logp).mean()
        ''',
    "my_metrics.py": """
        import torch

        class ErrorRate:
            def sums(self, output, target):
                wrong = (output.argmax(-1) != target).sum().double()
                return torch.stack([wrong, torch.tensor(float(target.numel()),
                                                        dtype=torch.float64)])

            def compute(self, totals):
                return totals[0] / max(totals[1], 1)
        """,
}
USER_CONF = {
    "model/wide.yaml": "_target_: my_models.Wide\nwidth: 64\n",
    "data/blobs.yaml": textwrap.dedent("""\
        # @package _global_
        defaults:
          - override /loss: focal
          - override /metrics: classification
        data:
          _target_: my_data.Blobs
          rows: 1500
          dim: 5
          seed: 0
        """),
    "loss/focal.yaml": "_target_: my_losses.Focal\ngamma: 2.0\n",
}


# slow: a second real self-launch of user code by YAML; the default suite has one
# (test_user_policy_and_hook.py), and in-process runs of user components (test_config.py).
@pytest.mark.slow
def test_self_launched_user_model_data_loss_and_metric_train_on_two_ranks(tmp_path: Path) -> None:
    code = tmp_path / "mine"
    for name, text in USER_CODE.items():
        (code / name).parent.mkdir(parents=True, exist_ok=True)
        (code / name).write_text(textwrap.dedent(text))
    conf = tmp_path / "my_conf"
    for name, text in USER_CONF.items():
        (conf / name).parent.mkdir(parents=True, exist_ok=True)
        (conf / name).write_text(text)
    env = user_env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(code), env["PYTHONPATH"]])

    proc = ok(
        python_train(
            tmp_path,
            "--config-dir",
            str(conf),
            "dist.nproc_per_node=2",
            *FAST,
            "model=wide",
            "data=blobs",
            "model.width=32",
            "+metrics.err._target_=my_metrics.ErrorRate",
            "trainer.max_steps=60",
            env=env,
            timeout=240,
        )
    )
    job = only_job_dir(tmp_path)
    s = summary(job)
    assert s["world_size"] == 2 and s["steps"] == 60
    assert s["rows_held_per_rank"] == [900, 900]
    assert s["test_acc"] > 0.9, s  # well-separated blobs
    assert abs(s["test_err"] - (1 - s["test_acc"])) < 1e-9  # the user's metric, reduced exactly
    composed = (job / ".hydra" / "config.yaml").read_text()
    for target in ("my_models.Wide", "my_data.Blobs", "my_losses.Focal", "my_metrics.ErrorRate"):
        assert target in composed
    rows = [json.loads(line) for line in (job / "stats" / "rank1.jsonl").open()]
    assert rows[-1]["loss"] < rows[0]["loss"]
    # Self-launched: one job, one .hydra/ dump; the launching process logs to train.log, its
    # workers to train_rank<r>.log.
    assert len(list(tmp_path.rglob(".hydra"))) == 1
    assert (job / "train.log").is_file()
    for rank in (0, 1):
        assert (job / f"train_rank{rank}.log").is_file(), sorted(p.name for p in job.iterdir())
    assert "starting 2 workers" in proc.stdout + proc.stderr
