"""The training loop: the README's main command end to end (one real torchrun job, checked every
way at once), and everything else on real gloo ranks in process (helpers/ranks.py) or on one rank
in this process (helpers/inproc.py)."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import pytest
import torch
from conftest import FAST, ok, only_job_dir, summary, torchrun, user_env, wandb_env
from helpers import wandb_records
from helpers.inproc import train_here, train_ranks

from hydra_ddp.errors import UserError
from hydra_ddp.models import CNN


def final_params(job_dir: Path) -> dict[str, torch.Tensor]:
    ckpts = sorted((job_dir / "checkpoints").glob("step_*.pt"))
    assert ckpts, f"no checkpoint in {job_dir}"
    return torch.load(ckpts[-1], weights_only=True)["model"]


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        diff = (a[k] - b[k]).abs().max().item()
        assert torch.allclose(a[k], b[k], atol=atol, rtol=0), f"{k}: max diff {diff}"


# --------------------------------------------------------------------------------------------
# The README's main command: one real torchrun job, W&B offline (no account), many checks
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """`torchrun --standalone --nproc_per_node=2 -m hydra_ddp.train trainer.progress=false`
    from a folder outside the checkout; (that folder, the job dir)."""
    cwd = tmp_path_factory.mktemp("default_job")
    ok(torchrun(cwd, "trainer.progress=false", env=user_env(cwd), timeout=300))
    return cwd, only_job_dir(cwd)


def test_default_job_two_ranks_reaches_accuracy(default_job: tuple[Path, Path]) -> None:
    cwd, job = default_job
    s = summary(job)
    assert s["world_size"] == 2 and s["sampler"] == "strided"
    assert s["test_acc"] >= 0.95, s
    assert s["rows_held_per_rank"] == [1257, 1257]  # strided: every rank holds the whole split
    # One .hydra/ dump (global rank 0's), composed from the package's configs though the
    # command ran outside the checkout.
    assert len(list(cwd.rglob(".hydra"))) == 1
    assert "_target_: hydra_ddp.data.Digits" in (job / ".hydra" / "config.yaml").read_text()
    # rank 0's timestamp names the dir (agreed through torchrun's agent store).
    assert job.parent.parent.name == "outputs" and job.name.count("-") == 2, job
    for rank in (0, 1):
        rows = [json.loads(line) for line in (job / "stats" / f"rank{rank}.jsonl").open()]
        assert rows[-1]["loss"] < 0.5 * rows[0]["loss"], "loss did not fall"
        assert (job / f"train_rank{rank}.log").is_file()
    # Per-rank log files only: no two processes append to one train.log.
    assert not (job / "train.log").exists()
    # ddp=default, as DDP itself reports it.
    assert (
        "static_graph=False find_unused_parameters=False gradient_as_bucket_view=False "
        "bucket_cap_mb=25 comm_hook=none" in (job / "train_rank0.log").read_text()
    )


def test_default_job_wandb_offline_run_holds_both_ranks(default_job: tuple[Path, Path]) -> None:
    """No account: one offline run (layout gather) holding both ranks' stats, the aggregates,
    the resolved config as the run config, and a clean finish."""
    _, job = default_job
    files = sorted(job.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    rows = wandb_records.history_rows(files[0])
    keys = set().union(*rows)
    for rank in (0, 1):
        assert {
            f"rank{rank}/loss",
            f"rank{rank}/step_time",
            f"rank{rank}/data_wait",
            f"rank{rank}/rss_mb",
            f"rank{rank}/grad_norm",
        } <= keys, sorted(keys)
    assert {"agg/step_time_max", "agg/slowest_rank", "test/acc"} <= keys
    info = wandb_records.run_info(files[0])
    assert info["config"]["trainer"]["epochs"] == 40
    assert info["config"]["trainer"]["max_steps"] == -1
    assert wandb_records.exit_code(files[0]) == 0


# --------------------------------------------------------------------------------------------
# One rank, in this process
# --------------------------------------------------------------------------------------------


def test_single_process_without_launcher(tmp_path: Path, caplog) -> None:
    """No launcher: one process, no process group, no hang."""
    caplog.set_level(logging.INFO)
    s = train_here(tmp_path / "job", *FAST, "trainer.max_steps=30")
    assert s["world_size"] == 1 and s["steps"] == 30
    assert "process group up" not in caplog.text
    assert summary(tmp_path / "job") == json.loads(json.dumps(s))


# What the job's model and callbacks below saw, read back by the test that ran the job (in
# this process: tests/ is on sys.path, so `test_train.X` is this module).
SEEN: dict[str, list] = {}


class DtypeSeenCNN(CNN):
    """The example CNN, noting the dtype of its conv features and outputs in training."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.features(x.view(-1, *self.shape))
        out = self.head(features)
        if self.training:
            SEEN.setdefault("dtypes", []).append((features.dtype, out.dtype))
        return out


