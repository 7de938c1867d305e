"""A standalone `torch.distributed` group joining a trainer rank and inference-engine ranks for weight sync.

SGLang's ``/init_weights_update_group`` makes each engine rank join a *new* process group (rank
``rank_offset + tp_rank``) through a TCP rendezvous hosted by the trainer (rank 0), independent of the
trainer's own default group. `torch.distributed.new_group` cannot do that (it splits the default group), so
this follows the helper SGLang, OpenRLHF and verl use: rendezvous on ``tcp://address:port`` and build the
group with `_new_process_group_helper`, registered so `torch.distributed.broadcast(..., group=pg)` works.
"""

from __future__ import annotations

import inspect
import socket
from datetime import timedelta

import torch.distributed as dist


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def init_weight_update_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta = timedelta(minutes=10),
):
    """Join (rank 0: host) the weight-update group ``group_name``; returns the process group."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    params = inspect.signature(_new_process_group_helper).parameters
    options_kw = "backend_options" if "backend_options" in params else "pg_options"
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout, **{options_kw: None}
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_weight_update_group(pg) -> None:
    """Tear down a group made by `init_weight_update_group`."""
    if pg is not None:
        dist.destroy_process_group(pg)
