# A bounded ring that drops the oldest item when full and counts what it dropped.
# Every queue on the board is one of these: memory stays fixed whatever the link does.
# Only the methods the board calls: each one is loaded into the board heap.


class Ring:
    def __init__(self, capacity):
        if capacity < 1:
            raise ValueError("ring capacity must be >= 1")
        self._items = [None] * capacity
        # A plain attribute, not a property: the size of _items, fixed for the ring's life.
        self.capacity = capacity
        self._head = 0  # index of the oldest item
        self._len = 0
        self.dropped = 0

    def __len__(self):
        return self._len

    def push(self, x):
        cap = self.capacity
        if self._len == cap:
            # Full: overwrite the oldest slot and move the head past it.
            self._items[self._head] = x
            self._head = (self._head + 1) % cap
            self.dropped += 1
        else:
            self._items[(self._head + self._len) % cap] = x
            self._len += 1

    def pop(self):
        # Oldest first; raises IndexError when empty, like list.pop.
        if self._len == 0:
            raise IndexError("pop from empty ring")
        item = self._items[self._head]
        self._items[self._head] = None
        self._head = (self._head + 1) % self.capacity
        self._len -= 1
        return item

    def at(self, k):
        # The k-th oldest item (0 is the oldest), without removing anything.
        if not 0 <= k < self._len:
            raise IndexError("ring index")
        return self._items[(self._head + k) % self.capacity]

    def __iter__(self):
        # Oldest to newest, without removing anything.
        cap = self.capacity
        for n in range(self._len):
            yield self._items[(self._head + n) % cap]
