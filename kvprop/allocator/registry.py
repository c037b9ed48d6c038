"""Which manager class serves which attention spec; a bug variant swaps one entry (``Parts``)."""

from __future__ import annotations

from kvprop.allocator.group_managers import ChunkedLocalManager, FullAttentionManager, SlidingWindowManager
from kvprop.allocator.mamba import MambaManager
from kvprop.allocator.specs import ChunkedLocal, FullAttention, Mamba, SlidingWindow

MANAGER_FOR_SPEC = {
    FullAttention: FullAttentionManager,
    SlidingWindow: SlidingWindowManager,
    ChunkedLocal: ChunkedLocalManager,
    Mamba: MambaManager,
}
