"""What the engine calls on its runner, the device work it queues, and its step timer (no JAX).

`Runner` is the interface, as a `typing.Protocol`: `jaxpage.engine.runner.ModelRunner`
implements it, `jaxpage.distributed.MultiHostRunner` forwards it to one, and a runner that
does no device work (`scripts/bench_common.py`, for measuring the host alone) stands in for
it. The engine reads the sizes and counters below and makes the calls; nothing else crosses.

A step's block copies, fills and swaps are `DeviceWork` items: small frozen records of one
runner call each. The engine runs them in order and keeps the ones a failed step left undone
for the next step, telling them apart by type (`SwapOut`: a host block still to be written).

`StepTimer` adds up the seconds a step spends in each phase: the engine's (`ENGINE_PHASES`)
and, inside its device call, the runner's (`RUNNER_PHASES`). A phase ends where the next
begins, so one clock read marks each boundary.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    from jaxpage.engine.batch import SeqInput, SeqResult

# the engine's step: scheduling (with the failure outputs before the device call), the device
# call (the step's block copies and swaps, then `Runner.execute`), the scheduler's update of
# the requests, then detokenizing and building the outputs
ENGINE_PHASES = ("schedule", "device", "update", "outputs")
# inside `Runner.execute`: building the step's arrays (and copying them to the device where
# that is done apart from the call), compiling a new shape, dispatching the jitted calls,
# waiting for the device's results, and reading them back into per-sequence draws
RUNNER_PHASES = ("prepare", "compile", "dispatch", "wait", "readback")


class StepTimer:
    """Seconds per phase, added up over steps. `mark(phase)` ends `phase` now: it adds the
    time since the last mark (or `start`) to it and starts the next phase there."""

    __slots__ = ("seconds", "_last")

    def __init__(self, phases: tuple[str, ...]) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(phases, 0.0)
        self._last = 0.0

    def start(self) -> float:
        """Start the first phase now; returns the time."""
        self._last = time.perf_counter()
        return self._last

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)


@runtime_checkable
class Runner(Protocol):
    """The device side of an engine: the KV pool and host pool it sizes, the step it runs,
    and the block copies and swaps the scheduler plans."""

    # pool sizes, read by the engine's scheduler and allocator
    num_blocks: int
    num_window_blocks: int  # the sliding-window layers' pool (0: no such layers)
    num_host_blocks: int  # the host pool (0: none)
    window: int | None  # the sliding window in tokens (None: no sliding layers)
    block_bytes: int  # one block of the full group's layers, over all devices (a swap)
    window_block_bytes: int  # and of the sliding-window layers' (0: no such layers)
    kv_bytes_per_token: dict[str, int]  # per kind of layer
    kv_dtype: Any  # the pool's storage dtype (its `name` is reported)
    # the params' bytes as loaded, those of its 8-bit weights, and their format (None: none)
    weight_bytes: int
    quantized_weight_bytes: int
    quantization: str | None
    # a decode step of at most this many rows may start before the previous one is read
    # back (0: never); the scheduler marks the sequences that may (SeqInput.may_run_ahead)
    lookahead_rows: int
    # counters for stats(); swap-outs' timed bytes and seconds feed the "auto" swap model
    compile_seconds: float
    device_seconds: float
    swap_out_blocks: int
    swap_in_blocks: int
    swap_out_bytes_timed: int
    swap_out_seconds_timed: float
    lookahead_hits: int
    lookahead_misses: int
    lookahead_split: int  # hits whose other rows ran in a call of their own
    lookahead_dropped: int  # rows run ahead that the next step did not take
    timer: StepTimer  # RUNNER_PHASES, inside execute

    @property
    def compiles(self) -> int:
        """Compiled shapes so far."""

    def execute(self, seqs: list[SeqInput]) -> list[list[SeqResult]]:
        """Run one step over `seqs`: per sequence, one draw per sampling row."""

    def copy_blocks(self, copies: list[tuple[int, int]], window: bool = False) -> None:
        """Copy `(src, dst)` blocks in the full group's layers (or the window group's)."""

    def fill_blocks(self, block_ids: list[int], value: float, window: bool = False) -> None:
        """Set every slot of the blocks to `value` (the debug pool's NaN refills)."""

    def swap_out(self, copies: list[tuple[int, int]]) -> None:
        """Start copying `(device, host)` blocks to the host pool; they land in
        `finish_swaps`."""

    def swap_in(self, copies: list[tuple[int, int]]) -> None:
        """Copy `(host, device)` blocks into the device pool."""

    def finish_swaps(self) -> None:
        """Land the swap-outs in flight in the host pool."""

    def swaps_in_flight(self) -> list[int]:
        """Host blocks whose swap-out started and has not landed."""

    def drop_swaps(self) -> list[list[tuple[int, int]]]:
        """Forget the swap-outs in flight; returns their copies."""

    def pool_lost(self) -> bool:
        """Whether the KV pool's buffers were freed by a failed call."""

    def reset_pool(self) -> None:
        """A new, empty KV pool."""

    def load_lora(self, slot: int, weights: Any) -> None:
        """Write a LoRA adapter's weights (jaxpage.lora.LoRAWeights) into device slot
        `slot` of every projection's stack."""

    def warmup(self, shapes: int | None = None) -> tuple[int, float]:
        """Compile the first shapes a server meets (the first `shapes` of them, if given):
        (compilations, seconds)."""


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceWork:
    """One runner call a step makes before its forward. `run` makes it; the arguments are
    passed positionally, as `MultiHostRunner` forwards them to the other processes."""

    kind: ClassVar[str]

    @property
    def blocks(self) -> list:
        """What the call copies or fills (nothing: the call is not made)."""
        raise NotImplementedError

    def run(self, runner: Runner) -> None:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, slots=True)