class FlagsSeen:
    """A callback noting, at every step, the torch settings the job's steps ran under."""

    def on_step_end(self, ctx) -> None:
        SEEN.setdefault("flags", []).append(
            (
                torch.are_deterministic_algorithms_enabled(),
                torch.backends.cudnn.benchmark,
                os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            )
        )


def test_ddp_none_single_process_and_bf16_autocast(tmp_path: Path) -> None:
    """trainer.precision=bf16: every training forward ran in bfloat16 (the parameters and the
    data stay float32: autocast casts per op)."""
    SEEN.clear()
    s = train_here(
        tmp_path / "job",
        *FAST,
        "ddp=none",
        "trainer.precision=bf16",
        "model=cnn",
        "model._target_=test_train.DtypeSeenCNN",
        "trainer.max_steps=20",
    )
    assert s["steps"] == 20 and math.isfinite(s["train_loss"])
    assert len(SEEN["dtypes"]) == 20
    assert set(SEEN["dtypes"]) == {(torch.bfloat16, torch.bfloat16)}, set(SEEN["dtypes"])
    weights = final_params(tmp_path / "job")
    assert {w.dtype for w in weights.values()} == {torch.float32}


def test_trainer_deterministic_holds_for_every_step(tmp_path: Path, monkeypatch) -> None:
    """trainer.deterministic=true: every step runs with torch's deterministic algorithms,
    cuBLAS's deterministic workspace and no cuDNN autotuning. (On CPU two runs agree without
    it, so the settings the steps ran under are what can be checked here.)"""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    assert not torch.are_deterministic_algorithms_enabled()
    SEEN.clear()
    overrides = [*FAST, "+callbacks.flags._target_=test_train.FlagsSeen", "trainer.max_steps=3"]
    s = train_here(tmp_path / "job", *overrides, "trainer.deterministic=true")
    assert s["steps"] == 3
    assert SEEN["flags"] == [(True, False, ":4096:8")] * 3


# --------------------------------------------------------------------------------------------
# Two gloo ranks in process
# --------------------------------------------------------------------------------------------


# Unshuffled is the simpler order of the two (the default shuffles): slow, for time.
@pytest.mark.parametrize("shuffle", ["true", pytest.param("false", marks=pytest.mark.slow)])
def test_ddp_matches_one_process_with_the_global_batch(tmp_path: Path, shuffle: str) -> None:
    """2 ranks x batch B end with the parameters of 1 process x batch 2B over the same samples,
    and 2 ranks x B x grad_accum 2 (no_sync on the first micro-step) with those of 1 x 4B.

    The strided permutation depends on the seed and epoch only, so the union of the ranks'
    batches is the single process's batch.
    """
    common = [
        *FAST,
        "trainer.max_steps=12",
        "model.dropout=0",
        f"sampler.shuffle={shuffle}",
        "trainer.grad_clip=1.0",
    ]
    runs = {
        "ddp_b8": (2, ["trainer.batch_size=8"]),
        "one_b16": (1, ["trainer.batch_size=16"]),
        "ddp_b8_accum2": (2, ["trainer.batch_size=8", "trainer.grad_accum=2"]),
        "one_b32": (1, ["trainer.batch_size=32"]),
    }
    params = {}
    for name, (nproc, extra) in runs.items():
        out = tmp_path / name
        if nproc == 2:
            train_ranks(out, *common, *extra)
        else:
            train_here(out, *common, *extra)
        params[name] = final_params(out)
    assert_same_params(params["ddp_b8"], params["one_b16"], atol=1e-5)
    assert_same_params(params["ddp_b8_accum2"], params["one_b32"], atol=1e-5)


