"""CPU launchers for the two Triton kernels the paged allocator of SGLang 0.5.18 to 0.5.21 launches.

``PagedTokenToKVPoolAllocator.alloc_extend`` / ``alloc_decode`` in those releases
(``sglang/srt/mem_cache/allocator/paged.py``) launch ``alloc_extend_kernel[(bs,)](...)`` and
``alloc_decode_kernel[(bs,)](...)``, Triton kernels with no CPU branch (from 0.5.22 the class
takes its own torch path on a CPU, ``Release.paged_torch_path``, so nothing here is used there). Every other part of the
allocator (``free_pages`` bookkeeping, ``get_num_new_pages``, frees, free groups) stays SGLang's.
The launchers compute the same ``out_indices`` with SGLang's own torch code:

* extend: ``alloc_extend_naive`` (paged.py), the reference the NPU allocator falls back to;
* decode: the formula of ``NPUPagedTokenToKVPoolAllocator.alloc_decode`` (``last_loc + 1``, or the
  first token of the next free page when a sequence starts a page).

``install`` rebinds the two module globals of ``sglang.srt.mem_cache.allocator.paged``.
"""

from __future__ import annotations


class _ExtendLauncher:
    """``alloc_extend_kernel[grid](...)``: ``alloc_extend_naive`` writes ``out_indices``."""

    def __getitem__(self, grid):
        from sglang.srt.mem_cache.allocator.paged import alloc_extend_naive

        def launch(prefix_lens, seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size):
            alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size, out_indices.device)

        return launch


class _DecodeLauncher:
    """``alloc_decode_kernel[grid](...)``: one slot per request, a new page where one starts."""

    def __getitem__(self, grid):
        import torch

        def launch(seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size):
            need_new = (seq_lens % page_size == 1).to(torch.int64) if page_size > 1 else torch.ones_like(seq_lens)
            start_new = torch.cumsum(need_new, 0) - need_new
            if int(need_new.sum()):
                new_pages = free_pages[start_new.clamp(max=max(len(free_pages) - 1, 0))]
            else:
                new_pages = torch.zeros_like(seq_lens)
            out_indices[:] = torch.where(need_new.bool(), new_pages * page_size, last_loc + 1)

        return launch


def install() -> None:
    """Point the paged allocator at the CPU launchers (idempotent)."""
    import sglang.srt.mem_cache.allocator.paged as paged

    if not isinstance(paged.alloc_extend_kernel, _ExtendLauncher):
        paged.alloc_extend_kernel = _ExtendLauncher()
        paged.alloc_decode_kernel = _DecodeLauncher()
