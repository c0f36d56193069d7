"""Checkpoints: everything a resumed run needs to continue exactly where it stopped.

`state`: what a checkpoint holds (the members a job declares); `checkpointer`: a DDP run's
single files, written by rank 0; `dcp`: ddp=fsdp2's sharded folders, written by every rank;
`reader`: which checkpoint a setting names, whether it is whole, what it holds, every refusal
one line; `init_from`: trainer.init_from's weights of any format loaded into a model.
"""

from hydra_ddp.checkpoint.checkpointer import Checkpointer, save
from hydra_ddp.checkpoint.reader import (
    best,
    checkpoint_dir,
    latest,
    load,
    model_weights,
    read_picked,
    resolve_resume,
    why_not_whole,
)

__all__ = [
    "Checkpointer",
    "best",
    "checkpoint_dir",
    "latest",
    "load",
    "model_weights",
    "read_picked",
    "resolve_resume",
    "save",
    "why_not_whole",
]
