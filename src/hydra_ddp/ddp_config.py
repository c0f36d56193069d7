"""The typed ddp/ group: DistributedDataParallel with its comm hook, or FSDP2's fully_shard, and
their options (config.py re-exports it). An option of the other wrapper is refused."""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, List, Optional

from hydra_ddp.errors import UserError, check_setting

# The comm hooks that ship with the template: a name ddp.comm_hook may give instead of a
# `_target_` -> its class in distributed/comm_hooks.py, which reads this table (none: no hook).
COMM_HOOKS = {"none": None, "fp16_compress": "FP16Compress", "bf16_compress": "BF16Compress",
              "powersgd": "PowerSGD"}  # fmt: skip


class Wrapper(Enum):
    """The data-parallel wrapper."""

    ddp = "ddp"  # DistributedDataParallel: every rank holds the whole model and its state
    # torch.distributed.fsdp.fully_shard: parameters, gradients and optimizer state sharded
    # over the ranks (about 1/N each), gathered unit by unit for the forward and backward.
    fsdp2 = "fsdp2"


class DType(Enum):
    """A float type: trainer.precision (config.Precision), ddp.param_dtype, ddp.reduce_dtype."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


@dataclass
class DDPConfig:
    """DistributedDataParallel constructor options, or (wrapper=fsdp2) fully_shard's.
    device_ids/output_device are not here: they follow from LOCAL_RANK on CUDA and stay unset
    on CPU."""

    wrapper: Wrapper = Wrapper.ddp
    # False: do not wrap the model at all (single-process debugging); see ddp=none.
    enabled: bool = True
    # Re-broadcast rank 0's buffers (e.g. BatchNorm stats) at every forward.
    broadcast_buffers: bool = True
    # BatchNorm as SyncBatchNorm: batch statistics over all ranks (GPU only; refused on CPU
    # with several processes). Either way every rank takes rank 0's running statistics before
    # each evaluation and save (distributed/ddp.py).
    sync_batchnorm: bool = False
    # Gradient bucket size in MiB: bigger buckets mean fewer, larger all-reduces.
    bucket_cap_mb: float = 25.0
    # Search the autograd graph each step for parameters that got no gradient. Needed when some
    # parameters are unused in a forward pass; costs a graph traversal per step.
    find_unused_parameters: bool = False
    # Let .grad tensors alias the communication buckets: saves one copy and the memory of it.
    gradient_as_bucket_view: bool = False
    # Promise the set of used parameters and the graph never change between steps, which lets
    # DDP skip per-step bookkeeping and allows reentrant checkpointing.
    static_graph: bool = False
    # Verify parameter shapes across ranks and broadcast rank 0's weights at construction.
    init_sync: bool = True
    # The DDP communication hook, a component: `{_target_: my_hooks.Mean, ...}` (a class whose
    # instances have `hook(state, bucket)` and `state`, or a function (state, bucket) ->
    # Future), or a built-in by name: none, fp16_compress, bf16_compress, powersgd
    # (hydra_ddp/distributed/comm_hooks.py; conf/ddp/<name>.yaml spell out their _target_).
    comm_hook: Any = "none"
    # PowerSGD: rank of the low-rank approximation (higher = more accurate, more bytes).
    powersgd_rank: int = 2
    # PowerSGD: plain all-reduce for this many steps before compression starts (>= 2: PowerSGD's
    # error feedback needs the first two steps uncompressed).
    powersgd_start_iter: int = 10

    # ---- wrapper=fsdp2 only (ddp=fsdp2; see hydra_ddp/distributed/fsdp.py) ----
    # The modules sharded as units of their own (gathered one at a time): module class names
    # (Block) or fnmatch patterns of module names (blocks.*). The root is always a unit (it
    # takes the rest). null: the model's `fsdp_units` attribute if it has one, else the root.
    shard_units: Optional[List[str]] = None
    # Free each unit's gathered parameters after its forward (gather them again for the
    # backward): less memory, one more all-gather per unit and step.
    reshard_after_forward: bool = True
    # Dtype the gathered parameters compute in (the sharded fp32 copy is what the optimizer
    # steps); bf16 halves the all-gather bytes and the activations.
    param_dtype: DType = DType.fp32
    # Dtype of the gradient reduce-scatter; fp32 keeps the averaged gradients exact.
    reduce_dtype: DType = DType.fp32
    # Keep the sharded parameters, gradients and optimizer state in CPU memory (CUDA only):
    # a bigger model for the same GPU memory, at the cost of host-device copies every step.
    cpu_offload: bool = False
    # Build the model on the meta device, shard it, then allocate and initialise only this
    # rank's shards (the model's `reset_parameters`, or `init_weights`): no rank ever holds the
    # whole model. Needs a model whose modules can re-initialise themselves.
    meta_init: bool = False

    def __post_init__(self) -> None:
        self._check_wrapper_options()
        hook = self.comm_hook
        built_in = isinstance(hook, str) and hook in COMM_HOOKS
        check_setting(
            built_in or (isinstance(hook, dict) and "_target_" in hook),
            "ddp.comm_hook",
            f"one of {', '.join(COMM_HOOKS)}, or a component ({{_target_: my_hooks.Hook, ...}})",
            hook,
        )
        check_setting(self.bucket_cap_mb > 0, "ddp.bucket_cap_mb", "> 0 (MiB)", self.bucket_cap_mb)
        check_setting(self.powersgd_rank >= 1, "ddp.powersgd_rank", ">= 1", self.powersgd_rank)
        check_setting(
            self.powersgd_start_iter >= 2,
            "ddp.powersgd_start_iter",
            ">= 2 (PowerSGD compresses from the third step at the earliest)",
            self.powersgd_start_iter,
        )

    def _check_wrapper_options(self) -> None:
        """An option of the other wrapper is refused rather than silently ignored."""
        fsdp2 = self.wrapper == Wrapper.fsdp2
        foreign = [
            f"ddp.{k}={_shown(getattr(self, k))}"
            for k in (_DDP_ONLY if fsdp2 else _FSDP2_ONLY)
            if getattr(self, k) != _DDP_DEFAULTS[k]
        ]
        if foreign and fsdp2:
            raise UserError(
                f"{', '.join(foreign)}: a DistributedDataParallel option, which ddp=fsdp2 "
                "(ddp.wrapper=fsdp2) does not use: drop it; fsdp2's options are "
                f"{', '.join('ddp.' + k for k in _FSDP2_ONLY)}"
            )
        if foreign:
            raise UserError(
                f"{', '.join(foreign)}: an option of ddp=fsdp2, which this job (ddp.wrapper="
                "ddp) does not use: add ddp=fsdp2, or drop it"
            )


def _shown(value: Any) -> Any:
    if isinstance(value, dict) and "_target_" in value:
        return value["_target_"]
    return value.value if isinstance(value, Enum) else value


# The DDPConfig fields that only fully_shard reads; all others but these two only DDP reads.
_FSDP2_ONLY = (
    "shard_units", "reshard_after_forward", "param_dtype", "reduce_dtype", "cpu_offload",
    "meta_init",
)  # fmt: skip
_DDP_DEFAULTS = {f.name: f.default for f in fields(DDPConfig)}
_DDP_ONLY = [k for k in _DDP_DEFAULTS if k not in (*_FSDP2_ONLY, "wrapper", "sync_batchnorm")]
