"""How arrays meet the devices and the processes: the FSDP layout of the weights, numpy copies of
arrays gathered from every process, and joining several processes (hosts) before anything else.
Process 0 prints and writes; every process reads. L layers."""

import os
import socket
import sys
import threading
import time

import jax
import numpy as np
from jax.experimental.multihost_utils import process_allgather
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lab.models import STACKS


def shardings(tree, mesh=None):
    """FSDP: each matrix of a weight tree (or of its optimizer state) split over the mesh (default:
    every device) on its largest axis the device count divides, never the stacked layer axis L
    that a layer slices; vectors and scalars whole on every device (one device: replicated)."""
    mesh = mesh or Mesh(np.array(jax.devices()), ("data",))

    def spec(path, x):
        stacked = any(getattr(k, "key", None) in STACKS for k in path)  # [L, ...]
        if x.ndim - stacked < 2:
            return NamedSharding(mesh, PartitionSpec())
        axes = [i for i in range(stacked, x.ndim) if x.shape[i] % mesh.size == 0]
        if not axes:
            return NamedSharding(mesh, PartitionSpec())
        split = max(axes, key=lambda i: x.shape[i])
        return NamedSharding(mesh, PartitionSpec(*[None] * split, "data"))

    return jax.tree_util.tree_map_with_path(spec, tree)


def host(tree):  # numpy copies of (global) arrays: every row, on every process; numpy stays
    return jax.tree.map(lambda x: x if isinstance(x, np.ndarray) else _gathered(x), tree)


def _gathered(x):
    return np.asarray(process_allgather(x, tiled=True))


def join(env=os.environ):
    """One of JAX_NUM_PROCESSES processes: JAX_PROCESS_ID is its rank, JAX_COORDINATOR_ADDRESS the
    host:port of process 0, JAX_COORDINATOR_TIMEOUT how many seconds to wait for the others
    (default 120). A process that is not joined by then says so in one line and stops."""
    n = int(env.get("JAX_NUM_PROCESSES", 1))
    if n > 1 and not jax.distributed.is_initialized():
        rank, address = env.get("JAX_PROCESS_ID", "?"), env.get("JAX_COORDINATOR_ADDRESS", "")
        seconds = float(env.get("JAX_COORDINATOR_TIMEOUT", 120))
        if not rank.isdigit() or not int(rank) < n or ":" not in address:
            raise SystemExit(
                f"error: JAX_NUM_PROCESSES={n} needs JAX_PROCESS_ID in 0..{n - 1} (got {rank}) "
                f"and JAX_COORDINATOR_ADDRESS host:port of process 0 (got {address!r})"
            )
        who = "the other processes" if rank == "0" else "the coordinator, process 0,"
        print(
            f"process {rank} of {n}: waiting up to {seconds:g} s for {who} at {address} "
            "(JAX_COORDINATOR_ADDRESS; JAX_COORDINATOR_TIMEOUT sets the wait)",
            flush=True,
        )
        if rank != "0" and not reachable(address, seconds):
            give_up(f"process {rank} of {n} found no coordinator at {address}", seconds)
        _initialize(address, n, int(rank), seconds)
    if jax.process_index():
        sys.stdout = open(os.devnull, "w")


def _initialize(address, n, rank, seconds):
    """jax.distributed.initialize, given up on in one line after `seconds` (jax's own timeout, set
    later, would abort the process with a stack trace)."""
    where = "process 0 at " + address if rank else f"the other processes at {address}"
    watchdog = threading.Timer(
        seconds, give_up, (f"process {rank} of {n} was not joined by {where}", seconds, True)
    )
    watchdog.daemon = True
    watchdog.start()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices: the tests
    jax.distributed.initialize(address, n, rank, initialization_timeout=int(seconds) + 60)
    watchdog.cancel()


def give_up(what, seconds, exit_now=False):
    message = (
        f"error: {what} within {seconds:g} s: set JAX_COORDINATOR_ADDRESS to process 0's "
        "host:port, reachable from every process, and start all JAX_NUM_PROCESSES processes"
    )
    if exit_now:  # from the watchdog's thread: the main thread is inside jax
        print(message, file=sys.stderr, flush=True)
        os._exit(1)
    raise SystemExit(message)


def reachable(address, seconds):  # a TCP connection to host:port opens within `seconds`
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + seconds
    while True:
        try:
            left = max(deadline - time.monotonic(), 0.1)
            socket.create_connection((host, int(port)), timeout=min(left, 5)).close()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)


def default_micro_batch(args):
    """The largest divisor of B = P·G that is a multiple of the devices and holds at most 8,192
    completion tokens (GSM8K's 512-token completions: 16 rows)."""
    B, devices = args.prompts * args.group, jax.device_count()
    cap = min(B, 8192 // max(args.max_tokens, 1))
    divisors = [d for d in range(devices, cap + 1, devices) if B % d == 0]
    return (divisors or [max(B, 1)])[-1]
