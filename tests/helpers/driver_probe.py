"""A Hydra callback for a sweep's launching process (tests/test_ray_sweeps.py): at the sweep's
end it writes which torch modules that process imported. It runs no job, so there should be
none: importing torch there would only delay every sweep's first job."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback


class DriverModules(Callback):
    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        torch_modules = sorted(m for m in sys.modules if m.split(".")[0] == "torch")
        out = Path(config.hydra.sweep.dir) / "driver_modules.json"
        out.write_text(json.dumps({"torch": torch_modules}))
