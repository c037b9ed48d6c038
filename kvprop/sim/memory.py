"""Paged KV memory on a device: one tensor shared by all groups, as physical memory is.

Each computed position stores a fingerprint of (group, position, prefix). Shared prefix
blocks therefore hold identical data, and a block that is stale, reused, double-owned or
overwritten reads back wrong. Writes and checks are batched: one scatter, one gather and
one compare per call. On the CPU the scatters and gathers go through a numpy view of the
same tensor: a step writes a few slots per request, and torch's per-call cost (about 6 us
to index a handful of slots, numpy's 1 us) was a tenth of a walk.
"""

from __future__ import annotations

import torch

from kvprop.errors import ConfigError

UNWRITTEN = -1


def pick_device(device: str | None = None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but torch sees no CUDA device (torch {torch.__version__})")
    return torch.device(device)


class PagedMemory:
    def __init__(self, num_blocks: int, block_size: int, device: str | None = None):
        self.device = pick_device(device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.data = torch.full((num_blocks, block_size), UNWRITTEN, dtype=torch.int64, device=self.device)
        self.flat = self.data.view(-1)
        # the same memory as an array, where the tensor is host memory; None on a device
        self.host = self.flat.numpy() if self.device.type == "cpu" else None
        self.recent: list | None = None  # (slots, values) of writes since a checker last looked, when it asks
        self.copied: set = set()  # slots a block copy filled, until a write replaces them

    def take_recent_writes(self) -> tuple[list[int], list[int], list[int]]:
        """Every write since the last call, flattened, and the slots a block copy filled since
        then that no write has replaced (what they must hold is the checker's to say: the copy
        brings whatever its source held); starts recording on the first call."""
        slots, values = [], []
        for s, v in self.recent or ():
            slots.extend(s)
            values.extend(v)
        copied = sorted(self.copied)
        self.recent, self.copied = [], set()
        return slots, values, copied

    def _index(self, slots) -> torch.Tensor:
        return torch.as_tensor(slots, dtype=torch.int64, device=self.device)

    def write(self, slots: list[int], values: list[int]) -> None:
        if slots:
            if self.host is not None:
                self.host[slots] = values
            else:
                self.flat[self._index(slots)] = torch.as_tensor(values, dtype=torch.int64, device=self.device)
            if self.recent is not None:
                self.recent.append((slots, values))
                if self.copied:
                    for slot in slots:
                        self.copied.discard(slot)

    def copy(self, source: int, dest: int) -> None:
        """Copy one slot over another that this step may already have written: a worker's
        state copy replaces that write, so the checker's record of it is replaced too (the
        hook before the copy has judged the source)."""
        value = self.flat[source].item()
        self.flat[dest] = value
        if self.recent is not None:
            self.recent = [
                ([s for s in slots if s != dest], [v for s, v in zip(slots, values) if s != dest])
                for slots, values in self.recent
            ]
            self.recent.append(([dest], [value]))

    def copy_block(self, source: int, dest: int) -> None:
        """Copy block ``source``'s slots over block ``dest``'s (a worker's block copy, before the
        step's forward pass). The checker's record of the copy gives way to a later write of
        the same slot: the request that owns the copy continues writing it in the same step."""
        bs = self.block_size
        src, dst = slice(source * bs, (source + 1) * bs), slice(dest * bs, (dest + 1) * bs)
        self.flat[dst] = self.flat[src]
        if self.recent is not None:
            self.copied.update(range(dst.start, dst.stop))

    def read(self, slots: list[int]) -> list[int]:
        if not slots:
            return []
        if self.host is not None:
            return self.host[slots].tolist()
        return self.flat[self._index(slots)].tolist()

    def rows(self, block_ids: list[int]) -> list[list[int]]:
        """The slots of each block in ``block_ids``, one list per block."""
        if self.host is not None:
            return self.host.reshape(self.num_blocks, self.block_size)[block_ids].tolist()
        return self.data[block_ids].tolist()

    def mismatches(self, slots: list[int], expected: list[int]) -> list[int]:
        """Indices into ``slots`` whose stored value differs from ``expected`` (usually none):
        one gather, read back as a list."""
        if not slots:
            return []
        got = self.read(slots)
        if got == expected:
            return []
        return [i for i, (a, b) in enumerate(zip(got, expected)) if a != b]

    def row(self, block_id: int) -> list[int]:
        return self.data[block_id].tolist()