class _BlockPairs(DeviceWork):
    """Device work on pairs of blocks, `(from, to)`."""

    copies: list[tuple[int, int]]

    @property
    def blocks(self) -> list:
        return self.copies


@dataclasses.dataclass(frozen=True, slots=True)
class SwapOut(_BlockPairs):
    """Start copying `(device, host)` blocks to the host pool."""

    kind: ClassVar[str] = "swap_out"

    def run(self, runner: Runner) -> None:
        runner.swap_out(self.copies)


@dataclasses.dataclass(frozen=True, slots=True)
class SwapIn(_BlockPairs):
    """Copy `(host, device)` blocks into the device pool."""

    kind: ClassVar[str] = "swap_in"

    def run(self, runner: Runner) -> None:
        runner.swap_in(self.copies)


@dataclasses.dataclass(frozen=True, slots=True)
class CopyBlocks(_BlockPairs):
    """Copy-on-write `(src, dst)` copies, in the full group's layers or the window group's."""

    window: bool = False
    kind: ClassVar[str] = "copy_blocks"

    def run(self, runner: Runner) -> None:
        if self.window:
            runner.copy_blocks(self.copies, True)
        else:
            runner.copy_blocks(self.copies)


@dataclasses.dataclass(frozen=True, slots=True)
class FillBlocks(DeviceWork):
    """Fill released blocks with `value` (NaN: the debug pool), in either group."""

    block_ids: list[int]
    value: float
    window: bool = False
    kind: ClassVar[str] = "fill_blocks"

    @property
    def blocks(self) -> list:
        return self.block_ids

    def run(self, runner: Runner) -> None:
        if self.window:
            runner.fill_blocks(self.block_ids, self.value, True)
        else:
            runner.fill_blocks(self.block_ids, self.value)


@dataclasses.dataclass(frozen=True, slots=True)
class LoadLoRA(DeviceWork):
    """Write a LoRA adapter into a device slot before the step that first runs it."""

    slot: int
    weights: Any  # jaxpage.lora.LoRAWeights
    kind: ClassVar[str] = "load_lora"

    @property
    def blocks(self) -> list:
        return [self.slot]

    def run(self, runner: Runner) -> None:
        runner.load_lora(self.slot, self.weights)
