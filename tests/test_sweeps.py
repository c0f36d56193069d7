"""Sweeps: job dir names, the end-of-sweep report, the objective (trainer.monitor), plotting a
sweep, and an Optuna search.

The sweep of the default suite is a real `python -m hydra_ddp.train -m ...` of 2-rank jobs
(tests/test_launch.py: job names, the report and its table, the objective from
trainer.monitor, one W&B run per job, plotting the sweep). Here: the job dir names, the report
(its counts, only this sweep's jobs, seed groups and their statistics) and the sweep's picture
in process; a real sweep refusing a FIFO in its dir; and, slow, a sweep over seeds drawn by
scripts/plot_run.py, a sweep over values with slashes and 1000 characters and an Optuna search
of 2-rank jobs.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import stat
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FAST, REPO, TESTS, job_dirs, ok, python_train, summary, user_env
from helpers import wandb_records
from omegaconf import OmegaConf

from hydra_ddp import redact
from hydra_ddp.rundir import paths, seed_groups, sweeps

DATA = ["--rows", "256", "--shards", "2", "--features", "16", "--eval-rows", "32"]
TINY = [*FAST, "trainer.max_steps=3"]


def sweep_dir(root: Path) -> Path:
    dirs = [p.parent for p in (root / "multirun").rglob("multirun.yaml")]
    assert len(dirs) == 1, dirs
    return dirs[0]


def report(sweep: Path) -> list[dict]:
    return json.loads((sweep / "sweep_report.json").read_text())


def output(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


# --------------------------------------------------------------------------------------------
# Job dir names (the hydra.sweep.subdir resolver), without a sweep
# --------------------------------------------------------------------------------------------


def test_subdir_keeps_swept_keys_only(tmp_path: Path) -> None:
    keys = paths.swept_keys(["model=mlp,cnn", "trainer.max_steps=60", "+x@pkg=1,2"])
    assert keys == ["model", "x@pkg"]
    (tmp_path / "sweep_keys.json").write_text(json.dumps(keys))
    job = ["model=mlp", "trainer.max_steps=60", "trainer.progress=false", "+x@pkg=2"]
    assert paths.sweep_subdir(0, job, str(tmp_path)) == "0_model=mlp,x@pkg=2"
    # A `-m` that sweeps nothing: the number alone.
    (tmp_path / "sweep_keys.json").write_text("[]")
    assert paths.sweep_subdir(3, job, str(tmp_path)) == "3"


def test_subdir_falls_back_to_multirun_yaml_then_sweeper_params_then_all(tmp_path: Path) -> None:
    job = ["optim.lr=0.01", "model.hidden=64", "trainer.max_steps=20"]
    # Neither file: the sweeper's own params (Optuna's search space) tell the keys...
    params = {"optim.lr": "tag(log, interval(1e-4, 1e-2))", "trainer.max_steps": "20"}
    assert paths.sweep_subdir(1, job, str(tmp_path), params) == "1_optim.lr=0.01"
    # ...and without them, every override of the job counts.
    assert paths.sweep_subdir(1, job, str(tmp_path)) == (
        "1_optim.lr=0.01,model.hidden=64,trainer.max_steps=20"
    )
    # Hydra's basic sweeper saves the sweep's command line in multirun.yaml.
    OmegaConf.save(
        {"hydra": {"overrides": {"task": ["model.hidden=64,128", "trainer.max_steps=20"]}}},
        tmp_path / "multirun.yaml",
    )
    assert paths.sweep_subdir(1, job, str(tmp_path)) == "1_model.hidden=64"


def test_subdir_is_one_safe_capped_name(tmp_path: Path) -> None:
    (tmp_path / "sweep_keys.json").write_text(json.dumps(["data.path"]))
    name = paths.sweep_subdir(0, ["data.path=/nonexistent/x:y z"], str(tmp_path))
    assert name == "0_data.path=_nonexistent_x_y_z"
    long_a = paths.sweep_subdir(1, ["data.path=/d/" + "a" * 1000], str(tmp_path))
    long_b = paths.sweep_subdir(1, ["data.path=/d/" + "a" * 999 + "b"], str(tmp_path))
    for name in (long_a, long_b):
        assert len(name) == paths.SUBDIR_MAX_CHARS and "/" not in name, name
        assert name.startswith("1_data.path=_d_aaa")
    assert long_a != long_b  # the hash of the full name tells them apart


def test_subdir_leaves_secret_values_out(tmp_path: Path) -> None:
    (tmp_path / "sweep_keys.json").write_text(json.dumps(["+db.password", "model.api_token"]))
    (tmp_path / "sweep_keys.json").write_text(json.dumps(["db.password", "optim.lr"]))
    job = ["+db.password=pw1", "optim.lr=0.1", "+model.api_token=abc"]
    assert paths.sweep_subdir(4, job, str(tmp_path)) == "4_db.password=_redacted_,optim.lr=0.1"
    long = paths.sweep_subdir(5, ["+db.password=" + "h" * 200, "optim.lr=1"], str(tmp_path))
    again = paths.sweep_subdir(5, ["+db.password=" + "x" * 200, "optim.lr=1"], str(tmp_path))
    assert long == again == "5_db.password=_redacted_,optim.lr=1"  # not even its length shows
    # Log lines (redact.LogFilter on every handler), as Hydra's launcher writes a job's overrides.
    line = "\t#0 : +db.password=pw1 optim.lr=0.1 data.pad_token=x ++model.api_token=t,u"
    assert redact.pairs(line) == (
        "\t#0 : +db.password=<redacted> optim.lr=0.1 data.pad_token=x ++model.api_token=<redacted>"
    )


# --------------------------------------------------------------------------------------------
# The report, from what job dirs and the journal hold
# --------------------------------------------------------------------------------------------


def _sweep_config(sweep: Path, task: list[str], monitor: str = "val/loss", mode: str = "min"):
    return OmegaConf.create(
        {
            "hydra": {"sweep": {"dir": str(sweep)}, "overrides": {"task": task}},
            "trainer": {"monitor": monitor, "monitor_mode": mode},
        }
    )


def configured_report() -> sweeps.SweepReport:
    """The report's callback as Hydra builds it from conf/train.yaml (seed_keys: trainer.seed)."""
    from hydra.utils import instantiate

    return instantiate(OmegaConf.load(REPO / "conf" / "train.yaml").hydra.callbacks.sweep_report)


def _job(sweep: Path, name: str, overrides: list[str], summary: dict | None = None) -> Path:
    job = sweep / name
    (job / ".hydra").mkdir(parents=True)
    OmegaConf.save(overrides, job / ".hydra" / "overrides.yaml")
    if summary is not None:
        (job / "summary.json").write_text(json.dumps(summary))
    return job


