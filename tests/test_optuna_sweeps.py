"""Optuna sweeps: one sweeper of the template's (src/hydra_plugins/hydra_ddp_optuna), chosen as
`hydra/sweeper=optuna` or `optuna_pruned`, or with `hparams_search=digits_optuna` or
`digits_optuna_pruned`.

Default suite, in process: both presets compose with the same keys (and the pruner swaps);
Hydra's sweep syntax becomes Optuna distributions, and a job's overrides read back as the same
values; a bad search space, a sweep without evaluations and a storage that cannot be written are
each refused in one line; a job that is a trial reports its monitored metric at each evaluation
to a real SQLite study and, when the pruner says so, stops on both of its gloo ranks there with a
checkpoint; a trial reports to a JournalStorage as well; the sweep report lists a pruned job as
PRUNED with its step and not as a failure. Real: a non-numeric learning rate stops the command a
user types before any job; a 2-trial search leaves a study that Optuna reads back, holding no
fixed override (a secret among them). Slow: a pruned sweep killed after some trials and
continued by the same command to n_trials in all; the same under submitit's local launcher; a
study whose disk is full refused in one line and continued once there is space.
hydra/launcher=ray with two trials in flight is in test_ray_sweeps.py; without the `sweep`
extra, test_sweeps.py.
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
from conftest import FAST, job_dirs, ok, python_train, summary, user_env
from omegaconf import OmegaConf

from hydra_ddp.launch.command import find_own_plugins
from hydra_ddp.loop import evaluation as pruning
from hydra_ddp.rundir import sweeps

NEEDS = 'needs Optuna, the sweep extra: pip install -e ".[sweep]"'
optuna = pytest.importorskip("optuna", reason=NEEDS)
find_own_plugins()  # src/hydra_plugins of this checkout, as the entry point finds it

from hydra.core.override_parser.overrides_parser import OverridesParser  # noqa: E402
from optuna.distributions import (  # noqa: E402
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from hydra_ddp.errors import UserError  # noqa: E402
from hydra_plugins.hydra_ddp_optuna import _study  # noqa: E402
from hydra_plugins.hydra_ddp_optuna.sweeper import OptunaSweeper  # noqa: E402

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


def _sweeper(cfg) -> OptunaSweeper:
    """The sweeper Hydra builds from `cfg`, set up without a launcher (no job may start)."""
    sweeper = OptunaSweeper(**cfg.hydra.sweeper)
    sweeper.config, sweeper.launcher = cfg, None
    return sweeper


def _refused(capsys, cfg) -> str:
    """The one `error:` line that `cfg`'s sweep exits 2 with."""
    with pytest.raises(SystemExit) as info:
        _sweeper(cfg).sweep(list(cfg.hydra.overrides.task))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err.strip()


def test_both_presets_compose_with_the_same_keys_and_the_pruner_swaps() -> None:
    keys = {"_target_", "_recursive_", "direction", "storage", "study_name", "n_trials",
            "n_jobs", "sampler", "pruner", "params"}  # fmt: skip
    for preset, study in (
        ("digits_optuna", "digits_mlp"),
        ("digits_optuna_pruned", "digits_mlp_pruned"),
    ):
        cfg = _compose(f"hparams_search={preset}")
        sweeper = cfg.hydra.sweeper
        assert set(sweeper) == keys and sweeper._target_.endswith(".sweeper.OptunaSweeper")
        assert sweeper.direction == "maximize" and cfg.trainer.monitor == "val/acc"
        assert sweeper.storage is None  # SQLite in the sweep dir
        assert set(sweeper.params) == {"optim.lr", "model.hidden"}
        # No timestamp in the sweep dir: the same command continues the same study.
        assert cfg.hydra.sweep.dir == f"multirun/{study}" and sweeper.study_name == study
    assert _compose("hparams_search=digits_optuna").hydra.sweeper.pruner is None
    assert cfg.hydra.sweeper.n_trials == 16 and cfg.trainer.eval_interval > 0
    assert cfg.hydra.sweeper.pruner._target_ == "optuna.pruners.SuccessiveHalvingPruner"
    assert cfg.hydra.sweeper.pruner.reduction_factor == 2
    # The sweepers by name: the plain one has no pruner, the pruned one the median by default.
    assert _compose("hydra/sweeper=optuna").hydra.sweeper.pruner is None
    cfg = _compose("hydra/sweeper=optuna_pruned")
    assert OmegaConf.to_container(cfg.hydra.sweeper.pruner) == {
        "_target_": "optuna.pruners.MedianPruner", "n_startup_trials": 4, "n_warmup_steps": 0
    }  # fmt: skip
    cfg = _compose("hparams_search=digits_optuna_pruned", *ALWAYS_AT_20_CLI)
    assert OmegaConf.to_container(cfg.hydra.sweeper.pruner) == ALWAYS_AT_20


