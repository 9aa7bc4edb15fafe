"""Preemption modes, and the cost model "auto" decides with (plain Python, no JAX).

A preempted group (a request's running samples) is either recomputed (its blocks freed; it
prefills its tokens again when readmitted) or swapped (its blocks copied to the host pool and
back). Under "auto" it is swapped when

    swap seconds      = 2 * (blocks * block_bytes + window blocks * window_block_bytes)
                        / copy_bandwidth                                 (out now, in later)
    recompute seconds = tokens * prefill_seconds_per_token

says swapping is cheaper: `blocks` are the distinct device blocks holding the group's
computed tokens (a shared block once), `window blocks` those of a sliding-window model's
window layers that the kept tokens' window reads (kv_groups), `tokens` the computed tokens
its samples would prefill again (each sample its own; prefix-cache hits at readmission are
not counted on, so the recompute side is an upper bound).

Both rates are measured as the engine runs, starting from the configured values
(`EngineConfig.swap_bandwidth`, `prefill_seconds_per_token`) or, when those are None, from
the defaults below: the copy bandwidth is the bytes of all swap-outs over their seconds
(gather + device->host transfer + host write; calls that compiled are left out), the
prefill rate is the device seconds of steps that ran a prompt chunk over the tokens of those
steps. A configured value is used as given and never replaced by a measurement. Prefill cost
per token grows with context (attention), so the rate measured on short prompts
understates long recomputes; this too leans towards swapping.
"""

from __future__ import annotations

import dataclasses

PREEMPTION_MODES = ("recompute", "swap", "auto")

# Starting points before anything is measured: a PCIe-class host link, and a prefill rate
# of 10k tokens/s (a small model on one accelerator; a CPU is ~10x slower, which only makes
# swapping look better there until measured).
DEFAULT_COPY_BANDWIDTH = 10e9  # bytes/s
DEFAULT_PREFILL_SECONDS_PER_TOKEN = 1e-4


@dataclasses.dataclass
class SwapCostModel:
    """Estimates of the two costs; `block_bytes` is one block's K/V over the full-attention
    layers, `window_block_bytes` over the sliding-window ones (0: none)."""

    block_bytes: int
    window_block_bytes: int = 0
    copy_bandwidth: float | None = None  # configured bytes/s; None: measured
    prefill_seconds_per_token: float | None = None  # configured; None: measured
    copied_bytes: int = 0
    copy_seconds: float = 0.0
    prefilled_tokens: int = 0
    prefill_seconds: float = 0.0

    def observe_copies(self, total_bytes: int, total_seconds: float) -> None:
        """The runner's running totals of its measured swap-outs."""
        self.copied_bytes, self.copy_seconds = total_bytes, total_seconds

    def record_prefill(self, num_tokens: int, seconds: float) -> None:
        self.prefilled_tokens += num_tokens
        self.prefill_seconds += seconds

    @property
    def bandwidth(self) -> float:
        """Bytes/s of a host copy: configured, else measured, else the default."""
        if self.copy_bandwidth is not None:
            return self.copy_bandwidth
        if self.copy_seconds > 0:
            return self.copied_bytes / self.copy_seconds
        return DEFAULT_COPY_BANDWIDTH

    @property
    def seconds_per_token(self) -> float:
        """Prefill seconds per token: configured, else measured, else the default."""
        if self.prefill_seconds_per_token is not None:
            return self.prefill_seconds_per_token
        if self.prefilled_tokens:
            return self.prefill_seconds / self.prefilled_tokens
        return DEFAULT_PREFILL_SECONDS_PER_TOKEN

    def swap_seconds(self, num_blocks: int, num_window_blocks: int = 0) -> float:
        nbytes = num_blocks * self.block_bytes + num_window_blocks * self.window_block_bytes
        return 2 * nbytes / self.bandwidth

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens * self.seconds_per_token

    def prefer_swap(self, num_blocks: int, num_tokens: int, num_window_blocks: int = 0) -> bool:
        return (self.swap_seconds(num_blocks, num_window_blocks)
                < self.recompute_seconds(num_tokens))
