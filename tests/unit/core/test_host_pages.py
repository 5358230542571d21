"""Host pages given back (``core/host_pages.py``) and the gradient reduce in pieces (``core/sharding.py``)."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatrain_hf.core import host_pages, sharding


def _resident_pages(t: torch.Tensor) -> int:
    """How many of the pages under ``t``'s bytes are resident (``mincore``): this tensor's own pages,
    whatever the rest of the process allocates or frees meanwhile."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    page = 4096
    start = t.data_ptr() // page * page
    end = t.data_ptr() + t.numel() * t.element_size()
    n = -(-(end - start) // page)
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * page), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_DONTNEED) is Linux's")
def test_release_drops_the_whole_pages_and_keeps_the_edges():
    t = torch.ones(16 * 2**20 + 7)  # 64 MiB and a bit, resident
    view = t[3:]  # starts inside a page: that page's bytes before and at the edge are kept
    before = _resident_pages(t)
    assert host_pages.release(view)
    first, last = -(-view.data_ptr() // 4096), (view.data_ptr() + view.numel() * 4) // 4096
    assert before - _resident_pages(t) == last - first  # exactly the whole pages inside the view went back
    assert t[:3].eq(1).all() and t[-1] == 1  # outside the whole pages of the view: untouched
    assert t[2048 : 2**20].eq(0).all()  # inside: dropped (reads as zeros)
    view.fill_(2.0)  # usable again, resident where written
    assert t[3:].eq(2).all()
    assert not host_pages.release(t[::2])  # not contiguous: refused, nothing done


def test_trim_runs_or_says_it_cannot():
    assert isinstance(host_pages.trim(), bool)


_MMAP_LARGE_PROBE = """
import json, re, torch
from megatrain_hf.core import host_pages

def rss_kib():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\\s+(\\d+)", f.read()).group(1))

ok = host_pages.mmap_large()
t = torch.ones(2**21)  # a mapped 8 MiB block freed: glibc's default threshold would rise to it
del t
before = rss_kib()
blocks, kept = [], []
for _ in range(32):
    blocks.append(torch.ones(2**20))  # 4 MiB
    kept.append(torch.ones(2**14))  # 64 KiB from the heap between them, kept
grown = rss_kib()
del blocks
print(json.dumps({"ok": ok, "grew": grown - before, "dropped": grown - rss_kib()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_mmap_large_gives_freed_blocks_back_at_once():
    """Without it glibc serves blocks below its raised threshold from the heap, resident after free.

    Measured in a fresh interpreter: in the suite's process, memory that an earlier test's threads
    allocate or free during the measurement moved the resident size by several MiB either way."""
    out = subprocess.run(
        [sys.executable, "-c", _MMAP_LARGE_PROBE], capture_output=True, text=True, check=True, timeout=120
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["ok"]
    assert r["grew"] > 120 * 1024  # the 32 blocks (128 MiB) and the kept 2 MiB are resident
    assert r["dropped"] > 120 * 1024  # the blocks went back at once (without it: 0); the kept 2 MiB stay


def test_the_cpu_path_trims_after_enough_bytes_only(monkeypatch):
    """malloc_trim walks the heap: once per TRIM_EVERY_BYTES of units computed, not after every small unit."""
    from tests.helpers import tiny_model

    from megatrain_hf import MegaTrainConfig, attach
    from megatrain_hf.core import uploads as streamer  # (the CPU path's uploads trim the heap)

    calls = []
    monkeypatch.setattr(streamer.host_pages, "trim", lambda: calls.append(1) or True)
    model = tiny_model("llama")
    engine = attach(model, MegaTrainConfig(), device="cpu")
    assert calls == [1]  # once at attach: what filling the store left in the heap
    calls.clear()
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert calls == []  # the tiny model's units are far below the threshold
    monkeypatch.setattr(streamer.host_pages, "TRIM_EVERY_BYTES", 1)
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(calls) >= len(engine.store.entries)  # every fetch (forward and recompute) trims
    engine.detach()


def _reduce_worker(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    sharding.PIECE_NUMEL = 3  # 10 elements: pieces of 3, 3, 3, 1
    s = sharding.UnitSharding(num_units=2)
    g = torch.arange(10, dtype=torch.float32) * (rank + 1)
    # unit 0 (owner rank 0) and unit 1 (owner rank 1): the owner reduces into its region, the other sends g
    results = {}
    for u in (0, 1):
        if s.owns(u):
            dst = g.clone()
            s.reduce_grad_pieces(u, dst, dst, 10)
            results[u] = dst
        else:
            src = g.to(torch.bfloat16) if u == 1 else g.clone()  # any float dtype is sent as fp32
            s.reduce_grad_pieces(u, None, src, 10)
            assert src.float().equal(g)  # the sender's gradient is read, never written
    zero = torch.full((10,), 5.0)
    if s.owns(0):
        s.reduce_grad_pieces(0, zero, zero, 10)
    else:
        s.reduce_grad_pieces(0, None, None, 10)  # no contribution: zeros
    torch.save({"results": results, "zero": zero if s.owns(0) else None}, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow  # ~5-10 s: in `make test`, not in `make test-fast`
def test_gradient_reduce_in_pieces_sums_exactly_at_the_owner(tmp_path):
    init = f"file://{tmp_path / 'init'}"
    mp.spawn(_reduce_worker, args=(init, str(tmp_path / "r")), nprocs=2, join=True)
    r0, r1 = torch.load(f"{tmp_path / 'r'}.0"), torch.load(f"{tmp_path / 'r'}.1")
    expected = torch.arange(10, dtype=torch.float32) * 3  # rank 0's g + rank 1's (2 g)
    assert r0["results"][0].equal(expected) and r1["results"][1].equal(expected)
    assert r0["zero"].equal(torch.full((10,), 5.0))
