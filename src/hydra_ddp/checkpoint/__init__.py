"""Checkpoints: everything a resumed run needs to continue exactly where it stopped.

- `state`: what a checkpoint holds, the members a job declares when it is built
  (`state.members`): the template's (`DEFAULT_MEMBERS`: the model, the optimizers and their
  schedules, the grad scaler, the EMA, the monitor, the callbacks, the data position with its
  resume arithmetic, every rank's RNG and comm-hook state) and the user's, which a callback's
  `checkpoint_members()` returns.
- `checkpointer`: writing. A DDP run's single files (rank 0 writes step_<step>.pt, atomically,
  the newest K kept, best.pt), and what any checkpoint may hold (state made plain, so that
  reading it runs no code); `dcp`: ddp=fsdp2's sharded folders (every rank writes its shards).
  Both are handed the job's members.
- `folder`: a run's checkpoints/: which one it resumes from, its best, set aside on a new start.
- `reader`: reading. Which checkpoint a setting names, whether it is whole, what it holds (any
  format: a step file, a sharded folder, a run dir, an export folder; for trainer.init_from
  also safetensors and Hugging Face folders), every refusal one line.
- `init_from`: trainer.init_from's weights loaded into a model, whole or sharded.
"""

from hydra_ddp.checkpoint.checkpointer import Checkpointer, save
from hydra_ddp.checkpoint.folder import (
    best,
    check_folder,
    pick,
    read_picked,
    resolve_resume,
    set_aside_checkpoints,
)
from hydra_ddp.checkpoint.init_from import init_weights
from hydra_ddp.checkpoint.reader import (
    checkpoint_dir,
    latest,
    load,
    open_weights,
    why_not_whole,
)

__all__ = [
    "Checkpointer",
    "best",
    "check_folder",
    "checkpoint_dir",
    "why_not_whole",
    "init_weights",
    "latest",
    "load",
    "open_weights",
    "pick",
    "read_picked",
    "resolve_resume",
    "set_aside_checkpoints",
    "save",
]
