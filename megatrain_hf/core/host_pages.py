"""Giving host memory back to the OS: the pages of an idle buffer, and the allocator's free heap.

* :func:`release` drops the physical pages under a CPU tensor's whole pages (``madvise(MADV_DONTNEED)``
  on Linux): the memory stays allocated, its contents read as zeros afterwards, and it is resident
  again only where written. For buffers whose contents are dead until they are written again (a
  receive slot between two units); never for pinned (CUDA-registered) memory.
* :func:`trim` returns the free memory at the top and inside of glibc's heap (``malloc_trim(0)``):
  the many small and mid-sized tensors a unit's computation frees stay in the heap otherwise.

* :func:`mmap_large` makes glibc serve every allocation from ``MMAP_THRESHOLD_BYTES`` up with a
  mapping of its own (``mallopt(M_MMAP_THRESHOLD)``), unmapped when freed. By default the threshold
  rises to the size of each mapped block freed (up to 32 MiB), and from then on blocks of that size
  (a decoder layer's weight gradients on the CPU: 3-9 MB each) come from the heap, where freed ones
  stay resident until a trim: on the CPU path, 50-70 MB a layer of backward between two trims.

All are no-ops (returning False) where the calls do not exist (not Linux, not glibc); importing
this module never fails.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

logger = logging.getLogger(__name__)

TRIM_EVERY_BYTES = 128 * 2**20
"""The CPU path trims the heap once units of this many bytes in all were fetched since the last trim:
``malloc_trim`` walks the whole heap (tens of ms), worth it after large units, not after every small one."""

MMAP_THRESHOLD_BYTES = 128 * 2**10
"""Allocations from this size up are mapped, given back at free, on the CPU path (:func:`mmap_large`): glibc's
initial threshold, kept from rising (1 MiB measured the same on the 558 M benchmark, docs/log.md)."""

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_MADV_DONTNEED = 4  # Linux
_PAGE = 4096
_libc = None
_loaded = False


def _lib():
    global _libc, _loaded
    if not _loaded:
        _loaded = True
        if sys.platform.startswith("linux"):
            try:
                _libc = ctypes.CDLL(None, use_errno=True)
                _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
                _libc.madvise.restype = ctypes.c_int
            except (OSError, AttributeError):
                _libc = None
    return _libc


def release(t: torch.Tensor) -> bool:
    """Drop the pages wholly inside ``t``'s bytes (a contiguous CPU tensor); True if done."""
    lib = _lib()
    if lib is None or t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first = -(-start // _PAGE) * _PAGE
    last = end // _PAGE * _PAGE
    if last <= first:
        return False
    if lib.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED) != 0:
        logger.debug("madvise(MADV_DONTNEED) failed: errno %d", ctypes.get_errno())
        return False
    return True


def trim() -> bool:
    """glibc ``malloc_trim(0)``; True if it ran (and returned memory), False elsewhere."""
    lib = _lib()
    fn = getattr(lib, "malloc_trim", None) if lib is not None else None
    if fn is None:
        return False
    return bool(fn(ctypes.c_size_t(0)))


def mmap_large(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """glibc ``mallopt(M_MMAP_THRESHOLD, threshold)`` (which also stops its dynamic adjustment), for the
    whole process; True if it ran. Smaller blocks still come from the heap (and :func:`trim`)."""
    lib = _lib()
    fn = getattr(lib, "mallopt", None) if lib is not None else None
    if fn is None:
        return False
    return bool(fn(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(threshold)))
