"""The disk tier's I/O engine against DeepSpeed's async I/O op (libaio) and ``dd``, on one directory.

The access pattern is the tier's (``optim/paged_state.py``): whole *unit files* of ``--unit-mib``
each (a 376 M-parameter Llama layer's fp32 moments are ~100 MB), ``O_DIRECT``, read and written
sequentially, reads and writes overlapping. For every engine configuration, on ``--gib`` of unit
files (created with ``posix_fallocate`` and filled once before anything is timed, so every timed
write overwrites real blocks, as the tier's steps after the first do):

* ``write_GBps``: all files written, ``--inflight`` requests at a time, then each file fsynced;
* ``read_GBps``: the page cache dropped (``/proc/sys/vm/drop_caches``, where permitted), all files read,
  ``--inflight`` at a time;
* ``overlap_GBps``: the tier's steady state: batches of 2 reads (the units read ahead) and 1 write
  (the unit written behind) in flight together, (bytes read + written) over the time; and
  ``overlap_cpu_s_per_GB``, the CPU time of the whole process (every thread, DeepSpeed's too) per GB moved.

Engines: ``threads`` is ``megatrain_hf.core.disk_io.DiskIO`` (``--threads`` x ``--request-mib``, buffers
from ``aligned_empty``); ``deepspeed`` is ``deepspeed.ops.op_builder.AsyncIOBuilder().load().aio_handle``
(``--ds-block-mib`` x ``--ds-queue-depth`` x ``--ds-threads`` (its ``intra_op_parallelism``),
``single_submit=False``, ``overlap_events=True`` as ZeRO-Infinity's defaults, one handle for reads and
one for writes as its parameter swapper has, buffers from ``new_cpu_locked_tensor`` so it needs no
bounce copy); ``dd`` is one ``dd`` stream of 8 MiB direct requests over one file of ``--gib``
(zeros written: a device that detects zero blocks would flatter the write). Prints JSON lines, one
per configuration and repetition, then per configuration the median and the best over ``--repeat`` passes. GB/s = 10**9 bytes/s.

    python scripts/disk_io_bench.py --dir /work/aio-bench --gib 4
    python scripts/disk_io_bench.py --dir /nvme/tmp --gib 8 --engines deepspeed --ds-block-mib 1 8
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import time

import torch

from megatrain_hf.core.disk_io import DiskIO, aligned_empty

MiB = 2**20
RATES = ("write_GBps", "read_GBps", "overlap_GBps")
RESULT_KEYS = RATES + ("overlap_cpu_s_per_GB", "caches_dropped", "repeat", "bytes", "unit_MiB")


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


class ThreadsEngine:
    """The tier's engine: fd-based requests, one ``Pending`` each."""

    def __init__(self, threads: int, request_mib: int) -> None:
        self.config = {"engine": "threads", "threads": threads, "request_MiB": request_mib}
        self.io = DiskIO(threads=threads, request_bytes=request_mib * MiB)
        self.fds: dict[str, int] = {}

    def buffer(self, nbytes: int) -> torch.Tensor:
        return aligned_empty(nbytes)

    def _fd(self, path: str) -> int:
        if path not in self.fds:
            self.fds[path] = self.io.open(path)
            if not self.io.direct[self.fds[path]]:
                raise RuntimeError(f"{path}: O_DIRECT not taken; the numbers would be the page cache's")
        return self.fds[path]

    def submit(self, op: str, path: str, buffer: torch.Tensor):
        fd = self._fd(path)
        return (self.io.read if op == "read" else self.io.write)(fd, buffer, 0)

    def wait(self, pending: list) -> None:
        for p in pending:
            p.wait()

    def close(self) -> None:
        self.io.shutdown()


class DeepSpeedEngine:
    """DeepSpeed's ``aio_handle``: filename-based requests; ``wait()`` waits for all of a handle's."""

    def __init__(self, module, block_mib: int, queue_depth: int, threads: int) -> None:
        self.config = {"engine": "deepspeed", "block_MiB": block_mib, "queue_depth": queue_depth, "threads": threads}
        make = lambda: module.aio_handle(block_mib * MiB, queue_depth, False, True, threads)  # noqa: E731
        self.handles = {"read": make(), "write": make()}
        self.counts = {"read": 0, "write": 0}

    def buffer(self, nbytes: int) -> torch.Tensor:
        return self.handles["read"].new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))

    def submit(self, op: str, path: str, buffer: torch.Tensor):
        call = self.handles[op].async_pread if op == "read" else self.handles[op].async_pwrite
        if call(buffer, path, 0) != 0:
            raise OSError(f"deepspeed aio_handle.async_p{op}({path}) refused the request")
        self.counts[op] += 1
        return op

    def wait(self, pending: list) -> None:
        for op in ("read", "write"):
            if self.counts[op]:
                done = self.handles[op].wait()
                if done != self.counts[op]:
                    raise RuntimeError(f"deepspeed aio_handle.wait() completed {done} of {self.counts[op]} {op}s")
                self.counts[op] = 0

    def close(self) -> None:
        pass  # the locked buffers are freed when the handles go (the test process ends soon after)


def fill(paths: list[str], unit_bytes: int) -> None:
    """Create the unit files and write random bytes into them once (not timed)."""
    io = DiskIO(threads=4)
    buffer = aligned_empty(unit_bytes)
    buffer.random_(0, 255)
    try:
        for path in paths:
            io.write(io.create(path, unit_bytes), buffer, 0).wait()
    finally:
        io.shutdown()


