"""The command line: `run_command` checks it (`check_command_line`: one `error:` line and exit 2
where Hydra would answer with a paragraph, a traceback or a line repeating a maybe secret value),
composes the config with Hydra (a sweep with `-m`) and hands each job to `hydra_entry`, where
Hydra's launcher runs it (runner.py). No torch here: a sweep's launching process only composes
and hands out jobs.
"""

from __future__ import annotations

import difflib
import functools
import gc
import importlib
import os
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hydra_ddp import redact
from hydra_ddp.config import TrainConfig, register_configs
from hydra_ddp.errors import UserError, first_line, no_such_key, sweep_under_torchrun
from hydra_ddp.launch import interrupt
from hydra_ddp.launcher_env import launcher_rank, torchrun_worker, under_launcher
from hydra_ddp.rundir import claim, sweeps
from hydra_ddp.rundir.paths import register_resolvers

if TYPE_CHECKING:
    from hydra_ddp.launch.runner import TrainFn

# The groups whose keys are typed (config.py, logger_config.py); the rest are components.
_TYPED = ("trainer", "dist", "ddp", "logger")

# At import: a submitit or Ray job's process unpickles `hydra_entry` (importing this module) and
# resolves the config's `${ddp_...}` names and schema without `run_command`.
register_configs()
register_resolvers()


def run_command(
    train_fn: TrainFn, config_path: str | None = None, config_name: str = "train"
) -> None:
    """Run `train_fn` as `python -m hydra_ddp.train [overrides]` does, composing `config_name` from
    `config_path` (None: `config_dir()`); exits with the job's status (2 for bad input)."""
    if torchrun_worker():
        # A Ctrl-C while Hydra composes waits for the job's start to say its line, from rank 0.
        interrupt.hold()
    find_own_plugins()
    conf = config_dir() if config_path is None else config_path
    if "://" not in conf:
        conf = os.path.abspath(conf)
    # The project's config dir, the engine's (a thin project extends it), and any the command
    # line adds; a `pkg://` one cannot be listed, so its groups' choices are left to Hydra.
    given = config_dirs_given(sys.argv[1:])
    dirs = [Path(d) for d in dict.fromkeys([conf, config_dir(), *given])]
    check_command_line(sys.argv[1:], [d for d in dirs if d.is_dir()], all(d.is_dir() for d in dirs))
    train_fn = _importable(train_fn)
    task = functools.partial(hydra_entry, train_fn=train_fn)
    # Hydra names the job (hydra.job.name: train.log) after the task function's module.
    task.__module__ = train_fn.__module__
    try:
        hydra.main(version_base="1.3", config_path=conf, config_name=config_name)(task)()
        code = 1 if sweeps.sweep_failed() else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        sweeps.report_stopped()  # a sweep whose job in this process stopped on a signal
    except KeyboardInterrupt:  # while Hydra composes, or in a sweep's launching process
        interrupt.ignore_more()
        if launcher_rank() == 0:
            sys.stderr.write("stopped on SIGINT\n")
        code = interrupt.EXIT_CODE
    claim.release_all()
    claim.release_sweep()  # a sweep that ended before its report (on_multirun_end)
    if under_launcher():
        # At teardown a rank can still abort ("terminate called without an active exception":
        # a gloo thread destroyed while joinable), failing a finished job.
        interrupt.exit_now(code)
    # The last garbage collections would walk every object torch and the job made; frozen
    # objects are skipped, while atexit handlers and module teardown still run.
    gc.freeze()
    sys.exit(code)


def hydra_entry(dict_cfg: DictConfig, train_fn: TrainFn) -> float:
    """One composed job, where Hydra's launcher runs it; the objective for sweepers."""
    # Imported where a job runs (torch with it); a Ctrl-C meanwhile waits for the runner's line
    # (run_composed lets it through first).
    interrupt.hold()
    from hydra_ddp.launch.runner import run_composed

    return run_composed(dict_cfg, train_fn)


