"""Building what a user swaps in (data, model, optimizer, scheduler, loss, metrics): a
`_target_` plus its keyword arguments, built by `hydra.utils.instantiate`.

What only the template knows at run time reaches a component by name: `build` passes each
`runtime` keyword to the target when its signature has a parameter of that name and the YAML
did not set it (a model's `in_features` from the data, an optimizer's `params`). Arguments are
checked against the signature first, so a typo'd or missing one fails in one line that names
the config key and what the target accepts.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import logging
import re
from typing import Any, Mapping

from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate

from hydra_ddp.errors import UserError, check, needs_package  # noqa: F401 (check: a component's own)


def build(cfg: Mapping[str, Any], key: str, _as_function: bool = False, **runtime: Any) -> Any:
    """Instantiate the component configured at `key` (e.g. "model"), passing the `runtime`
    keywords its signature asks for. `_as_function`: a plain function as `_target_` is the
    component itself (a loss `def focal(output, target)`), its YAML arguments bound to it."""
    if not isinstance(cfg, Mapping) or "_target_" not in cfg:
        raise UserError(
            f"{key} has no _target_: pick a choice of the {key.split('.')[0]} group "
            f"(conf/{key.split('.')[0]}/*.yaml), or set {key}._target_=<class>"
        )
    target = cfg["_target_"]
    hydra_log = logging.getLogger("hydra.utils")
    quiet, hydra_log.disabled = hydra_log.disabled, True  # it logs the error it then raises
    try:
        obj = get_object(target)
    except Exception as e:
        raise UserError(
            # Hydra's message puts the cause (the ImportError) on its later lines.
            f"{key}._target_={target!r} cannot be imported: "
            + " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        ) from None
    finally:
        hydra_log.disabled = quiet
    given = {k for k in cfg if not (k.startswith("_") and k.endswith("_"))}
    if _as_function and (inspect.isfunction(obj) or inspect.isbuiltin(obj)):
        return functools.partial(obj, **{k: cfg[k] for k in given}) if given else obj
    params = _parameters(obj)
    # No inspectable signature (some builtins): let the call decide.
    passed = {} if params is None else _arguments(key, target, cfg, params, given, runtime)
    try:
        # Runtime objects (parameters, an optimizer) go to the call itself, not through
        # OmegaConf; the config's own values arrive as plain dicts and lists.
        return instantiate(cfg, _partial_=True, _convert_="all")(**passed)
    except UserError:
        raise
    except (InstantiationException, ValueError, TypeError, AssertionError, ImportError) as e:
        cause = e.__cause__ if isinstance(e, InstantiationException) and e.__cause__ else e
        if isinstance(cause, UserError):
            raise cause from None
        if isinstance(cause, ModuleNotFoundError) and cause.name:
            raise needs_package(f"{key} ({target})", cause.name) from None
        if not isinstance(cause, (ValueError, TypeError, AssertionError)):
            raise
        _text_for_a_number(key, target, cfg, obj)
        message = _name_keys(
            str(cause).splitlines()[0] if str(cause) else type(cause).__name__,
            key,
            given | set(passed),
        )
        if f"{key}." not in message:
            # A library's own message ("Invalid learning rate: -1") names no argument: name the
            # one whose value it quotes, when exactly one does.
            quoted = [
                k
                for k in sorted(given)
                if not isinstance(cfg[k], (bool, dict, list))
                and re.search(rf"(?<![\w.-]){re.escape(str(cfg[k]))}(?![\w.])", message)
            ]
            if len(quoted) == 1:
                message = f"{key}.{quoted[0]}={cfg[quoted[0]]!r}: {message}"
        raise UserError(f"{key} ({target}): {message}") from cause


def _arguments(
    key: str,
    target: str,
    cfg: Mapping[str, Any],
    params: list[inspect.Parameter],
    given: set[str],
    runtime: dict[str, Any],
) -> dict[str, Any]:
    """The `runtime` keywords `target`'s signature asks for, after checking the config's
    arguments against it (an unknown one, a missing one)."""
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params)
    accepted = ", ".join(names) or "no arguments"
    unknown = sorted(given - set(names)) if not takes_any else []
    if unknown:
        raise UserError(
            f"{key}.{unknown[0]} is not an argument of {target}: it accepts {accepted}"
            + _merged_hint(key, unknown, names)
        )
    for p in params:
        if p.name in given:
            _check_kind(key, target, p, cfg[p.name])
    passed = {k: v for k, v in runtime.items() if k in names and k not in given}
    missing = [
        p.name
        for p in params
        if p.default is p.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in given
        and p.name not in passed
    ]
    if missing:
        offered = ", ".join(sorted(runtime)) or "nothing"
        group = key.split(".")[0]
        other = "a model that fits this data" if group == "model" else f"another {group} choice"
        raise UserError(
            f"{key} ({target}) needs {', '.join(missing)}, which neither the "
            f"config nor the template provides here (it provides {offered}): "
            f"set {key}.{missing[0]}=..., or pick {other}"
        )
    return passed


def _merged_hint(key: str, unknown: list[str], names: list[str]) -> str:
    """When the unknown arguments look like no misspelling of an accepted one, they most likely
    come from the YAML of the choice whose `_target_` was replaced: Hydra merges the new
    `_target_` into the old choice's arguments."""
    if "." in key or any(difflib.get_close_matches(u, names, n=1, cutoff=0.75) for u in unknown):
        return ""
    return (
        f"; if {', '.join(unknown)} came from the {key} YAML whose _target_ you replaced (its "
        f"arguments were merged in), start clean: `override /{key}: null` in your experiment's "
        f"defaults, or a conf/{key}/<name>.yaml of its own chosen with {key}=<name>, or drop "
        f"each on the command line: ~{key}.{unknown[0]}"
    )