def fsync_all(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def measure(engine, paths: list[str], unit_bytes: int, inflight: int) -> dict:
    slots = [engine.buffer(unit_bytes) for _ in range(max(inflight, 3))]
    for s in slots:
        s.random_(0, 255)
    unit = len(paths) * unit_bytes

    def batches(op: str, files: list[str]) -> float:
        start = time.perf_counter()
        for i in range(0, len(files), inflight):
            engine.wait([engine.submit(op, p, slots[k]) for k, p in enumerate(files[i : i + inflight])])
        if op == "write":
            fsync_all(files)
        return time.perf_counter() - start

    row = dict(engine.config)
    row["write_GBps"] = unit / batches("write", paths) / 1e9
    row["caches_dropped"] = drop_caches()
    row["read_GBps"] = unit / batches("read", paths) / 1e9
    # steady state: read the next two units while the previous one is written back
    half = len(paths) // 2
    moved, start, cpu = 0, time.perf_counter(), time.process_time()
    for i in range(0, half - 1, 2):
        pending = [engine.submit("read", paths[i], slots[0]), engine.submit("read", paths[i + 1], slots[1]),
                   engine.submit("write", paths[half + i // 2], slots[2])]
        engine.wait(pending)
        moved += 3 * unit_bytes
    fsync_all(paths[half:])
    row["overlap_GBps"] = moved / (time.perf_counter() - start) / 1e9
    row["overlap_cpu_s_per_GB"] = (time.process_time() - cpu) / (moved / 1e9)  # all the process's threads
    return row


def dd(directory: str, nbytes: int) -> dict:
    path = os.path.join(directory, f"dd-{os.getpid()}")
    count = nbytes // (8 * MiB)
    try:
        start = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=8M", f"count={count}", "oflag=direct",
                        "conv=fdatasync"], check=True, capture_output=True)
        write_s = time.perf_counter() - start
        dropped = drop_caches()
        start = time.perf_counter()
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=8M", "iflag=direct"], check=True, capture_output=True)
        read_s = time.perf_counter() - start
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return {"engine": "dd", "request_MiB": 8, "write_GBps": count * 8 * MiB / write_s / 1e9,
            "caches_dropped": dropped, "read_GBps": count * 8 * MiB / read_s / 1e9}


def load_deepspeed():
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().load(verbose=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True, help="a directory on the disk to measure (files removed after)")
    parser.add_argument("--gib", type=float, default=4.0, help="bytes of unit files, GiB (default 4)")
    parser.add_argument("--unit-mib", type=int, default=96, help="one unit file, MiB (default 96)")
    parser.add_argument("--inflight", type=int, default=2, help="requests in flight in the write and read phases")
    parser.add_argument("--engines", nargs="+", default=["threads", "deepspeed", "dd"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--request-mib", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--ds-block-mib", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--ds-queue-depth", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--ds-threads", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeat", type=int, default=1, help="passes over all configurations, every other one in reverse order")
    parser.add_argument("--full-grid", action="store_true",
                        help="every combination; default: each knob varied around the defaults (4 threads x 4 MiB; "
                             "DeepSpeed 1 MiB x depth 8 x 1 thread) plus each block size at each depth")
    args = parser.parse_args()

    unit_bytes = args.unit_mib * MiB
    units = max(4, int(args.gib * 2**30) // unit_bytes)
    configs = []
    if "threads" in args.engines:
        grid = (itertools.product(args.threads, args.request_mib) if args.full_grid else
                sorted({(t, 4) for t in args.threads} | {(4, r) for r in args.request_mib}))
        configs += [("threads", c) for c in grid]
    module = None
    if "deepspeed" in args.engines:
        module = load_deepspeed()
        grid = (itertools.product(args.ds_block_mib, args.ds_queue_depth, args.ds_threads) if args.full_grid else
                sorted({(b, q, 1) for b in args.ds_block_mib for q in args.ds_queue_depth}
                       | {(1, 8, t) for t in args.ds_threads}))
        configs += [("deepspeed", c) for c in grid]

    run_dir = os.path.join(os.path.abspath(args.dir), f"disk-io-bench-{os.getpid()}")
    os.makedirs(run_dir)
    paths = [os.path.join(run_dir, f"unit-{i:05d}.state") for i in range(units)]
    rows = []
    try:
        fill(paths, unit_bytes)
        for rep in range(args.repeat):
            for kind, c in (configs if rep % 2 == 0 else configs[::-1]):  # odd passes reversed: no order bias
                engine = ThreadsEngine(*c) if kind == "threads" else DeepSpeedEngine(module, *c)
                try:
                    row = measure(engine, paths, unit_bytes, args.inflight)
                finally:
                    engine.close()
                row.update(repeat=rep, bytes=units * unit_bytes, unit_MiB=args.unit_mib)
                rows.append(row)
                print(json.dumps(row), flush=True)
            if "dd" in args.engines:
                row = dd(run_dir, units * unit_bytes)
                row["repeat"] = rep
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)
        os.rmdir(run_dir)
    print(json.dumps({"dir": os.path.abspath(args.dir), "units": units, "unit_MiB": args.unit_mib,
                      "median": summarize(rows, statistics.median, RATES + ("overlap_cpu_s_per_GB",)), "best": summarize(rows, max)}, indent=2))


def summarize(rows: list[dict], reduce, keys=RATES) -> dict:
    """Per configuration (engine and knobs), ``reduce`` over the repetitions of each rate."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        key = " ".join(f"{k}={v}" for k, v in r.items() if k not in RESULT_KEYS)
        groups.setdefault(key, []).append(r)
    return {key: {k: round(reduce(r[k] for r in rs), 3) for k in keys if k in rs[0]} for key, rs in groups.items()}


if __name__ == "__main__":
    main()
