"""Joining the process group torchrun describes, in a way that survives torchrun's restarts.

Under torchrun the workers' default store is the elastic agent's own TCPStore, and that store lives
across `--max-restarts` rounds with the keys of the round before: a restarted worker can read the
listening address a killed peer published, and gloo's full-mesh connect then fails with
"Connection refused" (seen with torch 2.13 and the c10d rendezvous). The restart count cannot name
the round either: with several nodes only the agent whose worker failed counts a restart.

So rank 0 of every round starts a store of its own on a free port and announces the port in the
agent's store. A port announced by an earlier round belonged to a process that no longer exists
(torchrun stops every worker before it restarts any), so the other ranks retry until the announced
store answers, and that one is this round's.

What listens where:
- torchrun's agent store: MASTER_PORT (`--rdzv-endpoint`), opened by torchrun, not by us; torch
  binds it to every interface.
- rank 0's round store (this module): a free port on the address MASTER_ADDR resolves to, and
  nowhere else: loopback when torchrun runs on one node with a localhost endpoint. We bind the
  socket ourselves and hand it to TCPStore (`master_listen_fd`), since TCPStore alone listens on
  every interface. Like torch's stores it is unauthenticated: anyone who can reach that address
  can read and write its keys, so on several nodes keep MASTER_ADDR on a trusted network.
- gloo/NCCL: their own connections, on the interfaces torch picks (GLOO_SOCKET_IFNAME,
  NCCL_SOCKET_IFNAME choose them).
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

from autopar.errors import AutoparError

ANNOUNCE_KEY = "autopar/round-store-port"
CONNECT_ATTEMPT_S = 2.0  # one try to reach an announced store; a stale port refuses at once


def _timeout_s() -> float:
    return float(os.environ.get("AUTOPAR_INIT_TIMEOUT_S", "300"))


def listening_socket(host: str) -> socket.socket:
    """A TCP socket listening on a free port of the address `host` resolves to (its first address),
    the address the other ranks connect to; one line if this machine does not have that address."""
    try:
        family, kind, protocol, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise AutoparError(f"MASTER_ADDR={host} does not resolve ({error.strerror}): launch with torchrun and a "
                           f"reachable --rdzv-endpoint") from None
    listener = socket.socket(family, kind, protocol)
    try:
        listener.bind(address[:2] if family == socket.AF_INET else address)
        listener.listen(128)
    except OSError as error:
        listener.close()
        raise AutoparError(f"rank 0 cannot listen on {address[0]} (MASTER_ADDR={host}): {error.strerror}; rank 0 "
                           f"must run on the host MASTER_ADDR names (the --rdzv-endpoint host)") from None
    return listener


def round_store(rank: int, world_size: int):
    """A store that holds only this round's keys (see the module docstring)."""
    from torch.distributed import TCPStore

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = timedelta(seconds=_timeout_s())
    agent = TCPStore(host, port, world_size=world_size, is_master=False, timeout=timeout)
    if rank == 0:
        listener = listening_socket(host)
        own = TCPStore(host, listener.getsockname()[1], world_size=world_size, is_master=True, timeout=timeout,
                       wait_for_workers=False, master_listen_fd=listener.detach())  # the store owns the socket now
        agent.set(ANNOUNCE_KEY, str(own.port))
        return own
    deadline = time.monotonic() + _timeout_s()
    last_error = None
    while time.monotonic() < deadline:
        announced = int(agent.get(ANNOUNCE_KEY).decode())  # waits until some round announced one
        try:  # a bare socket first: TCPStore would log a C++ backtrace for every stale port it tries
            socket.create_connection((host, announced), timeout=CONNECT_ATTEMPT_S).close()
            return TCPStore(host, announced, world_size=world_size, is_master=False, timeout=timeout)
        except Exception as error:  # noqa: BLE001 - a stale announcement: wait for this round's
            last_error = error
            time.sleep(0.1)
    raise AutoparError(f"rank {rank} found no process-group store from rank 0 within {_timeout_s():.0f} s "
                       f"(last error: {last_error}); check that rank 0 started, or raise AUTOPAR_INIT_TIMEOUT_S")


def init_process_group(world_size: int, rank: int, local_rank: int) -> None:
    """Join torchrun's processes: NCCL on GPUs, gloo on CPU, on a store of this round's own."""
    import torch
    import torch.distributed as dist

    if world_size == 1 or dist.is_initialized():
        return
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise AutoparError(f"WORLD_SIZE={world_size} but {name} is not set: launch with "
                               f"`torchrun --nproc-per-node {world_size} -m autopar run ...`")
    # Outside torchrun (processes started by hand with MASTER_ADDR/PORT) rank 0 hosts a fresh store anyway.
    elastic = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    where = dict(store=round_store(rank, world_size), rank=rank, world_size=world_size) if elastic else {}
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), **where)
    else:
        dist.init_process_group("gloo", **where)
