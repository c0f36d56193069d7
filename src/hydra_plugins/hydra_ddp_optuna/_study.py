"""The sweep: read the search space, open (or continue) the study, run again what a stopped
sweep left running, then ask for trials `n_jobs` at a time, launch them and tell how each ended.
The study holds each trial's swept values (a secret's as its index), sweep dir and job number,
never the fixed overrides: a continued trial runs again in its job dir and resumes there.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy.engine
import sqlalchemy.exc
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Transformer
from hydra.core.utils import JobStatus
from hydra.errors import HydraException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from hydra_ddp import redact
from hydra_ddp.errors import UserError, first_line
from hydra_ddp.launcher_env import OPTUNA_STORAGE_ENV as STORAGE_ENV
from hydra_ddp.launcher_env import OPTUNA_STUDY_ENV as STUDY_ENV
from hydra_ddp.launcher_env import OPTUNA_TRIAL_ENV as TRIAL_ENV
from hydra_ddp.loop import PRUNED_ATTR, PRUNER_ATTR

log = logging.getLogger(__name__)

DIR_ATTR, NUM_ATTR = "sweep_dir", "job_num"


def sweep(sweeper: Any, arguments: list[str]) -> None:
    config, params = sweeper.config, sweeper.params
    space = SearchSpace(params.get("params") or {}, arguments, config)
    interval = OmegaConf.select(config, "trainer.eval_interval", default=0) or 0
    if params.get("pruner") and int(interval) <= 0:  # the pruner would have nothing to judge
        raise UserError(
            f"hydra.sweeper.pruner judges trials at evaluations, but trainer.eval_interval="
            f"{interval}: add trainer.eval_interval=<steps> (e.g. a tenth of trainer.max_steps)"
        )
    sweep_dir = Path(os.path.abspath(config.hydra.sweep.dir))
    storage = params.get("storage") or f"sqlite:///{sweep_dir / 'optuna.db'}"
    try:
        _Run(sweeper, sweep_dir, space, storage).run(int(params["n_trials"]))
    except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as e:
        cause = e.__cause__ or e  # Optuna's StorageInternalError wraps SQLAlchemy's
        raise UserError(
            f"the Optuna study's storage {_shown(storage)} failed "
            f"({first_line(getattr(cause, 'orig', None) or cause)}): free space there (or make "
            "it writable) and run the same command again to continue the study, or name another "
            "with hydra.sweeper.storage"
        ) from e


class SearchSpace:
    """`hydra.sweeper.params` and the command line (which wins), by Hydra's override parser:
    each swept key as an Optuna distribution, the rest fixed overrides of every job."""

    def __init__(self, params: dict[str, Any], arguments: list[str], config: DictConfig) -> None:
        self.distributions: dict[str, Any] = {}
        self.fixed: dict[str, str] = {}
        self.secrets: dict[str, list[Any]] = {}  # a secret key's choices, by their index
        numeric: dict[str, str] = {}  # the keys the search space gives numbers: where it does
        parser = OverridesParser.create()
        entries = [(f"hydra.sweeper.params.{k}={v}", f"{k}={v}") for k, v in params.items()]
        for shown, text in [*entries, *((a, a) for a in arguments)]:
            try:
                [override] = parser.parse_overrides([text])
                key, values = override.get_key_element(), [override.value()]
                self.distributions.pop(key, None)
                self.fixed.pop(key, None)
                if override.is_sweep_override():
                    values = self._add(key, override)
                else:
                    self.fixed[key] = text
            except (HydraException, ValueError) as e:  # unreadable, empty, low > high
                reason = ([ln for ln in str(e).splitlines() if "while evaluating" in ln] or [e])[0]
                raise UserError(
                    f"{shown}: {reason}: write a value, or one of choice(a, b, ...), a,b,..., "
                    "range(start, stop), interval(low, high), tag(log, interval(low, high))"
                ) from e
            if shown != text and all(_is_number(v) for v in values):
                numeric[key] = shown
            default = OmegaConf.select(config, key.lstrip("+~"), throw_on_resolution_failure=False)
            why = numeric.get(key) or (_is_number(default) and f"{key}={default} in the config")
            bad = [v for v in values if not (_is_number(v) or v is None or "${" in str(v))]
            if why and bad:
                raise UserError(
                    f"{shown}: {bad[0]!r} is not a number, but {key} takes one ({why}): give one"
                )

    def _add(self, key: str, override: Any) -> list[Any]:
        sweep = override.value()
        if override.is_interval_sweep():  # of floats, as Hydra reads it (range() gives ints)
            dist = FloatDistribution(sweep.start, sweep.end, log="log" in sweep.tags)
            self.distributions[key] = dist
            return [sweep.start, sweep.end]
        values = list(override.sweep_iterator(transformer=Transformer.encode))
        if override.is_range_sweep() and {type(v) for v in values} == {int} and sweep.step > 0:
            self.distributions[key] = IntDistribution(values[0], values[-1], step=sweep.step)
        elif redact.is_secret(key):
            self.secrets[key] = values
            self.distributions[key] = CategoricalDistribution(range(len(values)))
        else:
            self.distributions[key] = CategoricalDistribution(values)
        return values

    def job(self, params: dict[str, Any]) -> list[str]:
        values = {k: self.secrets[k][v] if k in self.secrets else v for k, v in params.items()}
        swept = [f"{k}={Transformer.str(values[k])}" for k in self.distributions if k in values]
        return [*swept, *self.fixed.values()]


class _Run:
    def __init__(self, sweeper: Any, sweep_dir: Path, space: SearchSpace, storage: Any) -> None:
        params = sweeper.params
        self.config, self.launcher = sweeper.config, sweeper.launcher
        self.sweep_dir, self.space, self.storage = sweep_dir, space, storage
        self.n_jobs = max(int(params.get("n_jobs") or 1), 1)
        self.pruner_config = pruner = params.get("pruner")
        self.study = optuna.create_study(
            study_name=str(params["study_name"]),
            storage=instantiate(storage) if isinstance(storage, dict) else storage,
            sampler=instantiate(params["sampler"]),
            pruner=instantiate(pruner) if pruner else optuna.pruners.NopPruner(),
            direction=str(params.get("direction", "minimize")),
            load_if_exists=True,
        )
        done = len(self.study.get_trials(deepcopy=False))
        seed = params["sampler"].get("seed")
        if done and seed is not None:
            # A continued study: the same seed would propose the first points again.
            self.study.sampler = instantiate(params["sampler"], seed=seed + done)
        self.next_num = max(map(_num, self.mine()), default=-1) + 1

    def run(self, n_trials: int) -> None:
        if self.pruner_config:
            self.tell_jobs_the_study()
        done = len(self.study.get_trials(deepcopy=False))
        where = f"study {self.study.study_name} in {_shown(self.storage)}"
        log.info(f"{where}: {done} trial(s) so far, {max(n_trials - done, 0)} to go")
        self.resume_unfinished()
        while (to_go := n_trials - len(self.study.get_trials(deepcopy=False))) > 0:
            count = min(self.n_jobs, to_go)
            trials = [self.study.ask(self.space.distributions) for _ in range(count)]
            for i, trial in enumerate(trials):
                trial.set_user_attr(DIR_ATTR, str(self.sweep_dir))
                trial.set_user_attr(NUM_ATTR, self.next_num + i)
            self.launch(trials)
        _write_results(self.study, self.sweep_dir)

    def mine(self) -> list[optuna.trial.FrozenTrial]:
        trials = self.study.get_trials(deepcopy=False)
        mine = [t for t in trials if t.user_attrs.get(DIR_ATTR) == str(self.sweep_dir)]
        return [t for t in mine if NUM_ATTR in t.user_attrs]

    def resume_unfinished(self) -> None:
        """Trials of this sweep dir still RUNNING (their sweep was stopped: this one holds the
        claim): a pruned one is told so, the others run again in their own job dirs."""
        left = sorted((t for t in self.mine() if t.state == TrialState.RUNNING), key=_num)
        for t in left:
            if PRUNED_ATTR in t.user_attrs:
                self.study.tell(t.number, state=TrialState.PRUNED)
        left = [t for t in left if PRUNED_ATTR not in t.user_attrs]
        if left:
            log.info(
                "continuing %d trial(s) the stopped sweep left unfinished: job(s) %s",
                len(left),
                ", ".join(f"#{_num(t)}" for t in left),
            )
        # A launch numbers its jobs consecutively: one per run of consecutive numbers.
        for _, run in itertools.groupby(enumerate(left), lambda it: _num(it[1]) - it[0]):
            trials = [t for _, t in run]
            for i in range(0, len(trials), self.n_jobs):
                self.launch(trials[i : i + self.n_jobs])

    def launch(self, trials: list[Any]) -> None:
        jobs, first = [self.space.job(t.params) for t in trials], _num(trials[0])
        if self.pruner_config:  # each job reports to its trial
            jobs = [[*job, *_env_set({TRIAL_ENV: str(t.number)})] for t, job in zip(trials, jobs)]
        returns = self.launcher.launch(jobs, initial_job_idx=first)
        self.next_num = max(self.next_num, first + len(jobs))
        # What the jobs wrote to their trials: Optuna reads an unfinished trial from the storage.
        for trial, ret in zip(trials, returns):
            if PRUNED_ATTR in self.study.get_trials(deepcopy=False)[trial.number].user_attrs:
                self.study.tell(trial.number, state=TrialState.PRUNED)
            elif ret.status == JobStatus.COMPLETED and math.isfinite(ret.return_value):
                self.study.tell(trial.number, values=ret.return_value)
            else:  # an exception, or a NaN objective (run_job's mark of a failed job)
                self.study.tell(trial.number, state=TrialState.FAIL)

    def tell_jobs_the_study(self) -> None:
        """The storage and study name to every job's environment (loop/evaluation.py), through
        Hydra overrides each launcher applies; the pruner's config to the study."""
        self.study.set_user_attr(PRUNER_ATTR, self.pruner_config)
        storage = json.dumps(self.storage) if isinstance(self.storage, dict) else self.storage
        env = _env_set({STORAGE_ENV: storage, STUDY_ENV: self.study.study_name})
        with open_dict(self.config):
            self.config.hydra.overrides.hydra.extend(env)


