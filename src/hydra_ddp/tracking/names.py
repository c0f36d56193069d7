"""Every name a stats row, an aggregate or a sink key is made of, defined once: the loop writes
them, the aggregates derive from them, the console reads them back and `ctx.log` may not reuse
them, so two places cannot drift.
"""

from __future__ import annotations

# The fields every row of a stats file starts with (the files sink writes them).
STEP = "step"
TIME = "time"
RANK = "rank"
RUN = "run"  # the W&B run id a row went to (W&B's resume accounting reads it back)
ROW_FIELDS = (STEP, TIME, RANK, RUN)

# Training stats, one value per rank and log interval.
LOSS = "loss"
LOSS_TERM_PREFIX = "loss_"  # loss_<term>: the objective's extra named terms
STEP_TIME = "step_time"  # seconds per optimizer step
DATA_WAIT = "data_wait"  # seconds per step spent waiting for the next batch
GRAD_NORM = "grad_norm"
LR = "lr"  # the one learning rate (one optimizer with one group)
LR_PREFIX = "lr/"  # lr/<optimizer>/<group>: one per group when there are several
THROUGHPUT_SUFFIX = "_per_s"
SAMPLES_PER_S = "samples_per_s"
TOKENS_PER_S = "tokens_per_s"
# Memory (stats.memory_stats) and data (the loop's position and the rows each rank holds).
MEMORY = ("rss_mb", "peak_rss_mb", "cuda_mem_mb", "cuda_peak_mem_mb")
DATA = ("samples_seen", "data_rows", "data_bytes", "epoch")
STATS = (LOSS, STEP_TIME, DATA_WAIT, GRAD_NORM, LR, SAMPLES_PER_S, TOKENS_PER_S, *MEMORY, *DATA)

# Cross-rank aggregates (rank 0's stats/aggregate.jsonl, W&B's agg/*, TensorBoard's agg/*).
SPREAD = (STEP_TIME, DATA_WAIT)  # as <stat>_min/_mean/_max and the slowest rank
SLOWEST_RANK = "slowest_rank"  # the rank with the longest step_time
LOSS_MEAN = "loss_mean"
TOTAL_SUFFIX = "_total"  # <unit>_per_s_total: the job's throughput, all ranks together

# The x axis every W&B key is plotted against (W&B's own _step counts log calls, not steps).
STEP_METRIC = "trainer/step"


def throughput(unit: str) -> str:
    """The stat of items per second for a data unit: `samples` or `tokens`."""
    return f"{unit}{THROUGHPUT_SUFFIX}"


def spread(stat: str, kind: str) -> str:
    """`step_time_max`, `data_wait_min`, ...: one of a stat's cross-rank aggregates."""
    return f"{stat}_{kind}"


def slowest(stat: str) -> str:
    """The aggregate naming the rank with the highest `stat`."""
    return SLOWEST_RANK if stat == STEP_TIME else f"{stat}_{SLOWEST_RANK}"


def is_reserved(name: str, logged: frozenset[str] | set[str] = frozenset()) -> bool:
    """Whether `ctx.log` may not use `name`: a row field, a stat the template logs, a
    learning rate, or a stat this job has already logged (`logged`: a loss term, ...)."""
    return name in ROW_FIELDS or name in STATS or name.startswith(LR_PREFIX) or name in logged
