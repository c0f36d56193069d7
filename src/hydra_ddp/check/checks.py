"""One function per check, each reading what the runs recorded (or asking the sampler policy)
and returning a `Result`: PASS or FAIL with what it measured (a FAIL says in one line what is
wrong and where to look), or SKIP with the reason."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hydra_ddp import checkpoint
from hydra_ddp.batches import BatchLoss, to_device
from hydra_ddp.check import probe
from hydra_ddp.check.runs import CheckPlan, Run, stopped_at
from hydra_ddp.components import build
from hydra_ddp.config import COMM_HOOKS, Precision
from hydra_ddp.data import SPLITS
from hydra_ddp.data.policies import build_policy, rank_epoch, rows_in, train_file_rows
from hydra_ddp.step import StepTools, autocast_for, scaler_for


@dataclass
class Result:
    status: str  # PASS, FAIL or SKIP
    measured: str = "-"
    why: str = ""  # FAIL: what is wrong and where to look; SKIP: why it did not run


def skip(why: str) -> Result:
    return Result("SKIP", why=why)


def verdict(measured: str, problem: Any) -> Result:
    return Result("FAIL", measured, problem) if problem else Result("PASS", measured)


def broken(run: Run) -> Result:
    """A check whose run failed: the run's own error line (a training that fails is no pass)."""
    return Result("FAIL", "-", f"the {run.name} run failed: {run.failed()}")


def on_gpu(plan: CheckPlan) -> bool:
    device = plan.cfg.dist.device.value
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def tolerance(plan: CheckPlan) -> float:
    """Resume and round trip: bitwise on CPU. On a GPU, kernels that sum with atomics (cuBLAS
    split-K, scatter and index_add backward) add in another order each run unless
    trainer.deterministic: equal within 1e-4 relative then."""
    return 0.0 if not on_gpu(plan) or plan.cfg.trainer.deterministic else 1e-4


def rank_agreement(plan: CheckPlan, a: Run) -> Result:
    if plan.world == 1:
        return skip("one rank: nothing to agree on (dist.nproc_per_node=2)")
    path = a.rec / "agreement.json"
    if not path.is_file():
        return broken(a)
    apart = json.loads(path.read_text())
    differ = [name for name, value in apart.items() if not value == 0]  # NaN too
    worst = max(apart.values(), default=0.0)
    measured = f"max |diff| {worst:.3g} over {len(apart)} tensors, {plan.world} ranks"
    problem = (
        f"{_few(differ)} differ between ranks after {plan.steps} steps: something changes them "
        "by rank outside the averaged gradient (an in-place update in forward, a rank-dependent "
        "init or buffer); look where your model writes to them"
    )
    return verdict(measured, differ and problem)


def resume_equivalence(plan: CheckPlan, a: Run, b: Run, c: Run | None, other: Run | str) -> Result:
    """A (straight) against B (stopped at `k` by SIGTERM) then C (resumed in B's dir): every
    step's rows, loss and the model's plain attributes, and every entry of the last checkpoint."""
    k = stopped_at(b)
    if k is None:
        return broken(b) if b.failed() else skip("the stop came after the run's last step")
    if c is None or c.failed():
        return broken(c or b)
    if (first := min(c.records.get(0, {}), default=0)) != k + 1:
        return verdict(f"stopped at step {k}", f"the resumed run started at step {first}, not "
                       f"from the stop's checkpoint ({c.log})")  # fmt: skip
    tol = tolerance(plan)
    first_loss = rows_moved = attribute = None
    for rank, straight in a.records.items():
        joined = {**b.records.get(rank, {}), **c.records.get(rank, {})}
        for step, ref in straight.items():
            got = joined.get(step, {"rows": None, "attrs": {}, "loss": math.inf})
            if got["rows"] != ref["rows"] and not rows_moved:
                rows_moved = (
                    f"step {step} reads other rows on rank {rank} after the resume: the data "
                    "order does not continue (the sampler policy's sampler state, settings())"
                )
            changed = [key for key, v in ref["attrs"].items() if got["attrs"].get(key) != v]
            if step > k and changed and not attribute:
                was, now = ref["attrs"][changed[0]], got["attrs"].get(changed[0])
                attribute = (
                    f"model.{changed[0]} is {was!r} uninterrupted and {now!r} after resuming at "
                    f"step {k}: a plain attribute no checkpoint holds; make it a buffer "
                    "(register_buffer) or save it with checkpoint_members()"
                )
            if not probe.close(got["loss"], ref["loss"], tol):
                first_loss = min(first_loss or step, step)
    members = probe.differences(_final(a), _final(c), tol)
    mine = [m for m in members if ".callbacks." in f".{m}"]  # per-rank ones: rng[r].callbacks
    named = re.search(r"callbacks\.([^.]+)", mine[0])[1] if mine else ""
    callback = mine and (
        f"callbacks.{named} is not what it was after the "
        f"resume ({_few(mine)}): its load_state_dict does not restore what its state_dict returns"
    )
    rest = members and f"{_few(members)} differ: state the checkpoint does not hold or restore"
    loss = first_loss and f"the loss differs from step {first_loss}: state no checkpoint holds"
    note, other_problem = _other_world(plan, a, k, other)
    problem = attribute or callback or rows_moved or rest or loss or other_problem
    exact = "bitwise" if tol == 0 else f"within {tol:g} relative"
    losses = f"the loss differs from step {first_loss}" if first_loss else "losses equal"
    measured = f"{plan.steps} steps = {k} + SIGTERM + {plan.steps - k} resumed: " + (
        f"{losses}, {len(members)} checkpoint entries differ"
        if problem
        else f"{exact} (parameters, optimizer, rows, callbacks, RNG); {note}"
    )
    return verdict(measured, problem)