def compose_typed(
    config_path: str | Path | None, config_name: str, overrides: list[str]
) -> TrainConfig:
    """The config `python -m hydra_ddp.train overrides...` trains with, typed and checked,
    composed in this process (for the API, the memory plan and the check)."""
    from hydra_ddp.launch.runner import to_typed

    conf = str(Path(config_path).resolve()) if config_path is not None else config_dir()
    find_own_plugins()  # before Hydra's one plugin scan per process: hydra/launcher=ray, ...
    with hydra.initialize_config_dir(config_dir=conf, version_base="1.3"):
        return to_typed(hydra.compose(config_name, overrides=overrides))


def config_dir() -> str:
    """The configs: conf/ of a checkout (an editable install), else the copy a wheel ships."""
    package = Path(__file__).resolve().parent.parent
    checkout = package.parent.parent / "conf"
    if package.parent.name == "src" and (checkout / "train.yaml").is_file():
        return str(checkout)
    return str(package / "conf")


def find_own_plugins() -> None:
    """Let Hydra's plugin scan (pkgutil) see a checkout's src/hydra_plugins, which an editable
    install imports through setuptools' finder, which the scan cannot list."""
    src = Path(__file__).resolve().parent.parent.parent
    if (src / "hydra_plugins").is_dir() and str(src) not in sys.path:
        sys.path.append(str(src))


def _importable(train_fn: TrainFn) -> TrainFn:
    """`train_fn` by its module's name, not `__main__`'s: a worker imports it by name."""
    spec = getattr(sys.modules.get(train_fn.__module__), "__spec__", None)
    if train_fn.__module__ != "__main__" or spec is None:
        return train_fn
    return getattr(importlib.import_module(spec.name), train_fn.__qualname__)


def check_command_line(argv: list[str], conf_dirs: list[Path], choices: bool = True) -> None:
    """Exit 2 with one line at the first override refused. `conf_dirs`: the config dirs the
    job composes from; `choices`: they are all (no `pkg://`), so choices can be checked."""
    try:
        if torchrun_worker() and any(a in ("-m", "--multirun") for a in argv):
            # Every rank would start the sweep and race for its dir: refused before that.
            raise sweep_under_torchrun()
        _check_run_dir(argv)
        parsed = _parse([a for a in argv if not a.startswith("-") and ("=" in a or a[:1] == "~")])
        groups = _groups(conf_dirs)
        for override in parsed:
            _check_key(override, groups)
            if choices:
                _check_choice(override, groups)
        _check_typed_values(parsed)
    except UserError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)


def config_dirs_given(argv: list[str]) -> list[str]:
    """The config dirs --config-path/-cp and --config-dir/-cd name."""
    found = []
    for i, arg in enumerate(argv):
        flag, _, value = arg.partition("=")
        if flag in ("--config-path", "-cp", "--config-dir", "-cd"):
            value = value or (argv[i + 1] if i + 1 < len(argv) else "")
            found.append(value if "://" in value else os.path.abspath(value))
    return found


def _parse(items: list[str]) -> list[Any]:
    """Hydra's parse of each override; one it cannot read is refused in one line."""
    parser, parsed = OverridesParser.create(), []
    for item in items:
        try:
            parsed += parser.parse_overrides([item])
        except OverrideParseException as e:
            shown = redact.overrides([item])[0]
            # Hydra's first line repeats the override; the next says why (quoting the value).
            lines = [line.strip() for line in str(e).splitlines()[1:]]
            why = [line for line in lines if line and not line.startswith("See ")]
            cause = f" ({why[0]})" if why and shown == item else ""
            raise UserError(
                f"{shown}: Hydra cannot read this override{cause}: see "
                "https://hydra.cc/docs/advanced/override_grammar/basic/"
            ) from None
    return parsed