def test_hydra_sweep_syntax_becomes_optuna_distributions_and_jobs_read_it_back() -> None:
    cfg = _compose("hparams_search=digits_optuna")
    params = {**cfg.hydra.sweeper.params, "trainer.max_steps": "60"}
    space = _study.SearchSpace(params, [
        "model.hidden=choice(32,64)",  # the command line wins over the preset
        "trainer.batch_size=range(16,65,16)",
        "trainer.seed=0,1,2",
        "optim.weight_decay=interval(0.0,0.1)",
        "data.path=choice('a,b',c d)",
        "vars.db_password=choice(PW0,'PW 1')",
        "+extra.note='x,y'",
    ], cfg)  # fmt: skip
    assert space.distributions == {
        "optim.lr": FloatDistribution(0.0003, 0.01, log=True),
        "model.hidden": CategoricalDistribution([32, 64]),
        "trainer.batch_size": IntDistribution(16, 64, step=16),
        "trainer.seed": CategoricalDistribution([0, 1, 2]),
        "optim.weight_decay": FloatDistribution(0.0, 0.1),
        "data.path": CategoricalDistribution(["a,b", "c d"]),
        # A secret key's values never reach the study: it chooses among their indices.
        "vars.db_password": CategoricalDistribution([0, 1]),
    }
    assert space.fixed == {"trainer.max_steps": "trainer.max_steps=60",
                           "+extra.note": "+extra.note='x,y'"}  # fmt: skip
    chosen = {"optim.lr": 0.001, "model.hidden": 64, "trainer.batch_size": 32, "trainer.seed": 2,
              "optim.weight_decay": 0.05, "data.path": "a,b", "vars.db_password": 1}  # fmt: skip
    parsed = OverridesParser.create().parse_overrides(space.job(chosen))
    values = {o.get_key_element(): o.value() for o in parsed}
    assert not any(o.is_sweep_override() for o in parsed)
    assert values == {**chosen, "vars.db_password": "PW 1", "trainer.max_steps": 60,
                      "+extra.note": "x,y"}  # fmt: skip
    # A trial asked for before the space grew (a continued study): the new keys keep their value.
    assert space.job({"optim.lr": 0.001}) == ["optim.lr=0.001", *space.fixed.values()]


@pytest.mark.parametrize(
    "params, arguments, words",
    [
        ({"model.hidden": "choice()"}, [], ["hydra.sweeper.params.model.hidden=choice()", "empty"]),
        ({"optim.lr": "interval(a, b)"}, [], ["hydra.sweeper.params.optim.lr=interval(a, b)"]),
        ({"optim.lr": "interval(0.1, 0.01)"}, [], ["optim.lr=interval(0.1, 0.01)", "low"]),
        ({"trainer.seed": "range(5, 1)"}, [], ["trainer.seed=range(5, 1)"]),
        (
            {"optim.lr": "abc"},
            [],
            [
                "hydra.sweeper.params.optim.lr=abc: 'abc' is not a number",
                "(optim.lr=0.002 in the config)",
            ],
        ),
        (
            {"optim.lr": "interval(0.001, 0.01)"},
            ["optim.lr=abc"],
            ["optim.lr=abc: 'abc' is not a number", "hydra.sweeper.params.optim.lr=interval"],
        ),
        ({}, ["optim.lr=choice(abc,0.01)"], ["optim.lr=choice(abc,0.01): 'abc' is not a number"]),
    ],
)
def test_a_bad_search_space_is_refused_in_one_line(params, arguments, words) -> None:
    cfg = _compose("hydra/sweeper=optuna")
    with pytest.raises(UserError) as info:
        _study.SearchSpace(params, arguments, cfg)
    line = str(info.value)
    assert "\n" not in line
    assert all(w in line for w in words), line
    assert "choice(" in line or "give one" in line, line  # what to write instead