def _other_world(plan: CheckPlan, a: Run, k: int, other: Run | str) -> tuple[str, str | None]:
    """The resume on another rank count, same global batch: (what was seen, a problem)."""
    if isinstance(other, str):
        return f"another rank count: not checked, {other}", None
    world = len(other.records) or 1
    if other.failed():
        return "", f"resuming on {world} rank(s) failed: {other.failed()}"
    # An epoch's last batch may differ by the rows that pad it to a multiple of the ranks.
    padding, padded = max(plan.world, world) - 1, 0
    epochs = {step: r["epoch"] for step, r in a.records[0].items()}
    for step in range(k + 1, plan.steps + 1):
        ref, got = _global_rows(a, step), _global_rows(other, step)
        apart = sum(((ref - got) + (got - ref)).values())
        epoch_end = epochs.get(step + 1, -1) != epochs[step]
        if apart > (padding if epoch_end else 0):
            return "", f"resumed on {world} rank(s), step {step} reads {apart} other rows"
        padded += apart
    return f"on {world} rank(s) the same rows at every step ({padded} padding)", None


def _global_rows(run: Run, step: int) -> Counter:
    """The rows a step read on all the ranks together, by digest (a row read twice: 2)."""
    batches = [b for rank in run.records.values() for b in rank.get(step, {}).get("rows", [])]
    return Counter(digest for batch in batches for digest in batch)


def row_coverage(plan: CheckPlan, a: Run | None) -> Result:
    """Two epochs as the sampler policy hands each rank its batches (what the loader reads):
    every training row once per epoch, the same number of batches on every rank."""
    cfg, world, tcfg = plan.cfg, plan.world, plan.cfg.trainer
    if tcfg.overfit_batches or tcfg.limit_train_batches:
        return skip("trainer.overfit_batches or limit_train_batches reads part of each epoch")
    source, policy = build(cfg.data, "data"), build_policy(cfg.sampler, cfg.sampler_seed)
    n, files = source.num_rows("train"), train_file_rows(source)
    kind, drop = type(policy).__qualname__, bool(getattr(policy, "drop_last", False))
    for epoch in (0, 1):
        reads, batches = np.zeros(n, dtype=np.int64), []
        for rank in range(world):
            mine, sampler = rank_epoch(policy, n, files, world, rank, epoch, tcfg.batch_size)
            held = None if mine is None else rows_in(mine)
            sampler.load_state_dict({"epoch": epoch, "start_batch": 0})
            indices = [np.asarray(i) if held is None else held[np.asarray(i)] for i in sampler]
            batches.append(len(indices))
            reads += np.bincount(np.concatenate(indices or [[]]).astype(np.int64), minlength=n)
        if len(set(batches)) > 1:
            return verdict(f"batches per rank in epoch {epoch}: {batches}", (
                f"the ranks take different numbers of steps, so the job hangs at the epoch's "
                f"end: {kind}.sampler() must give every rank as many batches"))  # fmt: skip
        extra, never = int((reads - 1).clip(0).sum()), int((reads == 0).sum())
        most_never = world - 1 + (world * (tcfg.batch_size - 1) if drop else 0)
        if extra > (0 if drop else world - 1) or never > most_never:
            return verdict(f"epoch {epoch}: {extra} rows read again, {never} of {n} never", (
                f"the sampler policy {kind} (sampler._target_) does not split the rows between "
                f"the ranks: each row once per epoch, up to {world - 1} padding rows"))  # fmt: skip
    taken = {rank: len(steps) for rank, steps in (a.records if a else {}).items()}
    if len(set(taken.values())) > 1:
        return verdict(f"steps per rank: {taken}", f"the ranks took different steps ({a.log})")
    leaked, how = _held_out_trained(source)
    return verdict(
        f"{n} rows, each once per epoch ({extra} padding, {never} dropped), {batches[0]} batches "
        f"on every rank; {leaked} val/test rows trained on ({how})",
        leaked and f"{type(source).__qualname__} (data._target_) puts val/test rows in train",
    )