def _groups(conf_dirs: list[Path]) -> dict[str, set[str]]:
    """Config group (`hydra/launcher` too) -> its choices, from the YAML files of `conf_dirs`."""
    found: dict[str, set[str]] = {}
    for conf in conf_dirs:
        for path in conf.rglob("*.yaml"):
            group = path.parent.relative_to(conf).as_posix()
            if group != ".":
                found.setdefault(group, set()).add(path.stem)
    return found


def _check_key(override: Any, groups: dict[str, set[str]]) -> None:
    if override.is_add() or override.is_delete() or override.is_force_add():
        return
    key = override.key_or_group
    root = key.split("/")[0].split(".")[0]
    known = {f.name for f in fields(TrainConfig)} | {g.split("/")[0] for g in groups} | {"hydra"}
    if root not in known:
        raise no_such_key(key)
    parts = key.split(".")
    if root in _TYPED and len(parts) > 1 and key not in groups:
        node: Any = OmegaConf.structured(TrainConfig)
        for i, part in enumerate(parts):
            # Only a dataclass's keys are known: a mapping typed Any takes any key.
            if not OmegaConf.is_config(node) or not is_dataclass(OmegaConf.get_type(node)):
                return
            if part not in node:
                keys = sorted(str(k) for k in node.keys())
                close = difflib.get_close_matches(part, keys, n=1)
                hint = f"did you mean {close[0]}?" if close else f"its keys are {', '.join(keys)}"
                raise UserError(
                    f"{key} is not a key of {'.'.join(parts[:i])} (src/hydra_ddp/config.py): "
                    f"check the spelling, {hint}"
                )
            if OmegaConf.is_missing(node, part):
                return
            node = node[part]


def _check_choice(override: Any, groups: dict[str, set[str]]) -> None:
    group = override.get_key_element().split("@")[0]
    if group not in groups or group.startswith("hydra/") or override.is_delete():
        return
    for choice in _values(override):
        if isinstance(choice, str) and "${" not in choice and choice not in groups[group]:
            raise UserError(
                f"{group}={choice}: conf/{group}/ has no {choice}.yaml; the choices are "
                f"{', '.join(sorted(groups[group]))} (or add conf/{group}/{choice}.yaml)"
            )


def _check_typed_values(parsed: list[Any]) -> None:
    """A value (each of a sweep's) that the typed key refuses: `trainer.max_steps=abc`."""
    schema = OmegaConf.structured(TrainConfig)
    for override in parsed:
        key = override.key_or_group
        if key.split(".")[0] not in _TYPED or "." not in key or override.is_delete():
            continue
        for value in _values(override):
            if isinstance(value, str) and "${" in value:
                continue
            try:
                OmegaConf.update(schema, key, value, merge=True, force_add=override.is_add())
            except OmegaConfBaseException as e:
                shown = redact.REDACTED if redact.is_secret(key) else repr(value)
                raise UserError(
                    f"{key}={shown} is not allowed: {first_line(e).split('    ')[0]}"
                ) from None


def _values(override: Any) -> list[Any]:
    """The values an override sets; none for what only a sweeper expands (interval())."""
    try:
        return list(override.sweep_iterator()) if override.is_sweep_override() else [
            override.value()
        ]  # fmt: skip
    except Exception:
        return []


def _check_run_dir(argv: list[str]) -> None:
    """`hydra.run.dir` that cannot be created: one line, not Hydra's mkdir traceback."""
    given = [a for a in argv if a.startswith("hydra.run.dir=")]
    if not given or "${" in given[-1] or any(a in ("-m", "--multirun") for a in argv):
        return
    try:  # the value as Hydra reads it (`'out/a b'` is `out/a b`)
        path = str(OverridesParser.create().parse_overrides(given[-1:])[0].value())
    except Exception:  # Hydra reports what it cannot parse
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"hydra.run.dir={path} cannot be created ({e.strerror}): choose a writable place"
        ) from None
