"""One rule for what counts as a secret (docs/tracking.md, "Secrets stay on your disk"), applied
wherever a config or a command line leaves the job's own `.hydra/` record; `.hydra/config.yaml`
stays complete: evaluation and resume rebuild the job from it.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Iterable, Mapping

REDACTED = "<redacted>"
_SECRET = re.compile(
    r"token|secret|passw(?:or)?d|api_?key|access_?key|credential|private_?key", re.IGNORECASE
)
_NOT_SECRET = re.compile(
    r"^(?:pad|bos|eos|unk|sep|cls|mask)_token$|_token_ids?$|^(?:max|num|n)_tokens$"
    r"|^tokens?_per_|^tokenizer",
    re.IGNORECASE,
)


# `key=value` in free text: a dotted config key (with Hydra's +/~ prefixes), then the value up
# to the next blank.
_PAIR = re.compile(r"(?<![\w.])([+~]{0,2}[A-Za-z_][\w.@/-]*)=(\S+)")
# A secret's value may hold blanks (Hydra writes `PW\ WITH\ SPACE`, or the bare `PW WITH SPACE`
# in its launcher's line): it runs to the next `key=` pair, or the end of the line.
_SECRET_VALUE = re.compile(r"\S.*?(?=\s+[+~]{0,2}[A-Za-z_][\w.@/-]*=|\s*$)", re.MULTILINE)
# `'key': value` in a printed dict (the Optuna sweeper's `Best parameters: {...}`): the value
# quoted (escapes included) or up to the next `,`, `}` or blank.
_ITEM = re.compile(
    r"""(['"])([+~]{0,2}[A-Za-z_][\w.@/-]*)\1(\s*:\s*)"""
    r"""('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^,}\]\s]+)"""
)


def is_secret(key: str) -> bool:
    """Whether a config key (dotted or not) names a secret."""
    last = key.lstrip("+~").rsplit(".", 1)[-1]
    return bool(_SECRET.search(last)) and not _NOT_SECRET.search(last)


def config(value: Any) -> Any:
    """A copy of a config with secret entries blanked (and the live API key wherever it is)."""
    if isinstance(value, Mapping):
        return {
            k: REDACTED if isinstance(k, str) and is_secret(k) and v else config(v)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [config(v) for v in value]
    return text(value) if isinstance(value, str) else value


def overrides(items: Iterable[str]) -> list[str]:
    """Command-line arguments with the values of secret `key=value` pairs blanked."""
    out = []
    for item in items:
        key, eq, _ = str(item).partition("=")
        out.append(f"{key}={REDACTED}" if eq and is_secret(key) else text(str(item)))
    return out


def text(value: str) -> str:
    """`value` with the live W&B API key blanked."""
    live_key = os.environ.get("WANDB_API_KEY")
    return value.replace(live_key, REDACTED) if live_key else value


def pairs(message: str) -> str:
    """`message` with the value of each secret `key=value` pair, and of each secret
    `'key': value` item of a printed dict, blanked."""
    out, end = [], 0
    for m in _PAIR.finditer(message):
        if m.start() < end or not is_secret(m[1]):
            continue
        value = _SECRET_VALUE.match(message, m.start(2))
        out += [message[end : m.start(2)], REDACTED]
        end = value.end() if value else m.end()
    message = "".join(out) + message[end:]
    return _ITEM.sub(
        lambda m: f"{m[1]}{m[2]}{m[1]}{m[3]}'{REDACTED}'" if is_secret(m[2]) else m[0], message
    )


class LogFilter(logging.Filter):
    """Blanks secrets in every record a handler of conf/train.yaml's logging writes: Hydra's
    launcher logs each sweep job's overrides, `#0 : +db.password=...`, before any code of ours
    runs."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: logging reports it itself
            return True
        blanked = pairs(text(message))
        if blanked != message:
            record.msg, record.args = blanked, None
        return True
