"""A user's DDP comm hook (tests/ is on sys.path): `ddp.comm_hook._target_=helpers.
user_comm_hooks.CountingMean` in process, and copied as my_hooks.py next to a YAML for the real
launch of test_user_policy_and_hook.py."""

import torch.distributed as dist


class CountingMean:
    """The mean of the ranks' gradients, as DDP's default all-reduce; counts its calls."""

    def __init__(self, note: str):
        self.state = {"calls": 0, "note": note}

    def hook(self, state, bucket):
        state["calls"] += 1
        grads = bucket.buffer().div_(dist.get_world_size())
        done = dist.all_reduce(grads, async_op=True).get_future()
        return done.then(lambda fut: fut.value()[0])

    def state_dict(self):
        return {"calls": self.state["calls"]}

    def load_state_dict(self, saved):
        self.state["calls"] = int(saved["calls"])