# What a value given for an argument annotated with one of these must be (bool is an int).
_KINDS = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}


def _check_kind(key: str, target: str, p: inspect.Parameter, value: Any) -> None:
    """A value of another kind than the argument's annotation says (`rotate=no`, `width=abc`:
    Hydra reads both as text) refused before the call, where `bool("no")` is True and a text
    width fails deep in torch without the key."""
    hint = p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", "")
    hint = hint.removesuffix(" | None").removeprefix("Optional[").removesuffix("]")
    kinds = _KINDS.get(hint)
    if value is None or kinds is None or (isinstance(value, str) and "${" in value):
        return
    if not isinstance(value, kinds) or (isinstance(value, bool) and hint != "bool"):
        example = "true or false" if hint == "bool" else f"a {hint}"
        raise UserError(
            f"{key}.{p.name}={value!r} is not allowed: {target} takes {p.name}: {hint} "
            f"(give {example})"
        )


def _text_for_a_number(key: str, target: str, cfg: Mapping[str, Any], obj: Any) -> None:
    """After the call failed: a text given for an argument whose default is a number
    (`optim.lr=abc`), which the library's own error names neither by key nor by value. Only
    then: a component may take a text there on purpose."""
    for p in _parameters(obj) or []:
        value = cfg.get(p.name)
        number = isinstance(p.default, (int, float)) and not isinstance(p.default, bool)
        if number and isinstance(value, str) and "${" not in value:
            raise UserError(
                f"{key}.{p.name}={value!r} is not a number: give a number ({target}'s "
                f"default is {p.default!r})"
            )


def _parameters(obj: Any) -> list[inspect.Parameter] | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return list(sig.parameters.values())


def _name_keys(message: str, key: str, names: set[str]) -> str:
    """'hidden=0 is not allowed' -> 'model.hidden=0 is not allowed': a component's own check
    names its argument; the user needs the config key."""
    for name in sorted(names, key=len, reverse=True):
        message = re.sub(
            rf"(?<![\w.]){re.escape(name)}(?=\s*[=+<>]|\s+must)", f"{key}.{name}", message
        )
    return message
