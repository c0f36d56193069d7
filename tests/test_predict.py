"""`python -m hydra_ddp.eval run=<dir> predict=true` for outputs of every shape the template
trains: a tensor, a tuple, a dict without `logits` (every per-row entry, or the one predict_key
names), and text padded to each batch's longest (kept per row, or padded to the split's longest
with the pad value recorded). Each on 1 rank (the entry, in process) and 2 gloo ranks, with row
order and count equal to the split, checked against the model run on each row by hand. An error
while predicting names the rank and the cause, and suggests no restart."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import conftest
import pytest
import torch
from conftest import FAST
from helpers import ranks
from helpers.inproc import compose, isolated, train_here
from omegaconf import OmegaConf

from hydra_ddp import checkpoint
from hydra_ddp.batches import forward
from hydra_ddp.components import build
from hydra_ddp.data import EvalData
from hydra_ddp.distributed import DistEnv
from hydra_ddp.eval import job_config, main, parse
from hydra_ddp.loop.evaluation import evaluate_run
from hydra_ddp.tracking import RunInfo

MLP_JOBS = {
    "tensor": [],
    "tuple": ["model._target_=helpers.predict_models.TupleOut",
              "loss._target_=helpers.predict_models.scores_loss", "metrics=none"],
    "dict": ["model._target_=helpers.predict_models.DictOut",
             "loss._target_=helpers.predict_models.scores_loss", "metrics=none"],
}  # fmt: skip


def _trained(run: Path, *overrides: str) -> Path:
    """A finished 2-step run in `run`, with the .hydra/config.yaml the CLI would write."""
    job = [*FAST, "trainer.max_steps=2", *overrides]
    train_here(run, *job)
    (run / ".hydra").mkdir()
    OmegaConf.save(compose(*job), run / ".hydra" / "config.yaml")
    return run


def _eval_rank(env: DistEnv, run: Path, args: list[str]) -> dict:
    """What each worker of `python -m hydra_ddp.eval ... dist.nproc_per_node=2` runs."""
    request, overrides = parse([f"run={run}", *args])
    cfg = job_config(run, overrides)
    return evaluate_run(cfg, env, RunInfo(output_dir=run, job_name="eval", group="eval",
                                          config={}), request)  # fmt: skip


def _predict(run: Path, ranks_: int, *args: str) -> tuple[object, dict]:
    out = run / "predictions_test.pt"
    out.unlink(missing_ok=True)
    if ranks_ == 1:
        with isolated(), _no_exit():
            main([f"run={run}", "predict=true", *args])
    else:
        ranks.run(_eval_rank, run, ["predict=true", *args], world_size=2, group=False,
                  timeout=120)  # fmt: skip
    return torch.load(out), json.loads(out.with_suffix(".json").read_text())


class _no_exit:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, value, tb) -> bool:
        if kind is SystemExit:
            raise AssertionError(f"hydra_ddp.eval exited with {value.code}")
        return False


def _by_hand(run: Path) -> tuple[torch.nn.Module, list]:
    """The trained model and the test split's batches of one row each, in the split's order."""
    cfg = job_config(run, [])
    source = build(cfg.data, "data")
    model = build(cfg.model, "model", **source.spec)
    model.load_state_dict(checkpoint.load(checkpoint.latest(run))["model"])
    split = EvalData(source, "test", cfg.sampler, DistEnv(), 1)
    return model.eval(), list(split)


@pytest.fixture(scope="module")
def mlp_runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("predict")
    return {kind: _trained(root / kind, *o) for kind, o in MLP_JOBS.items()}


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_tensor_tuple_and_dict_outputs_in_the_splits_row_order(mlp_runs, world: int) -> None:
    for kind, run in mlp_runs.items():
        model, rows = _by_hand(run)
        with torch.no_grad():
            outputs = [forward(model, batch) for batch in rows]
        saved, described = _predict(run, world)
        assert described["rows"] == len(rows) == 270 and described["kind"] == kind
        if kind == "tensor":
            expected = torch.cat(outputs)
            assert saved.shape == (270, 10) and torch.allclose(saved, expected, atol=1e-5)
        elif kind == "tuple":  # the scalar (no row per batch row) is left out: None
            assert len(saved) == 3 and saved[2] is None
            assert torch.allclose(saved[0], torch.cat([o[0] for o in outputs]), atol=1e-5)
            assert torch.allclose(saved[1], torch.cat([o[1] for o in outputs]), atol=1e-5)
        else:  # every per-row entry of a dict without logits
            assert set(saved) == {"scores", "embedding"}
            expected = torch.cat([o["embedding"] for o in outputs])
            assert torch.equal(saved["embedding"], expected)
            assert torch.allclose(saved["scores"], torch.cat([o["scores"] for o in outputs]),
                                  atol=1e-5)  # fmt: skip
    # predict_key: the one entry named, saved as a tensor.
    saved, described = _predict(mlp_runs["dict"], world, "predict_key=embedding")
    assert isinstance(saved, torch.Tensor) and saved.shape == (270, 3)
    assert described["key"] == "embedding"


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_padded_text_kept_per_row_or_padded_to_the_longest(tmp_path: Path, world: int) -> None:
    run = _trained(tmp_path / "lm", "experiment=dict_lm")
    model, rows = _by_hand(run)
    with torch.no_grad():  # one row at a time: no padding at all
        alone = [forward(model, batch).logits[0] for batch in rows]
    lengths = [len(a) for a in alone]
    assert len(alone) == 128 and len(set(lengths)) > 1
    per_row, described = _predict(run, world)
    assert isinstance(per_row, list) and len(per_row) == 128
    assert described["entries"]["output"]["shape"] == "one tensor per row"
    for got, want in zip(per_row, alone):  # the row's batch padded it on the right
        assert got.shape[0] >= len(want)
        assert torch.allclose(got[: len(want)], want, atol=1e-4)
    padded, described = _predict(run, world, "predict_pad=-100")
    longest = max(p.shape[0] for p in per_row)
    assert padded.shape == (128, longest, 103) and described["pad_value"] == -100
    assert described["entries"]["output"]["padded"] is True
    for i, row in enumerate(per_row):
        assert torch.equal(padded[i, : row.shape[0]], row)
        assert (padded[i, row.shape[0] :] == -100).all()


@pytest.mark.slow
def test_an_error_while_predicting_names_the_rank_and_the_cause(mlp_runs, caplog) -> None:
    with caplog.at_level(logging.ERROR), isolated(), pytest.raises(SystemExit) as stopped:
        main([f"run={mlp_runs['dict']}", "predict=true", "predict_key=nope"])
    assert stopped.value.code == 2
    with pytest.raises(Exception, match=r"predict_key=nope is no tensor of the model's output "
                                        r"\(scores, embedding, aux\)"):  # fmt: skip
        ranks.run(_eval_rank, mlp_runs["dict"], ["predict=true", "predict_key=nope"],
                  world_size=2, group=False, timeout=120)  # fmt: skip
    # A model that fails on one rank only: that rank names itself and the cause; the other
    # says it lost contact during prediction, and suggests no restart (that resumes training).
    results = ranks.run(_eval_rank, mlp_runs["tensor"],
                        ["predict=true", "model._target_=helpers.predict_models.FailsOnRank1"],
                        world_size=2, group=False, timeout=120, return_exceptions=True)  # fmt: skip
    lines = [str(r).splitlines()[0] for r in results]
    assert lines[1].startswith("rank 1 failed while evaluating split test: ValueError: boom")
    assert "rank 0 lost contact with another rank while evaluating" in lines[0], lines
    assert "max-restarts" not in " ".join(lines)


def test_evaluating_with_another_model_is_one_line(mlp_runs, caplog) -> None:
    with caplog.at_level(logging.ERROR), isolated(), pytest.raises(SystemExit) as stopped:
        main([f"run={mlp_runs['tensor']}", "model.hidden=64"])
    assert stopped.value.code == 2
    line = caplog.records[-1].getMessage()
    assert "is a checkpoint of a different model (size mismatch" in line, line
    assert "drop the model.* overrides" in line and "\n" not in line, line


@pytest.mark.slow  # a real self-launch of the eval entry
def test_a_self_launched_eval_names_the_rank_that_failed(mlp_runs, tmp_path: Path) -> None:
    """The launcher's last line names the rank whose own error came first (rank 1's), not the
    rank that only lost contact with it, and suggests no restart."""
    proc = conftest.run([sys.executable, "-m", "hydra_ddp.eval", f"run={mlp_runs['tensor']}",
                "dist.nproc_per_node=2", "model._target_=helpers.predict_models.FailsOnRank1"],
               tmp_path, env=_with_tests_on_path(tmp_path))  # fmt: skip
    assert proc.returncode != 0, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "rank 1" in last and "boom on rank 1" in last, proc.stderr[-2000:]
    assert "max-restarts" not in proc.stderr


def _with_tests_on_path(tmp: Path) -> dict[str, str]:
    env = conftest.user_env(tmp)
    env["PYTHONPATH"] += f"{os.pathsep}{Path(__file__).parent}"  # predict_models
    return env