def determinism(plan: CheckPlan, a: Run, b: Run, strict: Run | None = None) -> Result:
    """The stopped run is a second run with the same seed: its steps before the stop."""
    k = stopped_at(b) or max(b.records.get(0, {}), default=0)
    if not a.records or not k:
        return broken(b if a.records else a)
    measured = f"2 runs, seed {plan.cfg.trainer.seed}, {k} steps on {len(a.records)} rank(s): "
    diff = first_difference(a, b, k)
    if diff is None:
        return verdict(measured + "losses bitwise equal", None)
    step, rank, x, y = diff
    said = (
        "torch names no non-deterministic op under trainer.deterministic=true: look for "
        "randomness of your own (an unseeded generator, the time, set or dict order)"
    )
    if strict is not None and "determinis" in (strict.error or ""):
        said = f"under trainer.deterministic=true torch says: {strict.error}"
    return verdict(
        measured + f"step {step} differs (rank {rank}: {x!r} vs {y!r})",
        f"the same seed gives another loss from step {step}; {said}",
    )


def first_difference(a: Run, b: Run, k: int) -> tuple[int, int, Any, Any] | None:
    for step in range(1, k + 1):
        for rank, records in a.records.items():
            x = records.get(step, {}).get("loss")
            y = b.records.get(rank, {}).get(step, {}).get("loss")
            if x is None or y is None or not probe.close(x, y, 0.0):
                return step, rank, x, y
    return None


def gradient_sync(plan: CheckPlan, a: Run) -> Result:
    """Step 1's DDP gradient (after the all-reduce, before clipping) against the same step in
    one process: each rank's rows with that rank's RNG state (its dropout draws), averaged."""
    cfg = plan.cfg
    if cfg.step is not None or cfg.ddp.meta_init:
        return skip("a step of your own (step._target_) or ddp.meta_init: the reference here is "
                    "the default step on a built model")  # fmt: skip
    kept = [[a.load(f"{what}_rank{r}.pt") for r in range(plan.world)]
            for what in ("start", "grads", "batch")]  # fmt: skip
    if any(x is None for x in sum(kept, [])):
        return broken(a)
    starts, synced, batches = kept
    device = torch.device("cuda" if on_gpu(plan) else "cpu")
    model = build(cfg.model, "model", **build(cfg.data, "data").spec).to(device)
    if callable(getattr(model, "training_step", None)):
        return skip("the model's own training_step: the reference here is the default step")
    model.load_state_dict(starts[0]["state"])
    model.train()
    loss = BatchLoss(build(cfg.loss, "loss", _as_function=True))
    autocast = autocast_for(cfg.trainer.precision, device)
    tools = StepTools(scaler_for(Precision.fp32, device), autocast, 0.0, raw_model=model)
    reference: dict[str, torch.Tensor] = {}
    for start, batch in zip(starts, batches):
        torch.set_rng_state(start["rng"]["torch"])
        if "cuda" in start["rng"]:
            torch.cuda.set_rng_state(start["rng"]["cuda"], device)
        tools.backward(model, [to_device(b, device) for b in batch], loss)
        for name, p in model.named_parameters():
            if p.grad is not None:
                reference[name] = reference.get(name, 0) + p.grad.cpu().double() / plan.world
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    unused = [name for name in trainable if name not in reference]
    if unused and not cfg.ddp.find_unused_parameters:
        return verdict(f"{len(unused)} of {len(trainable)} parameters get no gradient", (
            f"{_few(unused)} never get a gradient: use them in forward, drop them, or set "
            "ddp.find_unused_parameters=true (ddp=unused_params)"))  # fmt: skip
    apart = [n for g in synced[1:] for n in trainable if not probe.same(g.get(n), synced[0].get(n))]
    if apart:
        return verdict(f"{len(apart)} gradients differ between ranks", (
            f"after the all-reduce the ranks hold other gradients ({_few(apart)}): a comm hook "
            "of yours (ddp.comm_hook), or a step that skips the sync (no_sync)"))  # fmt: skip
    errors = {n: probe.relative(synced[0].get(n), ref) for n, ref in reference.items()}
    worst = max(errors, key=errors.get, default="")
    tol, why = _grad_tolerance(plan)
    measured = f"relative difference {errors.get(worst, 0):.2g} (tolerance {tol:g}: {why})"
    if cfg.ddp.find_unused_parameters and not unused:
        measured += "; ddp.find_unused_parameters=true is on for nothing (costs a graph walk)"
    return verdict(
        measured,
        errors.get(worst, 0) > tol
        and (
            f"DDP's gradient of {worst} is not the one-process gradient of the same rows: a loss "
            "that is no mean over the batch, a comm hook, or a forward that differs by rank"
        ),
    )