def test_report_counts_jobs_without_dir_or_summary_as_failed(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    task = ["model=mlp,cnn,gpt,mlp2", "trainer.max_steps=3"]
    _job(sweep, "0_model=mlp", ["model=mlp", "trainer.max_steps=3"], {"objective": 0.5})
    _job(sweep, "1_model=cnn", ["model=cnn", "trainer.max_steps=3"])  # died: no summary
    # Job 2 is only in the journal (its dir is gone); job 3 left no trace at all, but its number
    # is missing between known ones; job 4 has a dir and no journal line.
    gone = sweep / "2_model=gpt"
    (sweep / "sweep_jobs.jsonl").write_text(
        json.dumps({"num": 2, "dir": str(gone), "event": "start", "overrides": ["model=gpt"]})
        + "\n{torn line\n"
    )
    _job(sweep, "4_model=mlp2", ["model=mlp2"], {"objective": 0.25, "val_loss": 0.25})
    sweeps.SweepReport().on_multirun_end(_sweep_config(sweep, task))
    jobs = {j["num"]: j for j in report(sweep)}
    assert sorted(jobs) == [0, 1, 2, 3, 4]
    assert [jobs[n]["status"] for n in range(5)] == ["ok", "FAILED", "FAILED", "FAILED", "ok"]
    assert "no summary.json" in jobs[1]["detail"]
    assert "missing" in jobs[2]["detail"] and jobs[2]["overrides"] == {"model": "gpt"}
    assert jobs[3]["dir"] is None and jobs[3]["job"] == "#3"
    assert jobs[0]["overrides"] == {"model": "mlp"}  # the swept key only
    assert [n for n, j in jobs.items() if j["best"]] == [4]  # min of 0.5 and 0.25
    assert sweeps.sweep_failed()


def test_report_lists_stopped_and_never_started_jobs_as_preempted(tmp_path: Path, caplog) -> None:
    """A stopped Ray sweep: a job that saved a checkpoint and stopped, one that never started
    (only the launcher's journal line names it), and one that finished first. Previously its
    log line said "3 job(s), 2 failed"."""
    sweep = tmp_path / "sweep"
    task = ["optim.lr=0.1,0.2,0.3"]
    _job(sweep, "0_optim.lr=0.1", ["optim.lr=0.1"], {"objective": 0.5})
    stopped = _job(sweep, "1_optim.lr=0.2", ["optim.lr=0.2"])
    sweeps.record_failure(
        stopped, "stopped on SIGTERM at step 7 of 40 with a checkpoint", "PREEMPTED"
    )
    config = _sweep_config(sweep, task)
    config.hydra.job = {"num": 2}
    sweeps.record_not_started(config, sweep / "2_optim.lr=0.3", ["optim.lr=0.3"])
    caplog.set_level("INFO")
    sweeps.SweepReport().on_multirun_end(_sweep_config(sweep, task))
    head = next(r.getMessage() for r in caplog.records if "sweep done" in r.getMessage())
    assert head.startswith("sweep done: 3 job(s), 0 failed, 1 stopped, 1 not started;"), head
    jobs = {j["num"]: j for j in report(sweep)}
    assert [jobs[n]["status"] for n in range(3)] == ["ok", "PREEMPTED", "PREEMPTED"], jobs
    assert "at step 7 of 40" in jobs[1]["detail"]
    assert jobs[2]["detail"].startswith("not started") and jobs[2]["overrides"] == {
        "optim.lr": "0.3"
    }
    assert sweeps.sweep_failed()  # a stopped sweep did not finish: exit status not 0


def test_a_job_stopped_on_a_signal_is_journaled_as_preempted(tmp_path: Path) -> None:
    """Under Ray (and submitit) a job stopped on a signal records it and returns NaN, which
    Hydra calls COMPLETED: the journal said so too, now it says PREEMPTED."""
    from hydra.core.utils import JobReturn, JobStatus
    from hydra.types import RunMode

    sweep = tmp_path / "sweep"
    job = sweep / "0_optim.lr=0.1"
    config = _sweep_config(sweep, ["optim.lr=0.1,0.2"])
    config.hydra.update(mode=RunMode.MULTIRUN, job={"num": 0}, runtime={"output_dir": str(job)})
    sweeps.record_failure(job, "stopped on SIGINT at step 7 of 40 with a checkpoint", "PREEMPTED")
    returned = JobReturn(hydra_cfg=config, status=JobStatus.COMPLETED, _return_value=math.nan)
    sweeps.SweepReport().on_job_end(config, returned)
    [line] = [json.loads(x) for x in (sweep / "sweep_jobs.jsonl").read_text().splitlines()]
    assert (line["event"], line["status"], line["return_value"]) == ("end", "PREEMPTED", None)
    assert json.loads((job / "job_return.json").read_text())["status"] == "PREEMPTED"


def test_the_report_lists_only_this_sweeps_jobs(tmp_path: Path) -> None:
    """A sweep dir that already held a run (hydra.run.dir=<sweep dir>/old) and an earlier
    sweep's preempted job (nested one level deeper): previously listed among this sweep's jobs,
    and the sweep exited 1 for them."""
    sweep = tmp_path / "sweep"
    task = ["optim.lr=0.1,0.2"]
    for old in (_job(sweep, "old", ["optim.lr=0.5"]), _job(sweep / "earlier", "0_x", ["x=1"])):
        sweeps.record_failure(
            old, "stopped on SIGTERM at step 3 of 9 with a checkpoint", "PREEMPTED"
        )
        an_hour_ago = time.time() - 3600
        os.utime(old / ".hydra", (an_hour_ago, an_hour_ago))
    sweeps.SweepReport().on_multirun_start(_sweep_config(sweep, task))
    _job(sweep, "0_optim.lr=0.1", ["optim.lr=0.1"], {"objective": 0.5})
    # This one reached no journal line: found by its dir, written since the sweep started.
    _job(sweep, "1_optim.lr=0.2", ["optim.lr=0.2"], {"objective": 0.4})
    sweeps.SweepReport().on_multirun_end(_sweep_config(sweep, task))
    assert [j["job"] for j in report(sweep)] == ["0_optim.lr=0.1", "1_optim.lr=0.2"]
    assert [j["status"] for j in report(sweep)] == ["ok", "ok"]
    assert not sweeps.sweep_failed()
    assert not (sweep / ".claim").exists()  # given back at the end


def test_eval_says_what_a_fifo_at_the_runs_config_is(tmp_path: Path) -> None:
    """`python -m hydra_ddp.eval run=<dir>` with a FIFO at <dir>/.hydra/config.yaml: said to
    be a FIFO (previously "no .hydra/config.yaml there"), and never opened (that would block)."""
    from hydra_ddp import eval as evaluation
    from hydra_ddp.errors import UserError

    (tmp_path / ".hydra").mkdir()
    os.mkfifo(tmp_path / ".hydra" / "config.yaml")
    with pytest.raises(UserError) as info:
        evaluation.job_config(tmp_path, [])
    message = str(info.value)
    assert "config.yaml is a FIFO (named pipe), not a regular file" in message, message
    assert message.startswith(f"run={tmp_path}: ") and "\n" not in message


def _seed_sweep(sweep: Path, objectives: dict[str, list[float]]) -> list[str]:
    """Job dirs of `trainer.seed=0,1,2 optim.lr=...`: lr -> the objective of each seed; the
    sweep's command line returned."""
    num = 0
    for seed in range(3):
        for lr, values in objectives.items():
            value = values[seed]
            overrides = [f"trainer.seed={seed}", f"optim.lr={lr}", "trainer.max_steps=3"]
            summary = {"objective": value, "val_loss": value, "val_acc": 1 - value}
            _job(sweep, f"{num}_trainer.seed={seed},optim.lr={lr}", overrides, summary)
            num += 1
    return ["trainer.seed=0,1,2", f"optim.lr={','.join(objectives)}", "trainer.max_steps=3"]


def test_a_sweep_over_seeds_is_reported_by_seed_group(tmp_path: Path, caplog) -> None:
    """`trainer.seed=0,1,2 optim.lr=0.1,0.2`: two groups of n = 3, each with its mean, std, min,
    max and 95 % Student's t interval (objective and metrics), ranked by mean; the best two
    compared (a paired t-test: the same seeds; else Welch's), and the seeds a two-sample t-test
    would need at the spread seen."""
    sweep = tmp_path / "sweep"
    good, bad = [0.50, 0.52, 0.55], [0.60, 0.63, 0.61]
    task = _seed_sweep(sweep, {"0.1": good, "0.2": bad})
    caplog.set_level("INFO")
    configured_report().on_multirun_end(_sweep_config(sweep, task))
    assert not sweeps.sweep_failed()
    result = json.loads((sweep / "sweep_report.json").read_text())
    assert (result["monitor"], result["mode"], result["seed_keys"]) == (
        "val/loss",
        "min",
        ["trainer.seed"],
    )
    first, second = result["groups"]
    assert (first["group"], second["group"]) == ("optim.lr=0.1", "optim.lr=0.2")
    assert [first["rank"], first["best"], second["rank"], second["best"]] == [1, True, 2, False]
    t_975_2 = 4.302652729911275  # Student's t, 97.5 % quantile, 2 degrees of freedom (tables)
    for group, values in ((first, good), (second, bad)):
        mean, std = sum(values) / 3, statistics.stdev(values)
        assert group["n"] == 3 and group["seeds"] == ["0", "1", "2"] and group["unscored"] == 0
        assert math.isclose(group["mean"], mean) and math.isclose(group["std"], std)
        assert (group["min"], group["max"]) == (min(values), max(values))
        half = t_975_2 * std / math.sqrt(3)
        assert all(map(math.isclose, group["interval"], [mean - half, mean + half]))
        acc = group["metrics"]["val_acc"]
        assert acc["n"] == 3 and math.isclose(acc["mean"], 1 - mean)
        assert math.isclose(acc["std"], std) and math.isclose(acc["interval"][1], 1 - mean + half)
    assert first["jobs"] == ["0_trainer.seed=0,optim.lr=0.1", "2_trainer.seed=1,optim.lr=0.1",
                             "4_trainer.seed=2,optim.lr=0.1"]  # fmt: skip
    assert [j["best"] for j in result["jobs"]] == [True, False] * 3  # the best group's jobs
    # The paired t-test by hand: the differences' mean over their standard error, n - 1 dof.
    from scipy.stats import t as student

    diffs = [a - b for a, b in zip(good, bad)]
    paired_t = statistics.mean(diffs) / (statistics.stdev(diffs) / math.sqrt(3))
    compared = result["comparison"]
    assert compared["test"] == "paired t-test" and compared["distinguishable"] is True
    assert math.isclose(compared["paired_p"], 2 * student.sf(abs(paired_t), 2), rel_tol=1e-9)
    # Intervals that overlap a little do not mean the two are alike: the tests tell them apart.
    assert compared["intervals_overlap"] is True and 0 < compared["welch_p"] < 0.05
    pooled = math.sqrt((statistics.variance(good) + statistics.variance(bad)) / 2)
    assert compared["seeds_needed"] == seed_groups.seeds_needed(abs(0.66 / 3 - 0.31 / 3), pooled)
    messages = [r.getMessage() for r in caplog.records]
    head = next(m for m in messages if m.startswith("sweep done:"))
    assert head.startswith("sweep done: 6 job(s), 0 failed; objective val/loss (min): "), head
    assert f"best group optim.lr=0.1: mean {sum(good) / 3:.6g} of 3 seed(s)" in head, head
    at = messages.index("seed groups (trainer.seed), ranked by their mean val/loss (min):")
    header, row1, row2, line = messages[at + 1 : at + 5]
    assert "95% interval" in header and "val_acc mean" in header
    assert row1.startswith("  * 1") and row1.endswith("optim.lr=0.1") and row2.split()[0] == "2"
    assert line.startswith("best vs next: optim.lr=0.1 vs optim.lr=0.2: distinguishable at the")
    assert f"{compared['seeds_needed']} seed(s) per group would tell them apart" in line
    assert (
        messages[-1].startswith("plots: `python scripts/plot_run.py ") and "plots" in messages[-1]
    )
    assert messages[-1].endswith(str(sweep / "plots"))

    # A failed job: its group counts the two seeds left, compared by Welch's t-test; with
    # trainer.monitor_mode=max the order turns round.
    (sweep / "5_trainer.seed=2,optim.lr=0.2" / "summary.json").unlink()
    configured_report().on_multirun_end(_sweep_config(sweep, task, "val/acc", "max"))
    result = json.loads((sweep / "sweep_report.json").read_text())
    first, second = result["groups"]
    assert (first["group"], first["n"], first["unscored"]) == ("optim.lr=0.2", 2, 1)
    assert first["seeds"] == ["0", "1"] and math.isclose(first["mean"], 0.615)
    assert (
        result["comparison"]["test"] == "Welch's t-test"
        and result["comparison"]["paired_p"] is None
    )
    assert sweeps.sweep_failed()


@pytest.mark.parametrize("seeded", [True, False])
def test_plot_run_draws_a_sweep_by_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seeded: bool
) -> None:
    """scripts/plot_run.py on a sweep dir (its main, in process), from the report and each
    job's stats/eval.jsonl: the monitored metric per configuration against the step and the
    objective against the swept key, with seeds (groups of 3) and without (a job each)."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import plot_run
    from matplotlib.image import imread

    sweep = tmp_path / "sweep"
    task = _seed_sweep(sweep, {"0.1": [0.50, 0.52, 0.55], "0.2": [0.60, 0.63, 0.61]})
    for job in sweep.iterdir():
        final = json.loads((job / "summary.json").read_text())["val_loss"]
        (job / "stats").mkdir()
        (job / "stats" / "rank0.jsonl").write_text('{"step": 2, "loss": 1.0}\n')
        lines = [{"step": s, "val/loss": final + (4 - s) / 10} for s in (2, 4)]
        (job / "stats" / "eval.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    report_with = sweeps.SweepReport(seed_keys=["trainer.seed"] if seeded else ["data.seed"])
    report_with.on_multirun_end(_sweep_config(sweep, task))
    assert plot_run.main([str(sweep), "--stats", "loss"]) == 0
    keys = ["optim.lr"] if seeded else ["trainer.seed", "optim.lr"]
    names = ["loss.png", "val_loss_by_group.png", *(f"objective_by_{k}.png" for k in keys)]
    assert sorted(p.name for p in (sweep / "plots").iterdir()) == sorted(names)
    for name in names:
        pixels = imread(sweep / "plots" / name)[..., :3]
        assert pixels.std() > 0.05, name  # lines and text, not a blank canvas


def test_plot_run_draws_only_the_reports_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job dir an earlier sweep left in the same dir has stats too, but is not this sweep's:
    the per-job lines are the report's jobs only."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import plot_run

    sweep = tmp_path / "sweep"
    task = ["optim.lr=0.1,0.2"]
    old = _job(sweep / "earlier", "0_x=1", ["x=1"], {"objective": 0.9})
    an_hour_ago = time.time() - 3600
    os.utime(old / ".hydra", (an_hour_ago, an_hour_ago))
    sweeps.SweepReport().on_multirun_start(_sweep_config(sweep, task))
    for num, lr in enumerate(("0.1", "0.2")):
        _job(sweep, f"{num}_optim.lr={lr}", [f"optim.lr={lr}"], {"objective": 0.5})
    for job in (old, sweep / "0_optim.lr=0.1", sweep / "1_optim.lr=0.2"):
        (job / "stats").mkdir()
        (job / "stats" / "rank0.jsonl").write_text('{"step": 2, "loss": 1.0}\n')
    sweeps.SweepReport().on_multirun_end(_sweep_config(sweep, task))
    drawn: list[list[str]] = []
    real = plot_run.plot_sweep_stat
    monkeypatch.setattr(
        plot_run, "plot_sweep_stat", lambda jobs, *a: drawn.append(list(jobs)) or real(jobs, *a)
    )
    assert plot_run.main([str(sweep), "--stats", "loss"]) == 0
    assert drawn == [["0_optim.lr=0.1", "1_optim.lr=0.2"]]
    assert (sweep / "plots" / "loss.png").is_file()


def test_seeds_needed_is_the_two_sample_t_test_power_calculation() -> None:
    """The textbook figures (Cohen's tables, G*Power): at a difference of d standard deviations,
    two-sided 5 %, 80 % power: 64 per group for d = 0.5, 26 for 0.8, 17 for 1."""
    assert [seed_groups.seeds_needed(d, 1.0) for d in (0.5, 0.8, 1.0)] == [64, 26, 17]
    assert seed_groups.seeds_needed(2.0, 4.0) == 64  # only the ratio counts
    assert seed_groups.seeds_needed(0.0, 1.0) is None  # equal means: no number of seeds
    assert seed_groups.seeds_needed(0.001, 1.0) is None  # over MAX_SEEDS
    assert seed_groups.seeds_needed(0.1, 0.0) == 2  # no spread at all


def test_seed_keys_name_the_seeds_and_a_seedless_sweep_keeps_its_list(tmp_path: Path) -> None:
    """hydra.callbacks.sweep_report.seed_keys=[data.seed]: the jobs that differ only in
    data.seed form a group; without it (the default, trainer.seed) the same sweep is
    reported job by job, as a list."""
    sweep = tmp_path / "sweep"
    task = ["data.seed=1,2", "model.hidden=8,16"]
    for num, (seed, hidden) in enumerate([(1, 8), (1, 16), (2, 8), (2, 16)]):
        value = hidden / 100 + seed / 1000
        _job(sweep, f"{num}_data.seed={seed},model.hidden={hidden}",
             [f"data.seed={seed}", f"model.hidden={hidden}"], {"objective": value})  # fmt: skip
    configured_report().on_multirun_end(_sweep_config(sweep, task))
    jobs = report(sweep)
    assert isinstance(jobs, list) and [j["best"] for j in jobs] == [True, False, False, False]
    sweeps.SweepReport(seed_keys=["data.seed"]).on_multirun_end(_sweep_config(sweep, task))
    result = json.loads((sweep / "sweep_report.json").read_text())
    assert [(g["group"], g["n"], g["seeds"]) for g in result["groups"]] == [
        ("model.hidden=8", 2, ["1", "2"]), ("model.hidden=16", 2, ["1", "2"])
    ]  # fmt: skip
    assert result["seed_keys"] == ["data.seed"]


def test_a_failed_job_is_neither_starred_nor_shown_with_an_earlier_runs_figures(
    tmp_path: Path, caplog
) -> None:
    """Job 4 (seed 2 of the best group) failed in a dir where an earlier run had finished: its
    row takes nothing from that run's summary.json, it has no star, and its group's figures
    come from the two seeds left. The two groups then differ in n: the seeds-needed figure
    pools their spreads by degrees of freedom."""
    sweep = tmp_path / "sweep"
    good, bad = [0.50, 0.52, 0.55], [0.60, 0.63, 0.61, 0.66]
    task = _seed_sweep(sweep, {"0.1": good, "0.2": bad})
    sweeps.record_failure(sweep / "4_trainer.seed=2,optim.lr=0.1", "RuntimeError: boom")
    caplog.set_level("INFO")
    configured_report().on_multirun_end(_sweep_config(sweep, task))
    result = json.loads((sweep / "sweep_report.json").read_text())
    failed = next(j for j in result["jobs"] if j["num"] == 4)
    assert (failed["status"], failed["best"], failed["steps"], failed["metrics"]) == (
        "FAILED", False, None, {}
    )  # fmt: skip
    assert [j["num"] for j in result["jobs"] if j["best"]] == [0, 2]
    first, second = result["groups"]
    assert (first["group"], first["n"], first["unscored"], second["n"]) == (
        "optim.lr=0.1", 2, 1, 3
    )  # fmt: skip
    pooled = math.sqrt((1 * statistics.variance(good[:2]) + 2 * statistics.variance(bad[:3])) / 3)
    difference = abs(statistics.mean(good[:2]) - statistics.mean(bad[:3]))
    assert result["comparison"]["seeds_needed"] == seed_groups.seeds_needed(difference, pooled)
    row = next(r.getMessage() for r in caplog.records if "4_trainer.seed=2" in r.getMessage())
    assert not row.lstrip().startswith("*") and "FAILED" in row and "boom" in row


def test_two_groups_alike_at_every_seed_say_so_in_the_line_and_the_json(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    task = _seed_sweep(sweep, {"0.1": [0.5, 0.6, 0.7], "0.2": [0.5, 0.6, 0.7]})
    configured_report().on_multirun_end(_sweep_config(sweep, task))
    compared = json.loads((sweep / "sweep_report.json").read_text())["comparison"]
    assert compared["test"] == "paired t-test" and compared["paired_p"] is None
    assert compared["distinguishable"] is False
    line = seed_groups.comparison_line({**compared, "paired_p": math.nan})
    assert "paired t-test over the same seeds p undefined (no difference)" in line, line
    assert "nan" not in line


def test_jobs_that_monitor_different_metrics_are_listed_not_ranked(tmp_path: Path, caplog) -> None:
    """`trainer.monitor=val/loss,val/acc`: a loss and an accuracy are no one objective."""
    sweep = tmp_path / "sweep"
    task = ["trainer.seed=0,1", "trainer.monitor=val/loss,val/acc"]
    for num, (seed, monitor) in enumerate([(0, "val/loss"), (0, "val/acc"), (1, "val/loss"),
                                           (1, "val/acc")]):  # fmt: skip
        value = 0.3 if monitor == "val/loss" else 0.9
        _job(sweep, f"{num}_{seed}_{monitor[4:]}", [f"trainer.seed={seed}",
             f"trainer.monitor={monitor}"], {"objective": value, "monitor": monitor})  # fmt: skip
    caplog.set_level("INFO")
    configured_report().on_multirun_end(_sweep_config(sweep, task))
    jobs = report(sweep)
    assert isinstance(jobs, list) and not any(j["best"] for j in jobs)
    assert [j["monitor"] for j in jobs] == ["val/loss", "val/acc"] * 2
    messages = [r.getMessage() for r in caplog.records]
    head = next(m for m in messages if m.startswith("sweep done:"))
    assert "not ranked: the jobs monitor different metrics (val/acc, val/loss)" in head, head
    assert not any(m.startswith("seed groups") for m in messages)
    assert "trainer.monitor (per job)" in next(m for m in messages if "status" in m)


def test_a_sweep_run_again_in_its_dir_keeps_the_earlier_report(tmp_path: Path) -> None:
    """The second sweep writes its own report; the first one's, with its journal and swept
    keys, moves to sweep.before-1/ (and a third run's to sweep.before-2/)."""
    sweep = tmp_path / "sweep"
    first = ["trainer.seed=0,1,2", "optim.lr=0.1,0.2", "trainer.max_steps=3"]
    _seed_sweep(sweep, {"0.1": [0.5, 0.52, 0.55], "0.2": [0.6, 0.63, 0.61]})
    sweeps.SweepReport(seed_keys=["trainer.seed"]).on_multirun_start(_sweep_config(sweep, first))
    configured_report().on_multirun_end(_sweep_config(sweep, first))
    earlier = (sweep / "sweep_report.json").read_text()
    assert "groups" in json.loads(earlier)
    for n in (1, 2):
        an_hour_ago = time.time() - 3600
        for dump in sweep.glob("*/.hydra"):  # the earlier sweeps' jobs
            os.utime(dump, (an_hour_ago, an_hour_ago))
        config = _sweep_config(sweep, [f"optim.lr={n}"])
        sweeps.SweepReport().on_multirun_start(config)
        aside = sweep / f"sweep.before-{n}"
        assert sorted(p.name for p in aside.iterdir()) == [
            "sweep_jobs.jsonl", "sweep_keys.json", "sweep_report.json"
        ]  # fmt: skip
        _job(sweep, f"0_optim.lr={n}", [f"optim.lr={n}"], {"objective": 0.4})
        sweeps.SweepReport().on_multirun_end(config)
    assert (sweep / "sweep.before-1" / "sweep_report.json").read_text() == earlier
    assert [j["job"] for j in report(sweep)] == ["0_optim.lr=2"]


def test_a_sweep_jobs_stop_line_says_to_re_run_the_sweep(tmp_path: Path) -> None:
    """Under -m Hydra ignores hydra.run.dir: a sweep's stopped job says how to resume through
    its sweep; a single run keeps its hydra.run.dir advice (quoted where Hydra needs it)."""
    from hydra_ddp.distributed.preemption import stop_message
    from hydra_ddp.tracking import RunInfo

    job = tmp_path / "multirun" / "0_optim.lr=0.1"
    alone = RunInfo(output_dir=job, job_name="train", group="g", config={})
    line = stop_message(2, 47, 400, alone)
    assert line.startswith("stopped on SIGINT at step 47 of 400 with a checkpoint: re-run the")
    assert f"re-run the same command with \"hydra.run.dir='{job}'\" to resume" in line
    swept = RunInfo(job, "0_optim.lr=0.1", "g", {}, sweep_dir=tmp_path / "multirun")
    line = stop_message(15, 47, 400, swept)
    assert "hydra.run.dir" not in line, line
    assert f"re-run the sweep with hydra.sweep.dir={tmp_path / 'multirun'} (each job" in line


def test_a_secret_value_with_blanks_or_in_a_printed_dict_is_blanked_whole() -> None:
    """Previously blanked only up to its first blank (`<redacted> WITH\\ SPACE`), and not at all
    in the Optuna sweeper's `Best parameters: {...}` line."""
    launcher = "\t#1 : optim.lr=0.004 vars.db_password=PW{}WITH{}SPACE hparams_search=optuna"
    for blank in ("\\ ", " "):  # Hydra's escaped blank, and the bare one of its launcher line
        line = launcher.format(blank, blank)
        assert redact.pairs(line) == (
            "\t#1 : optim.lr=0.004 vars.db_password=<redacted> hparams_search=optuna"
        ), line
    assert (
        redact.pairs("saving hf_token=a b c\nnext line") == "saving hf_token=<redacted>\nnext line"
    )
    best = "Best parameters: {'optim.lr': 0.004, 'vars.db_password': 'PW WITH\\' SPACE', 'n': 64}"
    assert redact.pairs(best) == (
        "Best parameters: {'optim.lr': 0.004, 'vars.db_password': '<redacted>', 'n': 64}"
    )
    assert redact.pairs('{"api_key": 12345, "pad_token": "x"}') == (
        '{"api_key": \'<redacted>\', "pad_token": "x"}'
    )


# --------------------------------------------------------------------------------------------
# End to end
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(150)
@pytest.mark.slow
def test_a_fifo_in_the_sweep_dir_is_refused_in_one_line(tmp_path: Path) -> None:
    """A FIFO at the sweep's journal or at Hydra's own multirun.yaml: previously the sweep
    blocked for ever (opening a FIFO waits for a reader), holding the sweep dir's claim. Now
    the sweep stops before its first job, in one line naming the file (exit 2), and leaves the
    FIFO as it was and no claim."""
    sweep = tmp_path / "S"
    sweep.mkdir()
    for name in ("multirun.yaml", "sweep_jobs.jsonl"):
        os.mkfifo(sweep / name)
        proc = python_train(tmp_path, "-m", "optim.lr=0.01,0.02", f"hydra.sweep.dir={sweep}",
                            *TINY, timeout=60)  # fmt: skip
        assert proc.returncode == 2, output(proc)[-3000:]
        errors = [ln for ln in output(proc).splitlines() if "error:" in ln]
        assert len(errors) == 1, output(proc)[-3000:]
        assert errors[0].endswith(
            f"error: the sweep's file {sweep / name} is a FIFO (named pipe), not a regular file: "
            "remove it (the sweep writes its own there), or choose another hydra.sweep.dir"
        ), errors
        assert "Traceback" not in output(proc)
        assert stat.S_ISFIFO((sweep / name).stat().st_mode)  # left as the user made it
        assert sorted(p.name for p in sweep.iterdir()) == [name]  # no claim, no job
        (sweep / name).unlink()


@pytest.mark.slow  # a real sweep of 4 jobs; the report and the drawing are checked in process
@pytest.mark.timeout(300)
def test_a_seed_sweep_reports_its_groups_and_draws_its_picture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`-m trainer.seed=range(2) optim.lr=1e-3,3e-2` (the shorthand: every learning rate over
    seeds 0 and 1): two groups of n = 2 in the report and on the console, the comparison line,
    the command that draws the picture, and scripts/plot_run.py drawing it: per group the
    validation loss against the step (eval.jsonl), the final objective against optim.lr."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import plot_run
    from matplotlib.image import imread

    proc = ok(python_train(
        tmp_path, "-m", "trainer.seed=range(2)", "optim.lr=1e-3,3e-2", "trainer.eval_interval=2",
        "trainer.max_steps=4", *FAST, "hydra.sweep.dir=S", timeout=240,
    ))  # fmt: skip
    sweep = tmp_path / "S"
    result = json.loads((sweep / "sweep_report.json").read_text())
    jobs = result["jobs"]
    assert [j["job"] for j in jobs] == [
        "0_trainer.seed=0,optim.lr=0.001", "1_trainer.seed=0,optim.lr=0.03",
        "2_trainer.seed=1,optim.lr=0.001", "3_trainer.seed=1,optim.lr=0.03",
    ]  # fmt: skip
    assert sorted(g["group"] for g in result["groups"]) == ["optim.lr=0.001", "optim.lr=0.03"]
    for group in result["groups"]:
        values = [j["objective"] for j in jobs if j["job"] in group["jobs"]]
        assert group["n"] == 2 and group["seeds"] == ["0", "1"] and len(values) == 2
        assert math.isclose(group["mean"], sum(values) / 2)
        assert math.isclose(group["std"], statistics.stdev(values))
        assert group["interval"][0] <= min(values) and max(values) <= group["interval"][1]
    assert result["comparison"]["test"] == "paired t-test"
    out = output(proc)
    assert f"best group {result['groups'][0]['group']}: mean" in out
    assert "seed groups (trainer.seed), ranked by their mean val/loss (min):" in out
    assert f"best vs next: {result['groups'][0]['group']} vs " in out
    assert f"plots: `python scripts/plot_run.py {sweep}` draws this sweep into {sweep}/plots" in out

    assert plot_run.main([str(sweep)]) == 0
    pictures = [sweep / "plots" / n for n in ("val_loss_by_group.png", "objective_by_optim.lr.png")]
    for picture in pictures:
        pixels = imread(picture)
        assert picture.stat().st_size > 10_000 and pixels.shape[:2] == (495, 880), picture
        assert pixels[..., :3].std() > 0.05, picture  # lines and text, not a blank canvas
    # Two coloured lines (one per group) besides black text and grey grid lines.
    curves = imread(pictures[0])[..., :3]
    coloured = curves.max(axis=-1) - curves.min(axis=-1) > 0.3
    assert coloured.sum() > 500, coloured.sum()


# Made at run time, so that no file holds them (a job records the checkout's uncommitted
# changes, this file among them).
SECRETS = (*(f"hunter{n}" for n in (2, 3)), "tok-unswept-" + "77")


@pytest.mark.timeout(300)
@pytest.mark.slow  # a real launch; the default suite keeps to 5 minutes
def test_a_swept_password_is_in_no_name_report_journal_log_or_wandb_file(tmp_path: Path) -> None:
    """A real sweep of `+model.password=hunter<2>,hunter<3>` with an unswept `+model.api_token`, W&B
    offline: the models get the real values (helpers/secret_model.py checks), the jobs run and
    are told apart by their numbers, and no name or content of the sweep dir holds a value,
    except the jobs' and the sweep's own config records (.hydra/, multirun.yaml), which
    evaluation and resume rebuild the job from."""
    env = user_env(tmp_path, WANDB_MODE="offline",
                   PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO / "src")]))  # fmt: skip
    proc = ok(python_train(
        tmp_path, "-m", "model._target_=helpers.secret_model.Guarded",
        f"+model.password={SECRETS[0]},{SECRETS[1]}", f"+model.api_token={SECRETS[2]}",
        "logger=wandb", "trainer.progress=false",
        "trainer.max_steps=2", env=env, timeout=240,
    ))  # fmt: skip
    sweep = sweep_dir(tmp_path)
    jobs = report(sweep)
    names = ["0_model.password=_redacted_", "1_model.password=_redacted_"]
    assert [j["job"] for j in jobs] == names and [j["status"] for j in jobs] == ["ok", "ok"]
    assert [j["overrides"] for j in jobs] == [{"model.password": "<redacted>"}] * 2
    runs = [next((sweep / n).glob("wandb/offline-run-*/run-*.wandb")) for n in names]
    infos = [wandb_records.run_info(r) for r in runs]
    assert infos[0]["id"] != infos[1]["id"] and infos[0]["name"] != infos[1]["name"]
    journal = (sweep / "sweep_jobs.jsonl").read_text()
    assert journal.count('"+model.api_token=<redacted>"') == 2, journal
    records = (".hydra", "multirun.yaml")
    everything = list(sweep.rglob("*"))
    assert len(everything) > 30 and any(p.suffix == ".wandb" for p in everything)
    for path in everything:
        assert not any(s in str(path) for s in SECRETS), path
        if path.is_file() and not any(part.startswith(records) for part in path.parts):
            data = path.read_bytes()
            assert not any(s.encode() in data for s in SECRETS), path
    # The job's own record keeps the value: evaluation and resume rebuild the job from it.
    assert SECRETS[1] in (sweep / names[1] / ".hydra" / "config.yaml").read_text()
    out = proc.stdout + proc.stderr
    table = [ln for ln in out.splitlines() if names[0] in ln and " ok " in ln]
    assert table and "model.password=<redacted>" in table[0]
    # Nor on the console: Hydra's launcher line for each job goes through redact.LogFilter.
    assert "#1 : model._target_=helpers.secret_model.Guarded +model.password=<redacted>" in out
    assert not any(s in out for s in SECRETS), out[-3000:]