def _write_results(study: optuna.Study, sweep_dir: Path) -> None:
    """optimization_results.yaml as Hydra's Optuna sweeper wrote it, secrets blanked, with the
    trials counted by how they ended."""
    trials = study.get_trials(deepcopy=False)
    counts = {s.name: sum(t.state == s for t in trials) for s in TrialState}
    results: dict[str, Any] = {"name": "optuna", "trials": counts}
    if counts["COMPLETE"]:
        best = study.best_trial
        params = {k: redact.REDACTED if redact.is_secret(k) else v for k, v in best.params.items()}
        results.update(best_params=params, best_value=best.value)
        log.info("Best parameters: %s; best value: %s", params, best.value)
    log.info("trials: %s", ", ".join(f"{n} {k.lower()}" for k, n in counts.items() if n))
    OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")


def _num(trial: Any) -> int:
    return int(trial.user_attrs[NUM_ATTR])


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shown(storage: Any) -> str:
    try:
        return sqlalchemy.engine.make_url(storage).render_as_string(hide_password=True)
    except sqlalchemy.exc.ArgumentError:  # a storage's config, or no URL
        return json.dumps(storage)


def _env_set(env: dict[str, str]) -> list[str]:
    """`hydra.job.env_set` overrides, values quoted (a URL holds `:` and `/`)."""
    quoted = {k: "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'" for k, v in env.items()}
    return [f"++hydra.job.env_set.{k}={v}" for k, v in quoted.items()]
