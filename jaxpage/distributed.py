"""One engine over the devices of several processes (hosts): `jax.distributed` plus a
broadcast of every device call.

Every process runs the same program: `jaxpage.distributed.initialize(...)`, then
`llm = LLM(..., tensor_parallel_size=N)` with N counting the devices of all processes (the
mesh spans them; each process places only its own shards). Process 0 owns the requests,
the scheduler and the allocator; its runner broadcasts each device call (the step's
sequences, block copies, fills, pool resets) to the other processes before making it,
and the others run `follow(llm)`, making the same calls as they arrive. So every process
runs the same jitted SPMD step on its shards; the sampled tokens are replicated, and
process 0 reads them from its own devices. `stop(llm)` on process 0 ends the followers.

A process that dies stops the collectives: the others would wait forever. Every call on
process 0 therefore runs under a deadline (`call_timeout`): past it, process 0 reports
which call the other hosts did not answer and exits with status 3, as does a follower
whose call outlives it; a follower waiting for the next call is ended by JAX's own
heartbeat check when process 0 (which holds the coordination service) dies.

Launch (two hosts; the same on a TPU pod slice with one process per host, or GPU hosts):

    # host 0                                   # host 1
    JAX_COORDINATOR_ADDRESS=10.0.0.1:1234      JAX_COORDINATOR_ADDRESS=10.0.0.1:1234
    JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0       JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=1
    python -m jaxpage.serve --tensor-parallel-size 16 ...   (both: the same command)

On a Cloud TPU VM slice `jax.distributed.initialize()` finds all of it by itself.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
from typing import Any

import jax
import numpy as np

_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
# the runner calls that touch the devices: every process must make them together
DEVICE_CALLS = ("execute", "copy_blocks", "fill_blocks", "reset_pool", "warmup")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, heartbeat_timeout_seconds: int = 30) -> None:
    """`jax.distributed.initialize` from the arguments, else the environment
    (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID), else the platform's own
    detection (TPU VMs, SLURM). On CPU the collectives go through gloo."""
    env = [os.environ.get(name) for name in _ENV]
    coordinator_address = coordinator_address or env[0]
    num_processes = num_processes if num_processes is not None else (
        int(env[1]) if env[1] else None)
    process_id = process_id if process_id is not None else (int(env[2]) if env[2] else None)
    if jax.config.jax_platforms in ("cpu", None) or os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               heartbeat_timeout_seconds=heartbeat_timeout_seconds)


def is_leader() -> bool:
    return jax.process_index() == 0


class MultiHostRunner:
    """A ModelRunner whose device calls every process makes together (process 0 decides
    them and broadcasts them first). Everything else is the local runner's."""

    def __init__(self, runner: Any, call_timeout: float = 120.0) -> None:
        if getattr(runner, "num_host_blocks", 0):
            raise ValueError("swap_space: swapping to host memory is not supported across "
                             "several processes yet; use swap_space 0")
        self._runner = runner
        self.call_timeout = call_timeout

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._runner, name)
        if name not in DEVICE_CALLS:
            return attr

        def call(*args: Any) -> Any:
            if name == "execute":  # structured outputs' masks made here, sent with the step
                from jaxpage.structured import masks_filled

                args = (masks_filled(args[0], self._runner.model.config.vocab_size),)
            with _deadline(self.call_timeout, f"{name} on {jax.process_count()} processes"):
                _broadcast((name, args))
                return attr(*args)

        return call

    def follow(self) -> None:
        """Make the device calls process 0 broadcasts, until it says stop."""
        while True:  # an idle leader is normal: wait for its next call without a deadline
            name, args = _broadcast(None)
            if name == "stop":
                return
            with _deadline(self.call_timeout, f"{name} on {jax.process_count()} processes"):
                getattr(self._runner, name)(*args)

    def stop(self) -> None:
        """Process 0: end the followers' loops."""
        _broadcast(("stop", ()))


def follow(llm: Any) -> None:
    """On processes other than 0: serve `llm`'s device calls until process 0 stops."""
    llm.engine.runner.follow()


def stop(llm: Any) -> None:
    """On process 0: release the other processes."""
    llm.engine.runner.stop()


def _broadcast(message: Any) -> Any:
    """Process 0's `message` on every process (others pass None): its pickled length, then
    its bytes, each with one `broadcast_one_to_all`."""
    from jax.experimental import multihost_utils

    payload = pickle.dumps(message) if is_leader() else b""
    size = int(multihost_utils.broadcast_one_to_all(np.int64(len(payload))))
    buffer = np.zeros(size, np.uint8)
    if is_leader():
        buffer[:] = np.frombuffer(payload, np.uint8)
    data = multihost_utils.broadcast_one_to_all(buffer)
    return pickle.loads(np.asarray(data, np.uint8).tobytes())


class _deadline:
    """Exit the process (status 3) with a message if the block outlives `seconds`: a
    collective whose peer died never returns."""

    def __init__(self, seconds: float, what: str) -> None:
        self.seconds, self.what = seconds, what
        self._done = threading.Event()

    def __enter__(self) -> None:
        threading.Thread(target=self._watch, daemon=True).start()

    def __exit__(self, *exc: Any) -> None:
        self._done.set()

    def _watch(self) -> None:
        if not self._done.wait(self.seconds):
            print(f"jaxpage.distributed: process {jax.process_index()} waited "
                  f"{self.seconds:.0f} s for {self.what}; another process has stopped "
                  f"answering. Exiting.", file=sys.stderr, flush=True)
            os._exit(3)
