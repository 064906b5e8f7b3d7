"""KV slot allocator over the worker's pool capacity. Slot 0 is padding, never handed out."""


class OutOfSlots(RuntimeError):
    pass


class SlotAllocator:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free = list(range(capacity, 0, -1))   # pop() hands out low ids first
        self._is_free = bytearray([0]) + bytearray([1]) * capacity

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfSlots(f"asked for {n} slots, {len(self._free)} free")
        slots = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        for s in slots:
            self._is_free[s] = 0
        return slots

    def free(self, slots: list[int]) -> None:
        """Return slots; a list with any slot that is not allocated changes nothing."""
        if len(set(slots)) != len(slots):
            raise ValueError("freeing the same slot twice")
        for s in slots:
            if not 1 <= s <= self.capacity or self._is_free[s]:
                raise ValueError(f"freeing slot {s} that is not allocated")
        for s in slots:
            self._is_free[s] = 1
        self._free += slots

    def check_integrity(self) -> None:
        """free + used == capacity, no slot free twice, slot 0 never free."""
        assert self._is_free[0] == 0, "padding slot 0 is marked free"
        assert len(set(self._free)) == len(self._free), "a slot is on the free list twice"
        assert all(self._is_free[s] for s in self._free), "free list and bitmap disagree"
        assert sum(self._is_free) == len(self._free), "bitmap counts a slot not on the free list"
        assert all(1 <= s <= self.capacity for s in self._free), "free slot out of range"
