"""A researcher's own project, through the real loop on two gloo ranks (helpers/ranks.py): a
per-item Dataset from outside the package by config alone (strided and sharded), dict batches
and a model that returns its own loss, a GAN with two optimizers and its own step, fine-tuning
from a checkpoint (a changed head with init_strict=false), evaluating and predicting with
`hydra_ddp.eval`, and resumes that change the optimizer."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import FAST, ok, run, user_env
from helpers.inproc import compose, train_here, train_ranks
from omegaconf import OmegaConf

from hydra_ddp import checkpoint
from hydra_ddp.errors import UserError

TESTS = Path(__file__).resolve().parent


def _blobs(split: str, rows: int, seed: int, log_dir: Path | None = None) -> str:
    log = f",log_dir:'{log_dir}'" if log_dir else ""
    return f"data.{split}={{_target_:helpers.user_data.Blobs,rows:{rows},seed:{seed}{log}}}"


def _blob_job(log_dir: Path | None = None) -> list[str]:
    return [
        *FAST, "data=torch", _blobs("train", 256, 0, log_dir), _blobs("val", 64, 1),
        _blobs("test", 64, 2), "+data.spec={in_features:8,out_features:4}",
        "trainer.batch_size=16", "trainer.epochs=4",
    ]  # fmt: skip


@pytest.mark.parametrize("sampler", [pytest.param("strided", marks=pytest.mark.slow), "sharded"])
def test_a_per_item_dataset_trains_on_two_ranks_by_config_alone(
    tmp_path: Path, sampler: str
) -> None:
    reads = tmp_path / "reads"
    reads.mkdir()
    summaries = train_ranks(tmp_path / "job", *_blob_job(reads), f"sampler={sampler}")
    s = summaries[0]
    assert s["world_size"] == 2 and s["steps"] == 4 * 8  # 128 rows a rank, 16 a batch
    assert s["test_acc"] > 0.9, s
    assert s["rows_held_per_rank"] == ([256, 256] if sampler == "strided" else [128, 128])
    touched = [{int(line) for line in p.read_text().split()} for p in sorted(reads.glob("reads_*"))]
    assert len(touched) == 2 and set().union(*touched) == set(range(256))
    if sampler == "sharded":  # contiguous rows, and no rank touched another's
        assert sorted(map(min, touched)) == [0, 128] and not touched[0] & touched[1]


def test_an_object_that_is_no_data_source_is_named_with_both_contracts(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"a per-item dataset: give one per split through"):
        train_here(tmp_path, *FAST, "~data", "+data._target_=helpers.user_data.Blobs",
                   "+data.rows=8", "+data.seed=0")  # fmt: skip


def test_dict_batches_and_a_model_that_returns_its_own_loss(tmp_path: Path) -> None:
    s = train_ranks(
        tmp_path, *FAST, "experiment=dict_lm", "trainer.max_steps=30", "trainer.log_interval=10"
    )[0]
    assert s["world_size"] == 2 and s["steps"] == 30
    # The model's own mean loss, weighted by the non-padding tokens of each batch.
    assert math.isfinite(s["val_loss"]) and math.isfinite(s["test_loss"])
    assert s["val_loss"] < math.log(103), "learned something beyond uniform over the vocab"


def test_the_gan_trains_on_two_ranks_with_two_optimizers(tmp_path: Path) -> None:
    s = train_ranks(tmp_path, *FAST, "experiment=gan", "trainer.max_steps=40",
                    "trainer.log_interval=10", "trainer.ckpt_interval=20")[0]  # fmt: skip
    assert s["steps"] == 40 and math.isfinite(s["test_loss"])
    records = [
        json.loads(x) for x in (tmp_path / "stats" / "rank1.jsonl").read_text().split("\n") if x
    ]
    assert {"loss", "loss_d", "loss_g"} <= set(records[-1])
    state = checkpoint.load(checkpoint.latest(tmp_path))
    assert set(state["optimizer"]) == {"generator", "discriminator"}
    assert set(state["scheduler"]) == {"generator", "discriminator"}
    # A resume restores both optimizers by name and continues.
    s = train_ranks(tmp_path, *FAST, "experiment=gan", "trainer.max_steps=50")[0]
    assert s["steps"] == 50 and s["steps_this_run"] == 10


@pytest.mark.slow  # each part also in test_weights, test_resume_changes, test_predict
def test_fine_tuning_resume_changes_and_evaluation(tmp_path: Path, caplog) -> None:
    base, tuned, other = tmp_path / "base", tmp_path / "tuned", tmp_path / "other"
    job = [*FAST, "trainer.max_steps=60", "trainer.ckpt_interval=30"]
    first = train_here(base, *job)
    # What Hydra writes for a run of the CLI (in process, there is no Hydra job to write it).
    (base / ".hydra").mkdir()
    OmegaConf.save(compose(*job), base / ".hydra" / "config.yaml")
    # init_from with another optimizer: the weights only, a fresh optimizer and position.
    s = train_here(tuned, *FAST, "trainer.max_steps=20", f"trainer.init_from={base}", "optim=sgd")
    assert s["steps"] == 20 and s["test_acc"] > 0.8, "started from the trained weights"
    # A changed hidden size: strict refuses in one line, non-strict names what it skipped.
    with pytest.raises(UserError, match=r"does not fit this model: .*trainer.init_strict=false"):
        train_here(other, *FAST, "trainer.max_steps=5", f"trainer.init_from={base}",
                   "model.hidden=32")  # fmt: skip
    # Non-strict: the tensors that fit load, and one line names each kind of the rest.
    caplog.set_level(logging.INFO, logger="hydra_ddp.checkpoint")
    for depth in (1, 3):
        caplog.clear()
        train_here(tmp_path / f"depth{depth}", *FAST, "trainer.max_steps=2",
                   f"trainer.init_from={base}", f"model.depth={depth}",
                   "trainer.init_strict=false")  # fmt: skip
        report = [r.getMessage() for r in caplog.records if "trainer.init_from:" in r.getMessage()]
        # One line: the counts, then the names of each kind of mismatch.
        shallow = (  # net.0 fits; net.3 is now the (10, 256) head; net.6 is gone
            "2 matched, 0 missing, 2 unexpected, 2 reshaped-refused tensors; unexpected: "
            "net.6.weight, net.6.bias; reshaped-refused: net.3.weight ("
        )
        deep = (  # net.0 and net.3 fit; net.6 is now a hidden layer; net.9, the head, is new
            "4 matched, 2 missing, 0 unexpected, 2 reshaped-refused tensors; missing: "
            "net.9.weight, net.9.bias; reshaped-refused: net.6.weight ("
        )
        assert len(report) == 1, report
        assert report[0].startswith(
            f"trainer.init_from: {checkpoint.latest(base)} (checkpoint): "
            + (shallow if depth == 1 else deep)
        ), report
    # Resuming an AdamW run with SGD: one line, before any step.
    with pytest.raises(UserError, match=r"another optimizer .*trainer.init_from="):
        train_here(base, *FAST, "trainer.max_steps=80", "optim=sgd")
    # The evaluation of the finished run reproduces its test loss, and predicts every row.
    env = user_env(tmp_path)
    out = ok(run([sys.executable, "-m", "hydra_ddp.eval", f"run={base}", "predict=true"],
                 tmp_path, env=env))  # fmt: skip
    evaluated = json.loads((base / "eval_test.json").read_text())
    assert abs(evaluated["loss"] - first["test_loss"]) < 1e-6, (evaluated, first["test_loss"])
    assert evaluated["acc"] == pytest.approx(first["test_acc"])
    predictions = torch.load(base / "predictions_test.pt")
    assert predictions.shape == (270, 10) and "predictions" in out.stderr


@pytest.mark.slow  # a real launch; the default suite keeps to 5 minutes
def test_a_tiny_transformers_model_trains_on_two_ranks(tmp_path: Path) -> None:
    """The real Hugging Face class (GPT2LMHeadModel, randomly initialised: nothing downloaded),
    dict batches, its own `.loss`; runs where the optional `transformers` extra is installed
    (.ci/run installs it)."""
    pytest.importorskip("transformers")
    s = train_ranks(tmp_path, *FAST, "experiment=dict_lm_transformers", "trainer.max_steps=20",
                    "trainer.log_interval=10")[0]  # fmt: skip
    assert s["world_size"] == 2 and s["steps"] == 20
    assert math.isfinite(s["val_loss"]) and s["val_loss"] < math.log(103)
