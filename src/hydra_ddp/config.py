"""The typed schema of the template's own keys, and the one place their defaults live.

The groups the template owns (trainer, dist, ddp, logger) are dataclasses: a YAML of
`conf/ddp/` or `conf/logger/` (typed in ddp_config.py and logger_config.py) holds only what its
choice changes, and a typo'd key or a wrong type fails when Hydra composes the config. The
checks in `__post_init__` run at `OmegaConf.to_object`, before any process group exists.
Choices are `Enum`s: hydra-core 1.3 pins omegaconf below 2.4, which rejects `typing.Literal`.
What a user swaps in is `_target_` plus keyword arguments, built by `hydra_ddp.components`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

# The ddp/ and logger/ groups, importable from here too.
from hydra_ddp.ddp_config import COMM_HOOKS, DDPConfig, DType, Wrapper  # noqa: F401
from hydra_ddp.errors import UserError, check_setting
from hydra_ddp.logger_config import Layout, LoggerConfig, WandbConsole, WandbMode  # noqa: F401

# --------------------------------------------------------------------------------------------
# trainer: the loop; dist: the process group
# --------------------------------------------------------------------------------------------


# trainer.precision: the type the forward pass is autocast to (fp32: none); bf16 needs no loss
# scaling, fp16 takes a GradScaler (CUDA only).
Precision = DType


class MonitorMode(Enum):
    min = "min"  # lower is better (losses)
    max = "max"  # higher is better (accuracy, R²)


class NanPolicy(Enum):
    stop = "stop"  # stop the run with an error naming the step and the rank
    skip = "skip"  # drop that step's update on every rank and carry on


@dataclass
class TrainerConfig:
    # Optimizer steps to run; -1: run `epochs` full epochs instead.
    max_steps: int = -1
    # Passes over the training set (used when max_steps is -1).
    epochs: int = 40
    # Samples per rank per micro-step; the global batch is batch_size * world_size * grad_accum.
    batch_size: int = 64
    # Micro-steps per optimizer step; gradients are only all-reduced on the last one.
    grad_accum: int = 1
    # Clip the global gradient norm to this value; 0 disables clipping. Or a threshold per
    # optimizer by name (several optimizers, optim=gan): {generator: 1.0, discriminator: 0.5};
    # an optimizer the map leaves out is not clipped; one optimizer is named `default`.
    grad_clip: Any = 1.0
    precision: Precision = Precision.fp32
    # Seeds model init, dropout and (unless sampler.seed is set) the shuffle.
    seed: int = 0
    # Optimizer steps between per-rank stats (console, JSON lines, W&B).
    log_interval: int = 10
    # Optimizer steps between evaluations on the validation set; 0: at the end only.
    eval_interval: int = 0
    # Optimizer steps between checkpoints; 0: at the end only.
    ckpt_interval: int = 0
    # Checkpoints kept in <output dir>/checkpoints (oldest deleted first).
    keep_ckpts: int = 2
    # auto: continue from the newest checkpoint in the output dir if there is one;
    # never: always start fresh; or a path to a checkpoint file.
    resume: str = "auto"
    # Fine-tuning: start from these weights (a checkpoint or run dir, a state dict,
    # .safetensors, a save_pretrained or export folder: docs/weights.md), with a fresh
    # optimizer, schedule and position; a checkpoint of the job's own (resume=auto) wins.
    init_from: Optional[str] = None
    # false: load only the tensors whose names and shapes match (a new head), naming the rest.
    init_strict: bool = True
    # init_from's tensor names renamed, a prefix each: {transformer.:""} (docs/weights.md).
    # Any, not Dict[str, str]: omegaconf 2.3 cannot override an empty typed dict.
    init_map: Any = None
    # What a NaN/inf loss does.
    nan_policy: NanPolicy = NanPolicy.stop
    # DataLoader worker processes per rank (0: load in the training process).
    num_workers: int = 0
    # Show a progress bar on rank 0.
    progress: bool = True
    # The validation metric that judges a run: `val/<loss or a metrics.* name>`. It is the
    # objective a sweep optimises and what the best checkpoint is chosen by.
    monitor: str = "val/loss"
    monitor_mode: MonitorMode = MonitorMode.min
    # Stop after this many evaluations in a row without an improvement of trainer.monitor
    # (0: never). Evaluations come every trainer.eval_interval steps.
    early_stop_patience: int = 0
    # Evaluate, and checkpoint, an exponential moving average of the weights with this decay
    # per step (e.g. 0.999); 0: off.
    ema_decay: float = 0.0
    # torch.compile the DDP-wrapped model (loop/wrapping.py says why in that order).
    compile: bool = False
    # ddp=fsdp2: write the periodic checkpoints in the background (torch.distributed.checkpoint's
    # async_save) while training goes on; each is completed before the next save.
    async_ckpt: bool = False
    # torch.use_deterministic_algorithms, cuBLAS's deterministic workspace, no cuDNN autotuning.
    deterministic: bool = False
    # run.json lists the checkout's untracked, not ignored files (path, size) and counts them
    # as dirty; true: their contents (up to 1 MiB each) also go into its git_diff_<n>.patch.
    untracked_content: bool = False
    # Debugging (conf/debug/); 0 or false is off.
    limit_train_batches: int = 0  # batches per epoch and rank, at most
    limit_eval_batches: int = 0  # validation and test batches per rank, at most
    overfit_batches: int = 0  # train on only the first N batches of each rank, repeated
    detect_anomaly: bool = False  # torch.autograd anomaly mode: names the op that made a NaN
    profile_steps: int = 0  # torch.profiler over this many steps on every rank...
    profile_start: int = 5  # ...after this many

    def __post_init__(self) -> None:
        off = ">= 0 (0: off)"
        at_end = ">= 0 (steps; 0: at the end)"
        # (key, whether its value is allowed, what it must be)
        rules = [
            (
                "max_steps",
                self.max_steps == -1 or self.max_steps > 0,
                "> 0, or -1 to run trainer.epochs",
            ),
            ("epochs", self.epochs > 0, "> 0"),
            # Every seeded generator here takes it (NumPy's wants >= 0), with room for `+ rank`.
            ("seed", 0 <= self.seed < 2**31, "in [0, 2**31)"),
            ("batch_size", self.batch_size > 0, "> 0 (samples per rank)"),
            ("grad_accum", self.grad_accum > 0, "> 0"),
            (
                "init_map",
                self.init_map is None
                or isinstance(self.init_map, dict)
                and all(
                    isinstance(k, str) and isinstance(v, str) for k, v in self.init_map.items()
                ),
                "a mapping of name prefixes, e.g. {transformer.:''}",
            ),
            ("log_interval", self.log_interval > 0, "> 0 (steps)"),
            ("eval_interval", self.eval_interval >= 0, at_end),
            ("ckpt_interval", self.ckpt_interval >= 0, at_end),
            ("keep_ckpts", self.keep_ckpts >= 1, ">= 1"),
            ("num_workers", self.num_workers >= 0, ">= 0"),
            ("resume", bool(self.resume), "auto, never or a checkpoint path"),
            ("early_stop_patience", self.early_stop_patience >= 0, off),
            ("limit_train_batches", self.limit_train_batches >= 0, off),
            ("limit_eval_batches", self.limit_eval_batches >= 0, off),
            ("overfit_batches", self.overfit_batches >= 0, off),
            ("profile_steps", self.profile_steps >= 0, off),
            ("profile_start", self.profile_start >= 0, off),
            ("ema_decay", 0 <= self.ema_decay < 1, "in [0, 1) (0: off)"),
            (
                "early_stop_patience",
                self.early_stop_patience == 0 or self.eval_interval > 0,
                "0 unless trainer.eval_interval > 0 (early stopping needs evaluations)",
            ),
            (
                "monitor",
                self.monitor.startswith("val/") and len(self.monitor) > 4,
                "val/loss or val/<a metrics.* name>, e.g. val/acc",
            ),
        ]
        # grad_clip: a number >= 0, or a map of optimizer name -> number >= 0.
        clips = (
            self.grad_clip.items() if isinstance(self.grad_clip, dict) else [(None, self.grad_clip)]
        )
        for name, clip in clips:
            key = "trainer.grad_clip" if name is None else f"trainer.grad_clip.{name}"
            number = isinstance(clip, (int, float)) and not isinstance(clip, bool)
            allowed = ">= 0 (0 disables), or a map by optimizer name ({generator: 1.0, ...})"
            check_setting(number and clip >= 0, key, allowed if name is None else ">= 0", clip)
        for key, ok, allowed in rules:
            check_setting(ok, f"trainer.{key}", allowed, getattr(self, key))


class Backend(Enum):
    auto = "auto"  # nccl on CUDA, gloo on CPU
    nccl = "nccl"
    gloo = "gloo"


class Device(Enum):
    auto = "auto"  # cuda:LOCAL_RANK when CUDA is available, else cpu
    cpu = "cpu"
    cuda = "cuda"


@dataclass
class DistConfig:
    backend: Backend = Backend.auto
    device: Device = Device.auto
    # Seconds a collective (and the process-group start) may wait for a peer before failing.
    timeout_s: float = 300.0
    # Workers this command starts itself on this machine (torch's elastic agent). Ignored when
    # the command already runs under a launcher (torchrun, SLURM/submitit).
    nproc_per_node: int = 1
    # Self-launch only: restarts of the whole worker group after a worker fails.
    max_restarts: int = 0

    def __post_init__(self) -> None:
        check_setting(self.timeout_s > 0, "dist.timeout_s", "> 0 (seconds)", self.timeout_s)
        check_setting(self.nproc_per_node >= 1, "dist.nproc_per_node", ">= 1", self.nproc_per_node)
        check_setting(self.max_restarts >= 0, "dist.max_restarts", ">= 0", self.max_restarts)


@dataclass
class TrainConfig:
    ddp: DDPConfig = field(default_factory=DDPConfig)
    # The sampler policy, a component (conf/sampler/, hydra_ddp/data/policies.py).
    sampler: Any = MISSING
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    # Components: `_target_` + keyword arguments, chosen in conf/<group>/ (see components.py).
    data: Any = MISSING
    model: Any = MISSING
    optim: Any = MISSING
    scheduler: Any = MISSING
    loss: Any = MISSING
    # name -> metric component; each is reported as val/<name> and test/<name>.
    metrics: Dict[str, Any] = field(default_factory=dict)
    # Your own step instead of the default one (step.default_step):
    # `_target_: my_steps.gan_step`, called as (tools, model, micro_batches, objective,
    # optimizers) -> {"loss": ..., other scalars}; see step.StepTools. null: the model's
    # `training_step` method if it has one, else the default step.
    step: Optional[Any] = None
    # name -> callback component (hydra_ddp/callbacks.py): `+callbacks.NAME._target_=pkg.Class`.
    callbacks: Dict[str, Any] = field(default_factory=dict)
    # Your own variables, free of any schema: `vars.reads_dir=/data` on the command line (or
    # `vars: {reads_dir: ...}` in an experiment YAML), read as ${vars.reads_dir} in the config
    # and cfg.vars["reads_dir"] in code. Keys may be added without `+` (see register_configs).
    vars: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.trainer.grad_clip, dict):
            # The names of the job's optimizers: `default` for one, the keys of `optim` else.
            several = hasattr(self.optim, "keys") and "_target_" not in self.optim
            names = [str(k) for k in self.optim.keys()] if several else ["default"]
            unknown = sorted(set(map(str, self.trainer.grad_clip)) - set(names))
            if unknown:
                raise UserError(
                    f"trainer.grad_clip.{unknown[0]}: this job has no optimizer named "
                    f"{unknown[0]!r}; its optimizers are {', '.join(names)} (one optimizer is "
                    "named default), or give trainer.grad_clip as one number for all"
                )
        if self.trainer.async_ckpt and self.ddp.wrapper != Wrapper.fsdp2:
            raise UserError(
                "trainer.async_ckpt=true needs ddp=fsdp2 (its sharded checkpoints are written "
                "by every rank; DDP's single file is written by rank 0): add ddp=fsdp2, or drop "
                "trainer.async_ckpt"
            )
        if self.trainer.precision == Precision.fp16 and self.dist.device == Device.cpu:
            raise UserError(
                "trainer.precision=fp16 needs CUDA (dist.device=cpu was set): "
                "use trainer.precision=bf16 or fp32"
            )

    @property
    def sampler_seed(self) -> int:
        seed = self.sampler.get("seed") if hasattr(self.sampler, "get") else None
        return self.trainer.seed if seed is None else int(seed)


def register_configs() -> None:
    """Put the schema into Hydra's ConfigStore; conf/train.yaml extends it."""
    node = OmegaConf.structured(TrainConfig)
    # `vars` is open: `vars.x=1` adds a key as `+vars.x=1` would (every other mapping of the
    # config is closed, so a typo'd key fails when the config is composed).
    OmegaConf.set_struct(node.vars, False)
    ConfigStore.instance().store(name="train_schema", node=node)
