"""The host swap pool's transfers: a preempted sequence's blocks copied out to the host pools
and back into the device pool, started before the step's forward and landed after it.

`HostSwaps` is the part of `ModelRunner` along this seam (the runner is built from it). It
uses the runner's host pools (`host_kv`, `window_host_kv`, `draft_host_kv`: the full group's
`num_host_blocks` rows, then the window group's, numbered after them in a swap plan's host
ids), its device pools (`kv_pool` and the layers of each group, `draft_pool`), its buckets and
block sizes, and dispatches through its `_call` and `_update_group`; it owns the swap-outs in
flight and the copy counters.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.buckets import bucket_for
from pallas_kernels import bits


def _gather_blocks_fn(kv_pool, block_ids):
    # block_ids: [C] int32 (padding reads block 0)
    # -> [C, num_layers, 2, num_kv_heads, block_size, head_dim]: a block's K and V of every
    #    layer together, the host pool's layout
    per_layer = [jnp.stack([bits.take(x, (slice(None), block_ids)) for x in layer])
                 for layer in kv_pool]
    return jnp.stack(per_layer).transpose(3, 0, 1, 2, 4, 5)


def _scatter_blocks_fn(kv_pool, block_ids, blocks):
    # block_ids: [C] int32 (padding writes block 0); blocks: [C, num_layers, 2, H, bs, D]
    return [tuple(bits.set_rows(x, block_ids, blocks[:, layer, i].transpose(1, 0, 2, 3))
                  for i, x in enumerate(pair)) for layer, pair in enumerate(kv_pool)]


_GATHER_BLOCKS = jax.jit(_gather_blocks_fn)
_SCATTER_BLOCKS = jax.jit(_scatter_blocks_fn, donate_argnums=0)


class HostSwaps:
    """Swap-outs and swap-ins between the device pools and the host pools (see the module
    docstring for what it uses of the runner)."""

    def _init_swaps(self) -> None:
        self.swap_out_blocks = self.swap_in_blocks = 0
        # swap-outs started and not yet in the host pools: ((device, host) block pairs as
        # planned, per host pool (the pool, its rows, the gathered blocks on their way), the
        # bytes, dispatch seconds or None if it compiled)
        self._swaps_in_flight: list[tuple[list, list[tuple[np.ndarray, list[int], jax.Array]],
                                          int, float | None]] = []
        # swap-outs that did not compile, timed as the step waited for them (dispatch, and
        # the rest of the transfer and the host write after the forward): the copy
        # bandwidth the "auto" preemption mode measures
        self.swap_out_bytes_timed = 0
        self.swap_out_seconds_timed = 0.0

    def _split_swaps(self, copies: list[tuple[int, int]], host_at: int
                     ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """A swap plan's pairs by group: host ids from num_host_blocks on are the window
        group's (jaxpage.engine.kv_groups), renumbered from 0 (`host_at`: the host id's
        place in a pair)."""
        full, window, offset = [], [], self.num_host_blocks
        for pair in copies:
            if pair[host_at] < offset:
                full.append(pair)
            else:
                pair = list(pair)
                pair[host_at] -= offset
                window.append(tuple(pair))
        return full, window

    def swap_out(self, copies: list[tuple[int, int]]) -> None:
        """Start copying `(device block, host block)` pairs into the host pools: per group
        (and the draft's own pool) one jitted gather of its layers' blocks, dispatched
        before this step's forward (so it reads the blocks before the forward may rewrite
        them), and one device->host transfer started at once; the transfer overlaps the
        forward and lands in `finish_swaps`."""
        if not copies:
            return
        start, parts, measured, nbytes = time.perf_counter(), [], True, 0
        groups = [(False, self.host_kv, self.swap_out_buckets, self.block_bytes),
                  (True, self.window_host_kv, self.window_swap_out_buckets,
                   self.window_block_bytes)]
        for (window, host, buckets, block_bytes), pairs in zip(
                groups, self._split_swaps(copies, 1), strict=True):
            layers = self.window_layers if window else self.full_layers
            if not pairs or not (layers or (self.draft_pool is not None and not window)):
                continue
            size = bucket_for(len(pairs), buckets)
            device_ids = np.zeros(size, np.int32)
            device_ids[: len(pairs)] = [device_id for device_id, _ in pairs]
            host_ids = [host_id for _, host_id in pairs]
            name = "window_swap_out" if window else "swap_out"
            measured &= (name, size) in self.compiled or not layers
            if layers:
                parts.append((host, host_ids, self._call(
                    (name, size), _GATHER_BLOCKS, ([self.kv_pool[i] for i in layers],
                                                   device_ids))))
            if self.draft_pool is not None and not window:
                measured &= ("draft_swap_out", size) in self.compiled
                parts.append((self.draft_host_kv, host_ids, self._call(
                    ("draft_swap_out", size), _GATHER_BLOCKS, (self.draft_pool, device_ids))))
            nbytes += len(pairs) * block_bytes
        for _, _, part in parts:
            part.copy_to_host_async()
        self._swaps_in_flight.append((copies, parts, nbytes,
                                      time.perf_counter() - start if measured else None))
        self.swap_out_blocks += len(copies)

    def finish_swaps(self) -> None:
        """Write the swap-outs in flight into the host pools (waiting for their transfers).
        The time counted as the copy's is what the step spent on it: dispatch and the wait
        here, not the part the transfer overlapped the forward."""
        while self._swaps_in_flight:
            _, parts, nbytes, dispatch_seconds = self._swaps_in_flight[0]
            start = time.perf_counter()
            for host, host_ids, part in parts:
                host[host_ids] = np.asarray(part)[: len(host_ids)]
            self._swaps_in_flight.pop(0)
            if dispatch_seconds is not None:
                self.swap_out_seconds_timed += dispatch_seconds + time.perf_counter() - start
                self.swap_out_bytes_timed += nbytes

    def swaps_in_flight(self) -> list[int]:
        """Host blocks whose swap-out was started and has not landed."""
        return [host_id for copies, *_ in self._swaps_in_flight for _, host_id in copies]

    def drop_swaps(self) -> list[list[tuple[int, int]]]:
        """Forget the swap-outs in flight (after a failure); returns their copies."""
        dropped = [copies for copies, *_ in self._swaps_in_flight]
        self._swaps_in_flight.clear()
        return dropped

    def swap_in(self, copies: list[tuple[int, int]]) -> None:
        """Copy `(host block, device block)` pairs into the KV pool: per group (and the
        draft's own pool) one host->device transfer of its blocks, one jitted scatter into
        its donated layers. Swap-outs in flight land first (a block swapped out may be read
        back in the same step)."""
        if not copies:
            return
        self.finish_swaps()
        full, window = self._split_swaps(copies, 0)
        for in_window, pairs, host in ((False, full, self.host_kv),
                                       (True, window, self.window_host_kv)):
            if not pairs:
                continue
            size = bucket_for(len(pairs), self.copy_buckets)
            host_ids = np.full(size, pairs[0][0], np.int64)  # padding: any row, into block 0
            device_ids = np.zeros(size, np.int32)
            host_ids[: len(pairs)], device_ids[: len(pairs)] = zip(*pairs, strict=True)
            if self.window_layers if in_window else self.full_layers:
                self._update_group(in_window, ("window_swap_in" if in_window else "swap_in",
                                               size), _SCATTER_BLOCKS, device_ids,
                                   jax.device_put(host[host_ids]))
            if self.draft_pool is not None and not in_window:
                blocks = jax.device_put(self.draft_host_kv[host_ids])
                self.draft_pool = self._call(("draft_swap_in", size), _SCATTER_BLOCKS,
                                             (self.draft_pool, device_ids, blocks))
        self.swap_in_blocks += len(copies)

    def _host_pools(self) -> list[np.ndarray]:
        """The host pools: the target's full group's and window group's, and the draft's."""
        return [self.host_kv, self.window_host_kv] + (
            [] if self.draft_host_kv is None else [self.draft_host_kv])
