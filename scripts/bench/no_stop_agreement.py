"""`python -m hydra_ddp.train` with the ranks' stop agreement changed: the benchmark's controls.

    torchrun --standalone --nproc_per_node=2 scripts/bench/no_stop_agreement.py logger=none
    BENCH_STOP_AGREEMENT=every_step torchrun ... scripts/bench/no_stop_agreement.py ...

The same job, except that (default, `off`) `StopOnSignal.agreed` answers from this rank's own
flag and never all-reduces it (a stop signal then stops only the rank that got it: for
benchmarks only), or (`every_step`) the ranks agree at every step instead of about every
0.1 s of steps, so bench_speed.py --stop-cost brackets the agreement's cost.
"""

import os

from hydra_ddp import train
from hydra_ddp.distributed import preemption


def _local_only(self: preemption.StopOnSignal) -> int:
    return self.received


MODE = os.environ.get("BENCH_STOP_AGREEMENT", "off")
if MODE == "off":
    preemption.StopOnSignal.agreed = _local_only
elif MODE == "every_step":
    preemption._CHECK_EVERY_S = 0.0  # rank 0 then proposes the next check after 1 step
else:
    raise SystemExit(f"BENCH_STOP_AGREEMENT={MODE!r}: give off or every_step")

if __name__ == "__main__":
    train.main()
