"""Checkpoints: everything a resumed run needs to continue exactly where it stopped.

- `state`: what a checkpoint holds, the members a job declares when it is built
  (`state.members`): the template's (`DEFAULT_MEMBERS`: the model, the optimizers and their
  schedules, the grad scaler, the EMA, the monitor, the callbacks, the data position with its
  resume arithmetic, every rank's RNG and comm-hook state) and the user's, which a callback's
  `checkpoint_members()` returns.
- `checkpointer`: single-file checkpoints of a DDP run (rank 0 writes step_<step>.pt);
  `dcp`: ddp=fsdp2's sharded folders (every rank writes its shards); both are handed the
  job's members.
- `files`: atomic writes, keep-K, the newest intact one, damage checks, set-aside;
  `reading`: which checkpoint a key names, read safely (`torch.load(weights_only=True)`);
  `weights`: what trainer.init_from may name (any format), `init_from`: loading it;
  `safe_state`: state made plain at save so that reading it runs no code; `dcp_files`: reading
  a sharded folder without a process group.
"""

from hydra_ddp.checkpoint.checkpointer import Checkpointer
from hydra_ddp.checkpoint.files import (
    best,
    checkpoint_dir,
    latest,
    save,
    set_aside_checkpoints,
    write_error,
)
from hydra_ddp.checkpoint.init_from import init_weights
from hydra_ddp.checkpoint.reading import load, resolve_resume

__all__ = [
    "Checkpointer",
    "best",
    "checkpoint_dir",
    "init_weights",
    "latest",
    "load",
    "resolve_resume",
    "save",
    "set_aside_checkpoints",
    "write_error",
]