def _grad_tolerance(plan: CheckPlan) -> tuple[float, str]:
    cfg = plan.cfg
    hook = cfg.ddp.comm_hook if isinstance(cfg.ddp.comm_hook, str) else "of yours"
    # By the built-in hook's class (ddp_config.COMM_HOOKS): none, PowerSGD (step 1 is a plain
    # all-reduce) and fp16 compression keep fp32 sums close; the rest get the loose bound.
    kind = COMM_HOOKS.get(hook, "of yours") if hook != "of yours" else hook
    if cfg.trainer.precision.value != "fp32" or kind not in (None, "FP16Compress", "PowerSGD"):
        return 1e-2, f"{cfg.trainer.precision.value} autocast, comm hook {hook}"
    if kind == "FP16Compress":
        return 1e-3, "fp16-compressed gradients"
    if on_gpu(plan):
        return 1e-3, "fp32 on a GPU: TF32 convolutions, sums in another order"
    # PowerSGD compresses from its start_iter (>= 2): step 1 is a plain all-reduce.
    return 1e-5, "fp32 sums in another order"


def checkpoint_round_trip(plan: CheckPlan, a: Run, e: Run | None) -> Result:
    """The validation outputs at save time against hydra_ddp.eval's in a fresh process, which
    batches the rows on one rank: equal within 1e-6 of their scale (another batching may round
    otherwise), or the resume tolerance on a GPU."""
    if plan.cfg.trainer.ema_decay:
        return skip("trainer.ema_decay: hydra_ddp.eval predicts with the EMA weights, which the "
                    "model at save time is not")  # fmt: skip
    saved = a.load("predictions_val.pt")
    if saved is None or e is None or e.failed():
        return broken(a if saved is None or e is None else e)
    diff = probe.max_diff(saved, torch.load(a.dir / "predictions_val.pt", weights_only=False))
    outputs = probe.leaves(saved)
    scale = 1 + max((float(t.abs().max()) for t in outputs if t.numel()), default=0)
    first, last = (a.records.get(0, {}).get(s, {}).get("attrs", {}) for s in (1, plan.steps))
    changed = [f"model.{key}" for key in first if last.get(key) != first[key]]
    return verdict(
        f"{len(outputs[0])} val rows, max |diff| {diff:.3g} (hydra_ddp.eval, new process)",
        diff > max(tolerance(plan), 1e-6) * scale and (
            "the last checkpoint, loaded by hydra_ddp.eval, gives other outputs than the model at "
            "save time: state its state_dict does not hold"
            + (f" ({_few(changed)} changed in training)" if changed else "")
            + f" or loads otherwise ({e.log})"
        ),
    )  # fmt: skip


def _held_out_trained(source: Any) -> tuple[int, str]:
    """Validation and test rows in the training split: where the source says each split's rows
    come from (`origin`), else rows of equal content (array sources)."""
    origin = getattr(source, "origin", None)
    parts = {s: origin(s) for s in SPLITS} if callable(origin) else {}
    if parts and all(p is not None for p in parts.values()):
        held = np.concatenate([rows_in(parts["val"]), rows_in(parts["test"])])
        return int(np.isin(held, rows_in(parts["train"])).sum()), "by origin(split)"
    if getattr(source, "per_item", False):
        return 0, "not checked: the source has no origin(split)"
    seen = {
        s: probe.row_digests(d[np.arange(len(d))]) for s in SPLITS for d in [source.load(s, None)]
    }
    train = set(seen["train"])
    return sum(d in train for d in seen["val"] + seen["test"]), "by content"


def _final(run: Run) -> dict[str, Any]:
    path = checkpoint.latest(run.dir)
    return {} if path is None else probe.flat(checkpoint.load(path))


def _few(names: list[str], count: int = 3) -> str:
    more = f" and {len(names) - count} more" if len(names) > count else ""
    return ", ".join(names[:count]) + more