@pytest.mark.slow  # a real sweep; the names themselves are checked in process above
@pytest.mark.timeout(300)
def test_sweep_values_with_slashes_and_1000_chars(tmp_path: Path, synthetic) -> None:
    """A `/` in a value nests no dirs and a 1000-character value aborts nothing: every job is
    reported, the failed ones make the sweep exit 1, and the job after them runs."""
    real = synthetic("syn", *DATA)
    long_path = "/nonexistent/" + "a" * 1000
    proc = python_train(
        tmp_path,
        "-m",
        "data=synthetic",
        f"data.path=/nonexistent/x,{long_path},{real}",
        *TINY,
        timeout=240,
    )
    assert proc.returncode == 1, output(proc)[-4000:]
    sweep = sweep_dir(tmp_path)
    jobs = report(sweep)
    assert [j["status"] for j in jobs] == ["FAILED", "FAILED", "ok"], jobs
    assert "sweep done: 3 job(s), 2 failed" in output(proc)
    # One dir per job, each right in the sweep dir; only the swept key in the names.
    assert [p.parent for p in job_dirs(sweep)] == [sweep] * 3, job_dirs(sweep)
    names = [j["job"] for j in jobs]
    assert names[0] == "0_data.path=_nonexistent_x"
    assert len(names[1]) == paths.SUBDIR_MAX_CHARS and names[1].startswith("1_data.path=")
    assert names[2].startswith("2_data.path=") and "max_steps" not in names[2]
    assert jobs[1]["overrides"] == {"data.path": long_path}  # the JSON keeps the whole value
    assert "manifest.json not found" in jobs[0]["detail"]
    assert summary(sweep / names[2])["steps"] == 3
    # The log lists each failed job on one line with its logs.
    line = next(ln for ln in output(proc).splitlines() if f"FAILED {names[0]}" in ln)
    assert "logs:" in line and "train.log" in line