def test_a_pruner_without_evaluations_and_an_unwritable_storage_are_refused(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = _compose("hparams_search=digits_optuna_pruned", "trainer.eval_interval=0")
    line = _refused(capsys, cfg)
    assert "trainer.eval_interval=0" in line, line
    # A file where the study's folder should be: the storage cannot be written.
    (tmp_path / "file").write_text("")
    for url, shown in (
        (f"sqlite:///{tmp_path}/file/optuna.db", f"sqlite:///{tmp_path}/file/optuna.db"),
        ("sqlite://me:PW0RD@localhost/x.db", "sqlite://me:***@localhost/x.db"),  # no such URL
    ):
        line = _refused(capsys, _compose("hydra/sweeper=optuna", f"hydra.sweeper.storage='{url}'"))
        assert f"storage {shown} failed" in line and "hydra.sweeper.storage" in line, line
        assert "PW0RD" not in line
    assert not list(tmp_path.rglob("*_optim.lr=*")), "no job ran"


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


def test_a_trial_reports_to_a_journal_storage(tmp_path: Path, monkeypatch) -> None:
    """hydra.sweeper.storage as an Optuna storage's config (a JournalStorage, for a shared file
    system): the sweeper opens it, and a job's rank 0 reports to it from the variables the
    sweeper sets."""
    from hydra_ddp.distributed import DistEnv

    log = tmp_path / "journal.log"
    storage = {
        "_target_": "optuna.storages.JournalStorage",
        "log_storage": {"_target_": "optuna.storages.journal.JournalFileBackend",
                        "file_path": str(log)},
    }  # fmt: skip
    cfg = _compose("hparams_search=digits_optuna_pruned", *ALWAYS_AT_20_CLI)
    sweeper = _sweeper(cfg)
    space = _study.SearchSpace(sweeper.params["params"], [], cfg)
    run = _study._Run(sweeper, tmp_path, space, storage)
    run.tell_jobs_the_study()
    number = run.study.ask(space.distributions).number
    # What the sweep's overrides put in each job's environment.
    for override in OverridesParser.create().parse_overrides(list(cfg.hydra.overrides.hydra)):
        if override.key_or_group.startswith("hydra.job.env_set."):
            monkeypatch.setenv(override.key_or_group.rpartition(".")[2], override.value())
    monkeypatch.setenv(pruning.TRIAL_ENV, str(number))
    job = pruning.Pruning(DistEnv())
    assert [job.should_prune(10, 0.5), job.should_prune(20, 0.6)] == [False, True]
    backend = optuna.storages.journal.JournalFileBackend(str(log))
    study = optuna.load_study(study_name="digits_mlp_pruned",
                              storage=optuna.storages.JournalStorage(backend))  # fmt: skip
    trial = study.trials[number]
    assert trial.intermediate_values == {10: 0.5, 20: 0.6}
    assert trial.user_attrs[pruning.PRUNED_ATTR] == 20


def test_a_non_numeric_learning_rate_stops_the_sweep_before_any_job(tmp_path: Path) -> None:
    proc = python_train(tmp_path, "-m", "hparams_search=digits_optuna", "optim.lr=abc", timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: optim.lr=abc: 'abc' is not a number"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not job_dirs(tmp_path / "multirun")


@pytest.mark.timeout(300)
def test_a_search_leaves_a_study_optuna_reads_back_with_no_fixed_override(tmp_path: Path) -> None:
    """Two trials of `hparams_search=digits_optuna` with a fixed secret override: the study is
    <sweep dir>/optuna.db, read back with optuna.load_study; it holds each trial's swept values,
    sweep dir and job number, and no fixed override (the secret used to be in every trial's
    user attributes); the same command again continues it (here: nothing left to run)."""
    secret = "S3" + "CRETfixed"  # made at run time: no file holds it
    args = ["-m", "hparams_search=digits_optuna", "hydra.sweeper.n_trials=2", *FAST,
            "trainer.max_steps=2", f"vars.db_password={secret}"]  # fmt: skip
    proc = ok(python_train(tmp_path, *args, timeout=240))
    sweep = tmp_path / "multirun" / "digits_mlp"
    study = optuna.load_study(study_name="digits_mlp", storage=f"sqlite:///{sweep}/optuna.db")
    report = json.loads((sweep / "sweep_report.json").read_text())
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 2
    assert [j["status"] for j in report] == ["ok"] * 2, report
    for trial, job in zip(study.trials, report):
        assert trial.user_attrs == {"sweep_dir": str(sweep), "job_num": job["num"]}
        config = OmegaConf.load(Path(job["dir"]) / ".hydra/config.yaml")
        assert trial.params == {k: OmegaConf.select(config, k) for k in job["overrides"]}
        assert job["overrides"] == {k: str(v) for k, v in trial.params.items()}
        assert trial.value == job["objective"]
        assert config.vars.db_password == secret
    assert study.best_value == max(j["objective"] for j in report)
    assert secret.encode() not in (sweep / "optuna.db").read_bytes()
    assert secret not in proc.stdout + proc.stderr
    again = ok(python_train(tmp_path, *args, timeout=120))
    assert "2 trial(s) so far, 0 to go" in again.stdout and len(job_dirs(sweep)) == 2


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


@pytest.fixture
def small_disk(tmp_path: Path):
    """A tmpfs of 2 MiB under tmp_path (needs root, as in CI's container)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
                          capture_output=True, text=True)  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()})")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_study_on_a_full_disk_is_refused_in_one_line_and_continues_on_free_space(
    tmp_path: Path, small_disk: Path
) -> None:
    """One trial into a study on a small disk; the disk filled; a second trial asked for: one
    line naming the storage, no job started, the study intact; space freed: the same command
    continues the study to 2 trials, the first one unchanged."""
    db = small_disk / "optuna.db"
    args = ["-m", "hparams_search=digits_optuna", *FAST, "trainer.max_steps=2",
            f"hydra.sweeper.storage=sqlite:///{db}"]  # fmt: skip
    ok(python_train(tmp_path, *args, "hydra.sweeper.n_trials=1", timeout=240))
    with open(small_disk / "filler", "wb") as filler:
        with pytest.raises(OSError):  # ENOSPC: the disk is full
            while True:
                filler.write(b"\0" * 65536)
                filler.flush()
    full = python_train(tmp_path, *args, "hydra.sweeper.n_trials=2", timeout=120)
    assert full.returncode == 2, full.stderr[-3000:]
    line = full.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: the Optuna study's storage sqlite:///{db} failed"), line
    assert "disk is full" in line and "run the same command again" in line, line
    sweep = tmp_path / "multirun" / "digits_mlp"
    assert len(job_dirs(sweep)) == 1
    first = optuna.load_study(study_name="digits_mlp", storage=f"sqlite:///{db}").trials
    assert [t.state.name for t in first] == ["COMPLETE"]
    (small_disk / "filler").unlink()
    ok(python_train(tmp_path, *args, "hydra.sweeper.n_trials=2", timeout=240))
    trials = optuna.load_study(study_name="digits_mlp", storage=f"sqlite:///{db}").trials
    assert [t.state.name for t in trials] == ["COMPLETE"] * 2 and len(job_dirs(sweep)) == 2
    assert (trials[0].params, trials[0].value) == (first[0].params, first[0].value)
