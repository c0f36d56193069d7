"""The library messages distributed/failures.py recognises, each produced here by the real
library call.

failures.py turns torch's exceptions into one `error:` line by matching words of their messages.
A torch upgrade that rewords one would silently bring back the traceback; here each message is
raised for real (a real gloo group in forked processes, a real DDP reducer, a real DataLoader
worker killed), then read by its own predicates, so the rewording fails CI instead.
The last test holds failures.py to it: a string it matches that no test here produces fails.
NCCL's strings can only be produced with two GPUs: that test skips elsewhere.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from helpers import ranks

from hydra_ddp.distributed import failures as errors

# Every string failures.py matches, and which test below produces it.
PRODUCED_BY = {
    "Connection closed by peer": "test_a_dead_peer",
    "Timed out waiting": "test_a_stalled_peer",
    "Application timeout caused pair closure": "test_a_stalled_peer",
    "NCCL communicator was aborted": "test_nccl_messages",
    "remote process exited or there was a network error": "test_nccl_messages",
    "ncclRemoteError": "test_nccl_messages",
    "Watchdog caught collective operation timeout": "test_nccl_messages",
}


def _group_of_own(env, store: str, timeout_s: float) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    dist.barrier()


def _unused(env) -> str:
    """DDP's reducer, at the forward after a backward that left a parameter without grad."""
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(2, 2), "not": torch.nn.Linear(2, 2)})
    ddp = torch.nn.parallel.DistributedDataParallel(_UsesOne(model))
    try:
        for _ in range(2):
            ddp(torch.ones(1, 2)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def _peer_leaves(env, store: str, stall_s: float, timeout_s: float) -> list[str]:
    """Rank 1 leaves the group (after `stall_s`); rank 0's collectives meanwhile, twice."""
    _group_of_own(env, store, timeout_s)
    texts = []
    if env.rank == 1:
        time.sleep(stall_s)
    else:
        time.sleep(0.3)
        for _ in range(2):  # the second call meets the pair the first one closed (timeout)
            try:
                dist.all_reduce(torch.ones(1))
            except RuntimeError as e:
                texts.append(str(e))
    dist.destroy_process_group()
    return texts


class _UsesOne(torch.nn.Module):
    def __init__(self, parts: torch.nn.ModuleDict):
        super().__init__()
        self.parts = parts

    def forward(self, x):
        return self.parts["used"](x)


@pytest.mark.slow
def test_ddp_unused_parameters(tmp_path):
    (text,) = ranks.run(_unused, world_size=1)
    assert "Expected to have finished reduction" in text
    line = errors.one_line(RuntimeError(text), 0, 300, tmp_path)
    assert line is not None and "ddp=unused_params" in str(line)


def test_a_dead_peer(tmp_path):
    texts = ranks.run(_peer_leaves, str(tmp_path / "store"), 0.0, 30.0, group=False)[0]
    text = texts[0]
    assert "Connection closed by peer" in text
    assert errors.lost_peer(RuntimeError(text)) and not errors.timed_out(RuntimeError(text))
    assert errors.LOST_CONTACT in str(errors.one_line(RuntimeError(text), 0, 300, tmp_path))


def test_a_stalled_peer(tmp_path):
    first, second = ranks.run(_peer_leaves, str(tmp_path / "store"), 2.5, 1.0, group=False)[0]
    assert "Timed out waiting" in first
    assert "Application timeout caused pair closure" in second
    for text in (first, second):
        assert errors.timed_out(RuntimeError(text)) and not errors.lost_peer(RuntimeError(text))
        assert errors.WAITED in str(errors.one_line(RuntimeError(text), 0, 1, tmp_path))


class _KillsItsWorker(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_dataloader_worker(tmp_path):
    loader = torch.utils.data.DataLoader(
        _KillsItsWorker(), num_workers=1, multiprocessing_context="fork"
    )
    with pytest.raises(RuntimeError) as caught:
        next(iter(loader))
    assert "DataLoader worker" in str(caught.value)
    line = errors.one_line(caught.value, 0, 300, tmp_path)
    assert line is not None and "trainer.num_workers" in str(line)


def test_os_errors_come_from_the_os():
    """gloo's read/write errors quote the OS: matched by the OS's text for the errno."""
    for number in errors._LOST_PEER_ERRNOS:
        text = f"[pair.cc:589] Read error [127.0.0.1]:45678: {os.strerror(number)}"
        assert errors.lost_peer(RuntimeError(text))


def _nccl_rank(rank: int, store: str, queue) -> None:
    """A rank of a real NCCL group whose peer dies: what rank 0's collective raises."""
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"  # raise in Python, not abort
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"file://{store}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=5),
    )  # fmt: skip
    dist.all_reduce(torch.ones(1, device="cuda"))
    torch.cuda.synchronize()
    if rank == 1:
        os._exit(0)
    try:
        for _ in range(3):
            dist.all_reduce(torch.ones(1, device="cuda"))
            torch.cuda.synchronize()
            time.sleep(2)
        queue.put(None)
    except Exception as e:
        queue.put(str(e))
    os._exit(0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL's messages need two GPUs")
def test_nccl_messages(tmp_path):
    """Two GPUs only (never run on the CPU CI): a dead NCCL peer reads as lost or timed out."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_nccl_rank, args=(r, str(tmp_path / "store"), queue)) for r in (0, 1)
    ]
    for p in procs:
        p.start()
    text = queue.get(timeout=120)
    for p in procs:
        p.join(10)
    assert text is not None
    assert errors.lost_peer(RuntimeError(text)) or errors.timed_out(RuntimeError(text)), text


def test_every_matched_string_is_produced_here():
    matched = set(errors._LOST_PEER) | set(errors._TIMED_OUT)
    assert matched == set(PRODUCED_BY), (
        "failures.py matches a string no test produces (or a test lists one it no longer "
        f"matches): {sorted(matched ^ set(PRODUCED_BY))}"
    )
