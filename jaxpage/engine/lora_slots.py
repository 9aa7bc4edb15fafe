"""Which LoRA adapter each device slot holds, and which adapters host memory holds (host
side, no JAX).

The runner keeps `max_loras + 1` slots of every projection's LoRA weights on the device
(slot 0: no adapter). A request runs only while its adapter holds a slot. `acquire` finds
it one when the scheduler admits the request: the slot it already holds, a free one, or
the least recently used slot whose adapter no running request uses; it returns None when
every slot is in use, and the scheduler admits other requests meanwhile. A slot given to a
new adapter is written before the step that first reads it (`take_loads`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxpage.lora import LoRARequest, LoRAWeights


class LoRASlots:
    """Slots 1..max_loras and the adapter (its lora_int_id) each holds, least recently
    used first."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slots: collections.OrderedDict[int, int] = collections.OrderedDict()  # id -> slot
        self._loads: list[tuple[int, int]] = []  # (slot, id) to write before the next step
        self.num_loads = 0

    def slot_of(self, lora_id: int | None) -> int:
        """The slot `lora_id` holds (0 for None: the base model)."""
        return 0 if lora_id is None else self._slots[lora_id]

    def holds(self, lora_id: int) -> bool:
        return lora_id in self._slots

    def resident(self) -> list[int]:
        """The adapters holding a slot, least recently used first."""
        return list(self._slots)

    def acquire(self, lora_id: int, in_use: Callable[[], Collection[int]]) -> int | None:
        """A slot holding `lora_id` for a request about to run: its own (marked most
        recently used), a free one, or the least recently used one whose adapter is not
        `in_use()` (by a running request: asked only when a slot must be taken), to be
        written (`take_loads`); None if none is."""
        slot = self._slots.get(lora_id)
        if slot is not None:
            self._slots.move_to_end(lora_id)
            return slot
        free = set(range(1, self.max_loras + 1)) - set(self._slots.values())
        if free:
            slot = min(free)
        else:
            users = in_use()
            victim = next((other for other in self._slots if other not in users), None)
            if victim is None:
                return None
            slot = self._slots.pop(victim)
            self._loads = [(s, i) for s, i in self._loads if i != victim]
        self._slots[lora_id] = slot
        self._loads.append((slot, lora_id))
        self.num_loads += 1
        return slot

    def release(self, lora_id: int) -> None:
        """Forget `lora_id`'s slot (the adapter was removed); its slot is free again."""
        self._slots.pop(lora_id, None)
        self._loads = [(s, i) for s, i in self._loads if i != lora_id]

    def take_loads(self) -> list[tuple[int, int]]:
        """The (slot, lora_int_id) writes due before the next step, once."""
        loads, self._loads = self._loads, []
        return loads

    def reset(self) -> None:
        """Every slot free (the device's slots were lost with the device state)."""
        self._slots.clear()
        self._loads.clear()


class LoRARegistry:
    """The adapters an engine knows, by lora_int_id, and those read into host memory: at
    most `max_cpu_loras`, least recently used dropped first, except that an adapter with
    unfinished requests always stays (`hold` / `let_go`). `read` reads one from its
    directory (jaxpage.lora.read_peft_adapter), raising ValueError for a bad one."""

    def __init__(self, max_cpu_loras: int, read: Callable[[LoRARequest], LoRAWeights]) -> None:
        self.max_cpu_loras = max_cpu_loras
        self._read = read
        self.known: dict[int, LoRARequest] = {}
        self._weights: collections.OrderedDict[int, LoRAWeights] = collections.OrderedDict()
        self._users: collections.Counter[int] = collections.Counter()

    def add(self, request: LoRARequest) -> None:
        """Know `request`'s adapter, read (and so checked) now; a ValueError if it is bad or
        its id or name is another adapter's."""
        lora_id = request.lora_int_id
        known = self.known.get(lora_id)
        if known is not None and known != request:
            raise ValueError(f"lora_int_id {lora_id} is already adapter {known.lora_name!r} "
                             f"({known.lora_path}); got {request.lora_name!r} "
                             f"({request.lora_path})")
        same_name = next((r for r in self.known.values() if r.lora_name == request.lora_name
                          and r.lora_int_id != lora_id), None)
        if same_name is not None:
            raise ValueError(f"lora_name {request.lora_name!r} is already adapter "
                             f"{same_name.lora_int_id}")
        self.weights(lora_id, request)
        self.known[lora_id] = request

    def weights(self, lora_id: int, request: LoRARequest | None = None) -> LoRAWeights:
        """The adapter's weights, read again if they were dropped."""
        weights = self._weights.get(lora_id)
        if weights is None:
            weights = self._read(request or self.known[lora_id])
            self._weights[lora_id] = weights
        self._weights.move_to_end(lora_id)
        self._trim()
        return weights

    def hold(self, lora_id: int) -> None:
        """An unfinished request uses the adapter: keep it in host memory."""
        self._users[lora_id] += 1

    def let_go(self, lora_id: int) -> None:
        self._users[lora_id] -= 1
        if self._users[lora_id] <= 0:
            del self._users[lora_id]
        self._trim()

    def in_use(self, lora_id: int) -> bool:
        return self._users[lora_id] > 0

    def remove(self, lora_id: int) -> LoRARequest:
        """Forget an adapter no unfinished request uses (a ValueError otherwise)."""
        if lora_id not in self.known:
            raise ValueError(f"no LoRA adapter with lora_int_id {lora_id}")
        if self.in_use(lora_id):
            raise ValueError(f"LoRA adapter {self.known[lora_id].lora_name!r} has "
                             f"{self._users[lora_id]} unfinished requests")
        self._weights.pop(lora_id, None)
        return self.known.pop(lora_id)

    def read_ids(self) -> list[int]:
        """The adapters in host memory, least recently used first."""
        return list(self._weights)

    def _trim(self) -> None:
        spare = [i for i in self._weights if not self.in_use(i)]
        for lora_id in spare[: max(0, len(self._weights) - self.max_cpu_loras)]:
            del self._weights[lora_id]
