"""The training loop and what runs inside it: `prepare` builds a rank's job, `wrapping` wraps
the model (DDP/FSDP2, the EMA, torch.compile), `checkpointing` declares the checkpoint members
and resumes, `fit` is the loop and the end of the run, `position` is where it is; `scoring`
runs a split through the model (its scores, or its predictions), `evaluation` validates.

What a user edits is outside this package: the step (`hydra_ddp.step`), callbacks, how a batch
reaches the model (`hydra_ddp.batches`) and components (`conf/`).
"""

# Names a pruning Optuna sweep shares with its jobs (`evaluation.Pruning`); here, where the
# sweeper can read them in a sweep's launching process, which runs no job and never imports torch.
# Study attribute: the pruner's config (`_target_` and arguments), set by the sweeper, so each
# job builds the same pruner (Optuna keeps the pruner out of the storage).
PRUNER_ATTR = "pruner"
# Trial attribute, set by the job that was pruned: the step it stopped at.
PRUNED_ATTR = "pruned_at_step"