@pytest.mark.slow  # sharded training is also in test_sampling's and test_train's uneven shards
def test_sharded_sampler_reaches_the_strided_accuracy_band(tmp_path: Path) -> None:
    """The default job (strided) reaches 0.95 above; sharded, each rank holding its half."""
    s = train_ranks(tmp_path / "job", *FAST, "sampler=sharded")[0]
    assert s["sampler"] == "sharded" and s["test_acc"] >= 0.94, s
    rows = s["rows_held_per_rank"]
    assert sum(rows) == 1257 and max(rows) - min(rows) <= 1


def test_uneven_shards_take_equal_steps_and_finish(tmp_path: Path, synthetic) -> None:
    """3 shard files of different sizes over 2 ranks: rank 0 holds two files, rank 1 one.
    DDP would hang if one rank ran out of batches first; the call's timeout catches that."""
    data = synthetic("uneven", "--rows", "3000", "--shards", "3", "--uneven", "--features", "16")
    manifest = json.loads((data / "manifest.json").read_text())
    sizes = [f["rows"] for f in manifest["splits"]["train"]]
    assert len(set(sizes)) == 3
    s = train_ranks(
        tmp_path / "job",
        *FAST,
        "data=synthetic",
        f"data.path={data}",
        "sampler=sharded",
        "sampler.shard_by=files",
        "trainer.epochs=2",
        "trainer.batch_size=32",
        timeout=120,
    )[0]
    held = s["rows_held_per_rank"]
    assert held == [sizes[0] + sizes[2], sizes[1]]
    assert s["steps"] == 2 * (-(-min(held) // 32))  # both ranks: the smaller rank's batches


def test_sharded_memory_mapped_rank_reads_only_its_rows(tmp_path: Path, synthetic) -> None:
    data = synthetic("mm", "--rows", "4000", "--shards", "2", "--features", "8")
    s = train_ranks(
        tmp_path / "job",
        *FAST,
        "data=synthetic",
        f"data.path={data}",
        "sampler=sharded",
        "data.in_memory=false",
        "trainer.max_steps=10",
    )[0]
    assert s["rows_held_per_rank"] == [2000, 2000]
    # float32 features + int16 labels of 2000 rows
    assert s["bytes_held_per_rank"] == [2000 * (8 * 4 + 2)] * 2


def test_text_gpt_loss_falls(tmp_path: Path) -> None:
    job = tmp_path / "job"
    s = train_ranks(
        job,
        *FAST,
        "data=text",
        "model=gpt",
        "model.n_layer=1",
        "model.n_embd=32",
        "model.n_head=2",
        "data.block_size=32",
        "trainer.max_steps=40",
        "trainer.batch_size=16",
        "optim.lr=0.003",
        "trainer.log_interval=5",
    )[0]
    rows = [json.loads(line) for line in (job / "stats" / "rank0.jsonl").open()]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    assert "tokens_per_s" in s and s["val_loss"] < 3.5  # ln(vocab ~100) = 4.6 at chance
    # The language-model metrics, consistent with the loss (no label smoothing here).
    assert s["val_ppl"] == pytest.approx(math.exp(s["val_loss"]), rel=1e-6)
    assert s["val_bpc"] == pytest.approx(s["val_loss"] / math.log(2), rel=1e-6)


# What each preset must have changed in the DDP wrapper, as rank 0's log reads it back.
PRESET_EFFECT = {
    "default": "static_graph=False find_unused_parameters=False gradient_as_bucket_view=False "
    "bucket_cap_mb=25 comm_hook=none",
    "unused_params": "find_unused_parameters=True",
    "static_graph": "static_graph=True",
    "fp16_compress": "comm_hook=fp16_compress_hook",
    "powersgd": "comm_hook=powerSGD_hook",
}


# The two comm hooks in the default set; the two DDP flags are slow, for time.
SLOW_PRESETS = {"unused_params", "static_graph"}


@pytest.mark.parametrize(
    "ddp",
    [pytest.param(d, marks=pytest.mark.slow) if d in SLOW_PRESETS else d for d in PRESET_EFFECT],
)
def test_ddp_presets_train_and_take_effect(tmp_path: Path, ddp: str) -> None:
    extra = ["ddp.powersgd_start_iter=2"] if ddp == "powersgd" else []
    done = train_ranks(tmp_path / "job", *FAST, f"ddp={ddp}", "trainer.max_steps=20", *extra)
    assert done[0]["steps"] == 20
    log = done.logs[0]
    assert PRESET_EFFECT[ddp] in log, [ln for ln in log.splitlines() if "DDP:" in ln]


def test_bf16_compress_on_gloo_is_refused_clearly(tmp_path: Path) -> None:
    """torch's bf16 hook needs NCCL; on gloo every rank says so in one line (GPU check: docs/)."""
    done = train_ranks(
        tmp_path / "job", *FAST, "ddp=bf16_compress", "trainer.max_steps=5", return_exceptions=True
    )
    for error in done:
        assert isinstance(error, UserError), error
        assert str(error).startswith("ddp=bf16_compress") and "\n" not in str(error)


def test_sgd_and_gradient_accumulation_two_ranks(tmp_path: Path) -> None:
    job = tmp_path / "job"
    s = train_ranks(
        job,
        *FAST,
        "optim=sgd",
        "trainer.grad_accum=3",
        "trainer.max_steps=15",
        "trainer.eval_interval=5",
    )[0]
    assert s["steps"] == 15 and s["world_size"] == 2
    evals = [json.loads(line) for line in (job / "stats" / "eval.jsonl").open()]
    assert [e["step"] for e in evals][:2] == [5, 10]


def test_wandb_group_layout_one_run_per_rank(tmp_path: Path) -> None:
    job = tmp_path / "job"
    train_ranks(
        job,
        "trainer.progress=false",
        "trainer.max_steps=10",
        "logger.layout=group",
        env=wandb_env(tmp_path),
    )
    files = sorted(job.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2, files
    infos = [wandb_records.run_info(f) for f in files]
    assert sorted(i["job_type"] for i in infos) == ["rank0", "rank1"]
    assert len({i["group"] for i in infos}) == 1
    assert [wandb_records.exit_code(f) for f in files] == [0, 0]


def test_regression_job_reports_mse_and_r2(tmp_path: Path) -> None:
    """data=diabetes picks loss=mse and the regression metrics by itself."""
    s = train_ranks(
        tmp_path / "job", *FAST, "data=diabetes", "trainer.batch_size=32", "trainer.epochs=30"
    )[0]
    assert s["world_size"] == 2
    assert s["val_loss"] == pytest.approx(s["val_mse"], rel=1e-6)  # the loss is the MSE
    # The target is standardised: predicting its mean scores R^2 = 0, MSE ~ 1.
    assert s["test_r2"] > 0.3 and s["test_mse"] < 0.8, s
    assert "val_acc" not in s


@pytest.mark.slow
def test_label_smoothing_from_the_command_line(tmp_path: Path) -> None:
    """The smoothed loss cannot fall below the entropy of the smoothed targets (0.50 nats for
    0.1 over 10 classes), while accuracy is still reported and high."""
    s = train_ranks(tmp_path / "job", *FAST, "loss.label_smoothing=0.1", "trainer.epochs=20")[0]
    assert s["train_loss"] > 0.45 and s["val_loss"] > 0.45, s
    assert s["test_acc"] >= 0.9, s