# --------------------------------------------------------------------------------------------
# Optuna (pip install -e ".[sweep]"); the sweeper's own tests are in test_optuna_sweeps.py
# --------------------------------------------------------------------------------------------

NEEDS_OPTUNA = 'needs Optuna, the sweep extra: pip install -e ".[sweep]"'
WITHOUT_OPTUNA = 'error: {} needs Optuna: pip install -e ".[sweep]" (or "optuna>=4")'


def test_optuna_search_composes() -> None:
    """With or without the sweep extra: the preset and the sweeper's keys need no Optuna."""
    from hydra import compose, initialize_config_dir

    from hydra_ddp.config import MonitorMode, register_configs
    from hydra_ddp.launch.command import find_own_plugins
    from hydra_ddp.rundir.paths import register_resolvers

    register_configs()
    register_resolvers()
    find_own_plugins()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["hparams_search=digits_optuna"], return_hydra_config=True)
    assert (cfg.trainer.monitor, cfg.trainer.monitor_mode) == ("val/acc", MonitorMode.max)
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("OptunaSweeper") and sweeper.direction == "maximize"
    assert sweeper.sampler.seed is not None
    assert set(sweeper.params) == {"optim.lr", "model.hidden"}


def test_api_compose_finds_the_sweep_plugins_in_a_fresh_process(tmp_path: Path) -> None:
    """Hydra scans for plugins once, at a process's first composition; under an editable install
    that scan cannot list src/hydra_plugins unless the engine put it on the path first (here
    the install alone finds the package, no PYTHONPATH)."""
    code = (
        "from hydra_ddp.api import compose\n"
        "cfg = compose(overrides=['hparams_search=digits_optuna', 'hydra/launcher=ray'])\n"
        "print(cfg.trainer.monitor)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=user_env(tmp_path, PYTHONPATH=None),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "val/acc"


@pytest.mark.slow
def test_the_memory_plan_command_finds_the_sweep_plugins_in_a_fresh_process(tmp_path: Path) -> None:
    """`python -m hydra_ddp.plan` composes as `api.compose` does: the same overrides as training,
    sweep plugins included."""
    done = subprocess.run(
        [sys.executable, "-m", "hydra_ddp.plan", "--device-mem", "16GiB", "hydra/launcher=ray"],
        cwd=tmp_path,
        env=user_env(tmp_path, PYTHONPATH=None),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "largest batch_size" in done.stdout


@pytest.mark.parametrize("choice", ["hparams_search=digits_optuna", "hydra/sweeper=optuna_pruned"])
def test_without_the_sweep_extra_an_optuna_sweep_says_what_to_install(
    choice: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """The sweeper's setup, where no Optuna can be found (as in a venv without the extra; the
    test below runs the real command there): one line, exit 2, before any job."""
    import importlib.util

    from helpers.inproc import compose

    from hydra_ddp.launch.command import find_own_plugins

    find_own_plugins()
    from hydra_plugins.hydra_ddp_optuna.sweeper import OptunaSweeper

    cfg = compose(choice, return_hydra_config=True)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "optuna" else find_spec(name, *a),
    )
    with pytest.raises(SystemExit) as info:
        OptunaSweeper().setup(hydra_context=None, task_function=None, config=cfg)
    assert info.value.code == 2
    assert capsys.readouterr().err == WITHOUT_OPTUNA.format(choice) + "\n"


@pytest.mark.skipif(
    importlib.util.find_spec("optuna") is not None,
    reason="Optuna is installed (the sweep extra): this runs where it is not, as the README's "
    "test command does; the test above checks the same path in process",
)
def test_without_the_sweep_extra_the_command_says_what_to_install(tmp_path: Path) -> None:
    for choice in ("hparams_search=digits_optuna", "hydra/sweeper=optuna_pruned"):
        proc = python_train(tmp_path, "-m", choice, timeout=120)
        assert proc.returncode == 2, output(proc)[-3000:]
        assert proc.stderr.strip().splitlines()[-1] == WITHOUT_OPTUNA.format(choice), proc.stderr
        assert "Traceback" not in proc.stderr and not job_dirs(tmp_path / "multirun")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_optuna_search_of_two_rank_jobs(tmp_path: Path) -> None:
    pytest.importorskip("optuna", reason=NEEDS_OPTUNA)
    proc = ok(
        python_train(
            tmp_path,
            "-m",
            "hparams_search=digits_optuna",
            "hydra.sweeper.n_trials=3",
            "dist.nproc_per_node=2",
            "trainer.max_steps=20",
            *FAST,
            timeout=540,
        )
    )
    sweep = next((tmp_path / "multirun").rglob("optimization_results.yaml")).parent
    jobs = report(sweep)
    assert len(jobs) == 3 and [j["status"] for j in jobs] == ["ok"] * 3, jobs
    for j in jobs:
        s = summary(Path(j["dir"]))
        assert s["world_size"] == 2 and j["objective"] == s["val_acc"]
        # The search space's keys name the dir; the fixed overrides do not.
        assert set(j["overrides"]) == {"optim.lr", "model.hidden"}, j
        assert j["job"].startswith(f"{j['num']}_") and "max_steps" not in j["job"]
    best = max(j["objective"] for j in jobs)
    results = OmegaConf.load(sweep / "optimization_results.yaml")
    assert math.isclose(results.best_value, best, rel_tol=0, abs_tol=1e-12)
    [marked] = [j for j in jobs if j["best"]]
    assert marked["objective"] == best
    assert f"objective val/acc (max): best {best:.6g} ({marked['job']})" in output(proc)


@pytest.mark.slow  # a real 2-trial Optuna sweep; the redaction itself is checked in process
@pytest.mark.timeout(300)
def test_an_optuna_sweep_of_a_secret_leaves_it_only_in_the_jobs_config_records(
    tmp_path: Path,
) -> None:
    """Previously: a swept `vars.db_password='choice(...)'` was written to
    optimization_results.yaml and printed in `[HYDRA] Best parameters: {...}`, and a value with
    a blank was blanked only up to it in the launcher's line. Now no file of the sweep dir
    holds a value, except the jobs' .hydra/ records (which resume and eval rebuild a job
    from), and neither does the console."""
    pytest.importorskip("optuna", reason=NEEDS_OPTUNA)
    # Made at run time, so that no file holds them (see SECRETS above).
    plain, spaced = (
        "PWAAA" + "222",
        " ".join(f"{w}x{n}" for n, w in enumerate("PW WITH SPACE".split())),
    )
    proc = ok(python_train(
        tmp_path, "-m", "hparams_search=digits_optuna", "hydra.sweeper.n_trials=2",
        f"vars.db_password=choice('{spaced}',{plain})", "trainer.max_steps=2", *FAST, timeout=240,
    ))  # fmt: skip
    sweep = next((tmp_path / "multirun").rglob("optimization_results.yaml")).parent
    used = {
        str(OmegaConf.load(d / ".hydra" / "config.yaml").vars.db_password) for d in job_dirs(sweep)
    }
    assert spaced in used, used  # the jobs got the real values (the sampler's seed picks these)
    words = [plain, *spaced.split()]
    for path in sweep.rglob("*"):
        assert not any(w in str(path) for w in words), path
        if path.is_file() and ".hydra" not in path.parts:
            data = path.read_bytes()
            assert not any(w.encode() in data for w in words), (path, data[-2000:])
    results = OmegaConf.load(sweep / "optimization_results.yaml")
    assert results.best_params["vars.db_password"] == "<redacted>" and results.best_value > 0
    out = output(proc)
    assert "Best parameters: {" in out and "'vars.db_password': '<redacted>'" in out, out[-3000:]
    assert "vars.db_password=<redacted> hparams_search=digits_optuna" in out, out[-3000:]
    assert not any(w in out for w in words), out[-3000:]


def test_optuna_direction_must_match_monitor_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """`-m hparams_search=digits_optuna trainer.monitor_mode=min`: the sweep report's callback,
    which Hydra calls before the first job, stops the sweep (exit 2) with one line. Needs no
    Optuna: the callback runs before the sweeper."""
    from helpers.inproc import compose

    from hydra_ddp.launch.command import find_own_plugins

    find_own_plugins()
    monkeypatch.chdir(tmp_path)
    cfg = compose(
        "hparams_search=digits_optuna", "trainer.monitor_mode=min", return_hydra_config=True
    )
    with pytest.raises(SystemExit) as info:
        sweeps.SweepReport().on_multirun_start(config=cfg)
    assert info.value.code == 2
    errors = [r.getMessage() for r in caplog.records if "error:" in r.getMessage()]
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert "hydra.sweeper.direction=maximize does not match trainer.monitor_mode=min" in errors[0]
    assert not (tmp_path / "multirun").exists()  # no job ran


def test_a_submitit_task_gets_its_cpu_share_of_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """hydra/launcher=submitit_local starts every task of every job at once: each rank's
    OpenMP pool is its share of the cores unless the user set OMP_NUM_THREADS."""
    import os

    import torch

    from hydra_ddp.distributed import share_cpus_in_submitit_task

    before = torch.get_num_threads()
    # Set, then deleted: monkeypatch records a variable only when it exists, and the function
    # under test sets OMP_NUM_THREADS itself; without the record it would outlive this test.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    try:
        assert share_cpus_in_submitit_task(3) is None  # not a submitit task: untouched
        monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
        assert share_cpus_in_submitit_task(3) == 3  # the launcher's cpus_per_task
        assert torch.get_num_threads() == 3 and os.environ["OMP_NUM_THREADS"] == "3"
        assert share_cpus_in_submitit_task(5) is None  # set now: a user's setting wins
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setenv("SLURM_CPUS_PER_TASK", "2")
        assert share_cpus_in_submitit_task(None) == 2  # SLURM's cpus-per-task
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.delenv("SLURM_CPUS_PER_TASK")
        # Neither: the machine's cores over the job's tasks (one task outside a real job).
        assert share_cpus_in_submitit_task(None) == max(1, os.cpu_count() or 1)
    finally:
        torch.set_num_threads(before)
