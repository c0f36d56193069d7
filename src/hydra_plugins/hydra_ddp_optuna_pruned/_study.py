"""The sweep of `hydra/sweeper=optuna_pruned`: open (or continue) the study, run again what a
stopped sweep left running, then ask for trials in batches of `n_jobs`, launch them, and tell
Optuna how each ended: COMPLETE with its objective, PRUNED (the job marked its trial), or FAIL.

Each job learns its trial from three variables set with `hydra.job.env_set` (names in
hydra_ddp.loop.pruning); the trial records the sweep dir, the job's number and its overrides,
so a continued sweep finds its own unfinished trials and runs each again under the same number,
in the same job dir, where the job resumes from its last checkpoint.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

import optuna
from hydra.core.utils import JobReturn, JobStatus
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from optuna.trial import TrialState

from hydra_ddp.loop.pruning import PRUNED_ATTR, PRUNER_ATTR, STORAGE_ENV, STUDY_ENV, TRIAL_ENV
from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

log = logging.getLogger(__name__)

# Trial attributes the sweeper sets as it asks for a trial.
DIR_ATTR, NUM_ATTR, OVERRIDES_ATTR = "sweep_dir", "job_num", "overrides"
STORAGE_FILE = "optuna.db"


def storage_url(params: dict[str, Any], sweep_dir: Path) -> str:
    """`hydra.sweeper.storage`, or SQLite in the sweep dir."""
    return str(params.get("storage") or f"sqlite:///{sweep_dir / STORAGE_FILE}")


def sweep(sweeper: Any, arguments: list[str]) -> None:
    config, params = sweeper.config, sweeper.params
    sweep_dir = Path(os.path.abspath(config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    _check_evaluations(config)
    space, fixed = create_params_from_overrides(
        [f"{k}={v}" for k, v in (params.get("params") or {}).items()] + list(arguments)
    )
    for name in fixed:  # a fixed value on the command line wins over the search space
        space.pop(name, None)
    run = _Run(sweeper, sweep_dir)
    run.tell_jobs_the_study(config)
    done = len(run.study.get_trials(deepcopy=False))
    log.info(
        "study %s in %s: %d trial(s) so far, %d to go (hydra.sweeper.n_trials=%d); pruner %s",
        run.study.study_name,
        run.url,
        done,
        max(int(params["n_trials"]) - done, 0),
        int(params["n_trials"]),
        _plain(params["pruner"]).get("_target_"),
    )
    run.resume_unfinished()
    while True:
        to_go = int(params["n_trials"]) - len(run.study.get_trials(deepcopy=False))
        if to_go <= 0:
            break
        trials = [run.study.ask(space) for _ in range(min(run.n_jobs, to_go))]
        overrides = []
        for trial in trials:
            job = [f"{k}={v}" for k, v in trial.params.items()]
            job += [f"{k}={v}" for k, v in fixed.items()]
            trial.set_user_attr(DIR_ATTR, str(sweep_dir))
            trial.set_user_attr(NUM_ATTR, run.next_num + len(overrides))
            trial.set_user_attr(OVERRIDES_ATTR, job)
            overrides.append(job)
        run.launch([t.number for t in trials], overrides, run.next_num)
    _write_results(run.study, sweep_dir)


class _Run:
    """This run of the sweep: its launcher, and the job numbers it hands out."""

    def __init__(self, sweeper: Any, sweep_dir: Path) -> None:
        params = sweeper.params
        self.launcher, self.sweep_dir = sweeper.launcher, sweep_dir
        self.n_jobs = max(int(params.get("n_jobs") or 1), 1)
        self.url = storage_url(params, sweep_dir)
        self.sampler = instantiate(params["sampler"])
        self.pruner = instantiate(params["pruner"])
        direction = params.get("direction", "minimize")
        self.study = optuna.create_study(
            study_name=str(params["study_name"]),
            storage=self.url,
            sampler=self.sampler,
            pruner=self.pruner,
            direction=str(getattr(direction, "name", direction)),
            load_if_exists=True,
        )
        # Optuna keeps no pruner in the database: each job builds this one from here.
        self.study.set_user_attr(PRUNER_ATTR, _plain(params["pruner"]))
        done = len(self.study.get_trials(deepcopy=False))
        seed = OmegaConf.select(params["sampler"], "seed", default=None)
        if done and seed is not None:
            # A continued study: the same seed would propose the first trials' points again.
            self.sampler = self.study.sampler = instantiate(params["sampler"], seed=seed + done)
        mine = self.mine()
        self.next_num = max((int(t.user_attrs[NUM_ATTR]) for t in mine), default=-1) + 1

    def reload(self) -> None:
        """Read the study afresh: Optuna's cache keeps its own view of the trials this process
        asked for, which misses what their jobs wrote (a pruned job's mark)."""
        self.study = optuna.load_study(
            study_name=self.study.study_name,
            storage=self.url,
            sampler=self.sampler,
            pruner=self.pruner,
        )

    def mine(self) -> list[optuna.trial.FrozenTrial]:
        """The study's trials of this sweep dir (a database can hold other sweeps' too)."""
        return [
            t
            for t in self.study.get_trials(deepcopy=False)
            if t.user_attrs.get(DIR_ATTR) == str(self.sweep_dir) and NUM_ATTR in t.user_attrs
        ]

    def resume_unfinished(self) -> None:
        """Trials of this sweep dir still RUNNING: the sweep that ran them was stopped (this
        process holds the sweep dir's claim, so it is gone). A pruned one is told so; the
        others run again, under their numbers, so each resumes in its own job dir."""
        left = sorted(
            (t for t in self.mine() if t.state == TrialState.RUNNING),
            key=lambda t: int(t.user_attrs[NUM_ATTR]),
        )
        pruned = [t for t in left if PRUNED_ATTR in t.user_attrs]
        for t in pruned:
            self.study.tell(t.number, state=TrialState.PRUNED)
        left = [t for t in left if PRUNED_ATTR not in t.user_attrs]
        if left:
            log.info(
                "continuing %d trial(s) the stopped sweep left unfinished: job(s) %s",
                len(left),
                ", ".join(f"#{t.user_attrs[NUM_ATTR]}" for t in left),
            )
        # A launch numbers its jobs consecutively: one batch per run of consecutive numbers.
        batch: list[optuna.trial.FrozenTrial] = []
        for t in [*left, None]:
            num = None if t is None else int(t.user_attrs[NUM_ATTR])
            if batch and (
                t is None
                or len(batch) == self.n_jobs
                or num != int(batch[-1].user_attrs[NUM_ATTR]) + 1
            ):
                self.launch(
                    [b.number for b in batch],
                    [list(b.user_attrs[OVERRIDES_ATTR]) for b in batch],
                    int(batch[0].user_attrs[NUM_ATTR]),
                )
                batch = []
            if t is not None:
                batch.append(t)

    def launch(self, numbers: list[int], overrides: list[list[str]], first: int) -> None:
        """Run trials `numbers` as jobs `first`, `first + 1`, ... and tell how each ended."""
        jobs = [[*job, *self._trial_env(number)] for number, job in zip(numbers, overrides)]
        returns = self.launcher.launch(jobs, initial_job_idx=first)
        self.next_num = max(self.next_num, first + len(jobs))
        self.reload()
        for number, ret in zip(numbers, returns):
            self._tell(number, ret)

    def tell_jobs_the_study(self, config: DictConfig) -> None:
        """Every job gets the study's database and name in its environment: as Hydra
        overrides of the sweep (hydra.overrides.hydra), which a launcher applies to each job's
        config; Hydra sets `hydra.job.env_set` in the job's process, and every process of the
        job inherits it."""
        env = {STORAGE_ENV: self.url, STUDY_ENV: self.study.study_name}
        with open_dict(config):
            config.hydra.overrides.hydra.extend(_env_set(env))

    @staticmethod
    def _trial_env(number: int) -> list[str]:
        """The override that tells a job its trial number (see tell_jobs_the_study)."""
        return _env_set({TRIAL_ENV: str(number)})

    def _tell(self, number: int, ret: JobReturn) -> None:
        trial = self.study.get_trials(deepcopy=False)[number]
        if PRUNED_ATTR in trial.user_attrs:
            self.study.tell(number, state=TrialState.PRUNED)
            return
        value = _value(ret)
        if value is None:
            self.study.tell(number, state=TrialState.FAIL)
        else:
            self.study.tell(number, values=value)


def _value(ret: JobReturn) -> float | None:
    """The job's objective, or None when it failed (an exception, a NaN: train.py's mark)."""
    if ret.status != JobStatus.COMPLETED:
        return None
    try:
        value = float(ret.return_value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _check_evaluations(config: DictConfig) -> None:
    """No evaluation during training leaves the pruner nothing to judge: one line, exit 2."""
    interval = OmegaConf.select(config, "trainer.eval_interval", default=0) or 0
    if int(interval) <= 0:
        log.error(
            "error: hydra/sweeper=optuna_pruned prunes at evaluations, but "
            "trainer.eval_interval=%s: add trainer.eval_interval=<steps> (e.g. a tenth of "
            "trainer.max_steps)",
            interval,
        )
        sys.exit(2)


def _write_results(study: optuna.Study, sweep_dir: Path) -> None:
    """<sweep dir>/optimization_results.yaml, as Hydra's Optuna sweeper writes it, with the
    count of trials by how they ended."""
    trials = study.get_trials(deepcopy=False)
    counts = {s.name: sum(t.state == s for t in trials) for s in TrialState}
    results: dict[str, Any] = {"name": "optuna_pruned", "trials": counts}
    if counts["COMPLETE"]:
        best = study.best_trial
        results.update(best_params=best.params, best_value=best.value)
        log.info("Best parameters: %s", best.params)
        log.info("Best value: %s", best.value)
    log.info(
        "trials: %s",
        ", ".join(f"{n} {k.lower()}" for k, n in counts.items() if n),
    )
    OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")


def _plain(node: Any) -> dict[str, Any]:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def _env_set(env: dict[str, str]) -> list[str]:
    return [f"++hydra.job.env_set.{k}={_quoted(v)}" for k, v in env.items()]


def _quoted(value: str) -> str:
    """`value` as a quoted string of Hydra's override grammar (a URL holds `:` and `/`)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
