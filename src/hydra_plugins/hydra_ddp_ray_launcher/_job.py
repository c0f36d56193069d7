"""A job of a Ray sweep in its own process: run it as Hydra's launchers do, write what it
returned. Started by its task (_task.py) as `python -m` of this module, or forked from a warm
parent (_warm.py) that imported all this once."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path


def main(spec_path: str, result_path: str) -> int:
    """The job's process: run the job as Hydra's launchers do, write what it returned."""
    import cloudpickle
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.singleton import Singleton
    from hydra.core.utils import run_job as hydra_run_job
    from hydra.core.utils import setup_globals

    # The template's resolvers (job dir names, log files) and config schema, registered at its
    # import: the job's config names them.
    import hydra_ddp.launch.command  # noqa: F401
    from hydra_ddp.rundir import claim

    # Ray starts its workers with SIGINT blocked, and a blocked mask is inherited: a job's
    # ranks must see Ctrl-C like any job's (preemption.py).
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _stop_with_parent()
    spec = cloudpickle.loads(Path(spec_path).read_bytes())
    setup_globals()
    Singleton.set_state(spec["singleton_state"])
    HydraConfig.instance().set_config(spec["config"])
    try:
        returned = hydra_run_job(
            hydra_context=spec["hydra_context"],
            task_function=spec["task_function"],
            config=spec["config"],
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )
    finally:
        claim.release_all()
    Path(result_path).write_bytes(cloudpickle.dumps(returned))
    return 0


def _stop_with_parent() -> None:
    """SIGTERM to this job when the Ray worker that started it dies (Ray stopped, the node
    lost): the job saves a checkpoint and stops instead of training on unsupervised."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="stop-with-parent").start()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
