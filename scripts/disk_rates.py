"""The raw sequential write and read rates of the disk under a directory (for the disk tier).

Writes one large file with the disk tier's own I/O engine (``megatrain_hf.core.disk_io``: O_DIRECT
where the filesystem allows it, ``--request-mib`` requests, ``--threads`` in flight), fsyncs it,
then reads it back; prints JSON (GB/s = 10**9 bytes per second). O_DIRECT bypasses the page cache,
so the read is the disk's; without it (tmpfs) the numbers are memory copies and say so.

    python scripts/disk_rates.py --dir /nvme/tmp --gib 8 --threads 1 4 8
"""

from __future__ import annotations

import argparse
import json
import os
import time

from megatrain_hf.core.disk_io import DiskIO, aligned_empty


def measure(directory: str, nbytes: int, threads: int, request_bytes: int, buffer_bytes: int) -> dict:
    io = DiskIO(threads=threads, request_bytes=request_bytes)
    path = os.path.join(directory, f".megatrain-disk-rates-{os.getpid()}")
    buffer = aligned_empty(buffer_bytes)
    buffer.random_(0, 255)  # incompressible
    try:
        fd = io.create(path, nbytes)
        direct = io.direct[fd]
        start = time.perf_counter()
        pending = [io.write(fd, buffer, offset) for offset in range(0, nbytes, buffer_bytes)]
        for p in pending:
            p.wait()
        io.sync(fd)
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        # reads into one buffer: each window of len(buffer) is waited for before the next is issued
        for offset in range(0, nbytes, buffer_bytes):
            io.read(fd, buffer, offset).wait()
        read_s = time.perf_counter() - start
    finally:
        io.shutdown()
        if os.path.exists(path):
            os.unlink(path)
    return {"threads": threads, "request_MiB": request_bytes / 2**20, "o_direct": direct, "bytes": nbytes,
            "write_GBps": nbytes / write_s / 1e9, "read_GBps": nbytes / read_s / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True, help="a directory on the disk to measure")
    parser.add_argument("--gib", type=float, default=4.0, help="file size in GiB (default 4)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--request-mib", type=int, default=4)
    parser.add_argument("--buffer-mib", type=int, default=256, help="bytes per submitted write/read (default 256)")
    args = parser.parse_args()
    nbytes = int(args.gib * 2**30) // (args.buffer_mib * 2**20) * (args.buffer_mib * 2**20)
    rows = [measure(args.dir, nbytes, t, args.request_mib * 2**20, args.buffer_mib * 2**20) for t in args.threads]
    best = {"write_GBps": max(r["write_GBps"] for r in rows), "read_GBps": max(r["read_GBps"] for r in rows)}
    print(json.dumps({"dir": os.path.abspath(args.dir), "runs": rows, "raw": best}, indent=2))


if __name__ == "__main__":
    main()
