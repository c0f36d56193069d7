"""Pruned Optuna sweeps (`hydra/sweeper=optuna_pruned`, `hparams_search=digits_optuna_pruned`).

Default suite: the preset composes (and its pruner swaps); a job that is a trial reports its
monitored metric at each evaluation to a real SQLite study and, when the pruner says so, stops
on both of its gloo ranks at that evaluation with a checkpoint; the sweep report lists such a
job as PRUNED with its step and not as a failure; a sweep without evaluations is refused in one
line. Slow: a real pruned sweep of the command a user types, killed after some trials and
continued by the same command to n_trials in all; the same under submitit's local launcher;
hydra/launcher=ray with two trials in flight is in test_ray_sweeps.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FAST, job_dirs, summary, user_env
from omegaconf import OmegaConf

from hydra_ddp.launch.command import find_own_plugins
from hydra_ddp.loop import pruning
from hydra_ddp.rundir import sweeps

optuna = pytest.importorskip("optuna")
pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
find_own_plugins()  # src/hydra_plugins of this checkout, as the entry point finds it

from hydra_plugins.hydra_ddp_optuna_pruned import _study  # noqa: E402

# Every trial is pruned at its first evaluation from step 15 on (no accuracy reaches 1.1): a
# pruner whose verdict does not depend on how the training went.
ALWAYS_AT_20 = {"_target_": "optuna.pruners.ThresholdPruner", "lower": 1.1, "n_warmup_steps": 15}
ALWAYS_AT_20_CLI = [
    "~hydra/sweeper/pruner",
    "+hydra.sweeper.pruner={_target_:optuna.pruners.ThresholdPruner,lower:1.1,n_warmup_steps:15}",
]


def _compose(*overrides: str):
    from helpers.inproc import compose

    return compose(*overrides, return_hydra_config=True)


def test_pruned_preset_composes_and_its_pruner_swaps() -> None:
    cfg = _compose("hparams_search=digits_optuna_pruned")
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("PrunedOptunaSweeper"), sweeper._target_
    assert sweeper.pruner._target_ == "optuna.pruners.SuccessiveHalvingPruner"
    assert sweeper.pruner.reduction_factor == 2
    assert sweeper.direction.name == "maximize" and cfg.trainer.monitor == "val/acc"
    assert sweeper.n_trials == 16 and set(sweeper.params) == {"optim.lr", "model.hidden"}
    assert cfg.trainer.eval_interval > 0
    # No timestamp in the sweep dir: the same command continues the same study.
    assert cfg.hydra.sweep.dir == "multirun/digits_mlp_pruned"
    cfg = _compose("hparams_search=digits_optuna_pruned", "hydra/sweeper/pruner=median")
    assert OmegaConf.to_container(cfg.hydra.sweeper.pruner) == {
        "_target_": "optuna.pruners.MedianPruner", "n_startup_trials": 4, "n_warmup_steps": 0
    }  # fmt: skip
    cfg = _compose("hparams_search=digits_optuna_pruned", *ALWAYS_AT_20_CLI)
    assert OmegaConf.to_container(cfg.hydra.sweeper.pruner) == ALWAYS_AT_20


def test_a_sweep_without_evaluations_is_refused_in_one_line(caplog) -> None:
    cfg = _compose("hparams_search=digits_optuna_pruned", "trainer.eval_interval=0")
    with pytest.raises(SystemExit) as info:
        _study._check_evaluations(cfg)
    assert info.value.code == 2
    [line] = [r.getMessage() for r in caplog.records if "error:" in r.getMessage()]
    assert "trainer.eval_interval=0" in line and "\n" not in line


def _study_with_a_trial(tmp: Path, pruner: dict) -> tuple[str, int]:
    url = f"sqlite:///{tmp / 'optuna.db'}"
    study = optuna.create_study(study_name="s", storage=url, direction="maximize")
    study.set_user_attr(pruning.PRUNER_ATTR, pruner)
    return url, study.ask().number


@pytest.mark.timeout(300)
def test_a_pruned_trial_stops_every_rank_at_an_evaluation_with_a_checkpoint(
    tmp_path: Path,
) -> None:
    from helpers.inproc import train_ranks

    url, number = _study_with_a_trial(tmp_path, ALWAYS_AT_20)
    env = {
        pruning.STORAGE_ENV: url,
        pruning.STUDY_ENV: "s",
        pruning.TRIAL_ENV: str(number),
    }
    out = tmp_path / "job"
    results = train_ranks(
        out, *FAST, "trainer.max_steps=60", "trainer.eval_interval=10", "trainer.monitor=val/acc",
        "trainer.monitor_mode=max", world_size=2, env=env,
    )  # fmt: skip
    # Both ranks stopped at the evaluation of step 20, rank 0's verdict.
    assert [r["steps"] for r in results] == [20, 20], results
    assert all(r["pruned"] and r["stopped_early"] for r in results), results
    assert summary(out)["pruned"] is True and summary(out)["steps"] == 20
    assert (out / "checkpoints" / "step_00000020.pt").is_file()
    trial = optuna.load_study(study_name="s", storage=url).trials[number]
    # Reported at each evaluation; marked for the sweeper, which alone tells Optuna.
    assert sorted(trial.intermediate_values) == [10, 20], trial.intermediate_values
    assert trial.intermediate_values[20] == pytest.approx(summary(out)["val_acc"])
    assert trial.user_attrs[pruning.PRUNED_ATTR] == 20
    assert trial.state == optuna.trial.TrialState.RUNNING


def test_the_report_lists_a_pruned_job_with_its_step_and_not_as_failed(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    for num, extra in ((0, {"steps": 60}), (1, {"steps": 20, "pruned": True})):
        job = sweep / f"{num}_optim.lr={num}"
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- optim.lr={num}\n")
        stats = {"objective": 0.5 + num / 10, "val_acc": 0.5 + num / 10, **extra}
        (job / "summary.json").write_text(json.dumps(stats))
    config = OmegaConf.create(
        {
            "hydra": {"sweep": {"dir": str(sweep)}, "overrides": {"task": ["optim.lr=0,1"]}},
            "trainer": {"monitor": "val/acc", "monitor_mode": "max"},
        }
    )
    sweeps.SweepReport().on_multirun_end(config)
    jobs = json.loads((sweep / "sweep_report.json").read_text())
    assert [(j["status"], j["steps"]) for j in jobs] == [("ok", 60), ("PRUNED", 20)], jobs
    assert jobs[1]["detail"] == "pruned at step 20"
    # The higher value of the pruned job is no result of the search: the best is a finished job.
    assert [j["best"] for j in jobs] == [True, False]
    assert not sweeps.sweep_failed()


# --------------------------------------------------------------------------------------------
# Slow: real sweeps of the command a user types
# --------------------------------------------------------------------------------------------

SWEEP = [
    "-m",
    "hparams_search=digits_optuna_pruned",
    *FAST,
    "trainer.max_steps=60",
    "trainer.eval_interval=10",
    "trainer.ckpt_interval=10",
    "hydra.sweeper.n_trials=6",
    # Judged against the median of 3 finished trials from the 4th on: the third, stopped by
    # the kill below, cannot have been pruned before it.
    "hydra/sweeper/pruner=median",
    "hydra.sweeper.pruner.n_startup_trials=3",
]


def _trials(sweep: Path) -> list:
    url = f"sqlite:///{sweep / 'optuna.db'}"
    return optuna.load_study(study_name="digits_mlp_pruned", storage=url).trials


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_pruned_sweep_killed_after_two_trials_continues_to_n_trials(tmp_path: Path) -> None:
    """SIGKILL to the sweep's process (a lost node) once two trials are done, while the third
    trains; the same command again: the third resumes in its dir from its checkpoint, and the
    sweep goes on to 6 trials in all, the losers PRUNED at an evaluation."""
    cmd = [sys.executable, "-m", "hydra_ddp.train", *SWEEP]
    env = user_env(tmp_path)
    sweep = tmp_path / "multirun" / "digits_mlp_pruned"
    with (tmp_path / "first.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 400
            while not list(sweep.glob("2_*/checkpoints/step_*.pt")):
                assert proc.poll() is None, (tmp_path / "first.log").read_text()[-4000:]
                assert time.monotonic() < deadline, "the third trial never saved a checkpoint"
                time.sleep(0.1)
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
    states = [t.state.name for t in _trials(sweep)]
    assert states[2] == "RUNNING" and len(states) == 3, states
    second = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )  # fmt: skip
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-6000:]
    assert "continuing 1 trial(s) the stopped sweep left unfinished: job(s) #2" in out, out[-4000:]
    trials = _trials(sweep)
    assert len(trials) == 6, [t.state.name for t in trials]
    assert {t.state.name for t in trials} <= {"COMPLETE", "PRUNED"}
    third = next(sweep.glob("2_*"))
    assert "resumed from" in (third / "train.log").read_text()
    # The report: one row per trial, a pruned job with the step it reached.
    report = json.loads((sweep / "sweep_report.json").read_text())
    assert [j["num"] for j in report] == list(range(6)), report
    for job, trial in zip(report, trials):
        want = "ok" if trial.state.name == "COMPLETE" else "PRUNED"
        assert job["status"] == want, (job, trial)
        assert sorted(trial.intermediate_values)[-1] == (job["steps"] if want == "PRUNED" else 50)
        if want == "PRUNED":
            assert job["steps"] < 60 and job["detail"] == f"pruned at step {job['steps']}"
            assert summary(Path(job["dir"]))["pruned"] is True
            assert (Path(job["dir"]) / "checkpoints" / f"step_{job['steps']:08d}.pt").is_file()
    pruned = [j for j in report if j["status"] == "PRUNED"]
    assert pruned, "no trial pruned"  # the seeded search prunes some on this data
    # Fewer training steps than the same sweep unpruned, which runs every trial to the end.
    assert sum(j["steps"] for j in report) < 6 * 60
    assert f"{len(pruned)} pruned" in out
    results = OmegaConf.load(sweep / "optimization_results.yaml")
    assert results.trials.PRUNED == len(pruned) and results.trials.COMPLETE == 6 - len(pruned)
    # Run once more: the study is complete, nothing runs again.
    third_run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                               timeout=300)  # fmt: skip
    again = third_run.stdout + third_run.stderr
    assert third_run.returncode == 0 and "0 to go" in again, again[-3000:]
    assert len(_trials(sweep)) == 6 and len(job_dirs(sweep)) == 6


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_submitit_two_rank_jobs_are_pruned_on_both_ranks(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "hydra_ddp.train", *SWEEP[:-3], "hydra.sweeper.n_trials=2",
        "hydra/launcher=local", "hydra.launcher.tasks_per_node=2", "dist.device=cpu",
        *ALWAYS_AT_20_CLI,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=user_env(tmp_path), capture_output=True, text=True, timeout=540
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    sweep = tmp_path / "multirun" / "digits_mlp_pruned"
    assert [t.state.name for t in _trials(sweep)] == ["PRUNED", "PRUNED"]
    report = json.loads((sweep / "sweep_report.json").read_text())
    assert [(j["status"], j["steps"]) for j in report] == [("PRUNED", 20)] * 2, report
    for job in report:
        s = summary(Path(job["dir"]))
        assert s["world_size"] == 2 and s["steps"] == 20 and s["pruned"], s
