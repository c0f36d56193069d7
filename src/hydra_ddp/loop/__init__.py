"""The training loop and what runs inside it: `prepare` builds a rank's job, `wrapping` wraps
the model (DDP/FSDP2, the EMA, torch.compile), `checkpointing` declares the checkpoint members
and resumes, `fit` is the loop and the end of the run, `position` is where it is; `scoring`
runs a split through the model (its scores, or its predictions), `evaluation` validates.

What a user edits is outside this package: the step (`hydra_ddp.step`), callbacks, how a batch
reaches the model (`hydra_ddp.batches`) and components (`conf/`).
"""
