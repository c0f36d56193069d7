"""A package's re-exported names, each loaded from its module on first use (PEP 562).

`hydra_ddp.distributed` and `hydra_ddp.tracking` re-export what a user calls
(`hydra_ddp.distributed.DistEnv`). Loading them at the package's import would import torch in
every process that touches the package, and a sweep's launching process (`-m` with Ray or
submitit) reads only a launcher variable and a redaction rule there: it runs no job, so it
should not pay torch's import (2-4 s; longer from a cluster's shared file system).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_names(package: str, homes: dict[str, list[str]]) -> Callable[[str], Any]:
    """The package's `__getattr__`: `homes` maps each submodule to the names it re-exports."""
    home_of = {name: module for module, names in homes.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in home_of:
            # Also how `from package import submodule` falls back to importing the submodule.
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{home_of[name]}"), name)

    return __getattr__
