"""The command line, checked before Hydra composes it: one `error:` line and exit 2 where Hydra
would answer with a paragraph, a traceback or a line repeating a (maybe secret) value. Each
check reads Hydra's override grammar and leaves to Hydra what it cannot judge.
"""

from __future__ import annotations

import difflib
import os
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hydra_ddp import redact
from hydra_ddp.config import TrainConfig
from hydra_ddp.errors import UserError, first_line, no_such_key
from hydra_ddp.rundir.paths import override_value

# The groups whose keys are typed (config.py, logger_config.py); the rest are components.
_TYPED = ("trainer", "dist", "ddp", "logger")


def check_command_line(argv: list[str], conf_dirs: list[Path], choices: bool = True) -> None:
    """Exit 2 with one line at the first override refused. `conf_dirs`: the config dirs the
    job composes from; `choices`: they are all (no `pkg://`), so choices can be checked."""
    try:
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
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

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
    path = override_value(given[-1])
    if path is None:
        return  # Hydra reports what it cannot parse
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"hydra.run.dir={path} cannot be created ({e.strerror}): choose a writable place"
        ) from None
