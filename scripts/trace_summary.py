"""Condense a Chrome trace of one training step (``megatrain bench --profile``) into text.

    python scripts/trace_summary.py OUT/logs/megatrain.json.trace.json [--gaps 15]

Prints, for the recorded step: each CUDA stream's busy time (union of its kernels and copies) and
its copies by direction; the compute stream's idle gaps, longest first, with what the host was
doing then; and the ``megatrain.*`` ranges (unit updates on the host and device workers) per
thread. Times are milliseconds from the first GPU event.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data  # the object or the bare-list form
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def total(intervals) -> float:
    return sum(b - a for a, b in intervals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--gaps", type=int, default=15, help="longest compute-stream gaps to list")
    args = ap.parse_args()
    events = load(args.trace)
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    ranges = [e for e in events if e.get("cat") in ("user_annotation", "cpu_op") and e["name"].startswith("megatrain.")]
    if not gpu:
        print("no GPU events in the trace (a CPU run)")
        show_ranges(ranges, min((e["ts"] for e in events), default=0))
        return
    t0 = min(e["ts"] for e in gpu)
    t1 = max(e["ts"] + e["dur"] for e in gpu)
    print(f"GPU span {(t1 - t0) / 1e3:.1f} ms, {len(gpu)} GPU events")

    by_stream: dict[object, list[dict]] = collections.defaultdict(list)
    for e in gpu:
        by_stream[e.get("args", {}).get("stream", e.get("tid"))].append(e)
    kernel_time = {s: sum(e["dur"] for e in es if e["cat"] == "kernel") for s, es in by_stream.items()}
    compute = max(kernel_time, key=kernel_time.get)
    print("\nstream    busy ms  kernels ms  HtoD ms (GB)     DtoH ms (GB)")
    for s, es in sorted(by_stream.items(), key=lambda kv: -total(union([(e["ts"], e["ts"] + e["dur"]) for e in kv[1]]))):
        busy = total(union([(e["ts"], e["ts"] + e["dur"]) for e in es]))
        copies = {"HtoD": [0.0, 0.0], "DtoH": [0.0, 0.0]}
        for e in es:
            if e["cat"] != "gpu_memcpy":
                continue
            kind = "HtoD" if "HtoD" in e["name"] else "DtoH" if "DtoH" in e["name"] else None
            if kind:
                copies[kind][0] += e["dur"]
                copies[kind][1] += e.get("args", {}).get("bytes", 0)
        mark = " (compute)" if s == compute else ""
        print(f"{str(s):>6} {busy / 1e3:10.1f} {kernel_time[s] / 1e3:10.1f} "
              f"{copies['HtoD'][0] / 1e3:9.1f} ({copies['HtoD'][1] / 1e9:5.2f}) "
              f"{copies['DtoH'][0] / 1e3:9.1f} ({copies['DtoH'][1] / 1e9:5.2f}){mark}")

    busy = union([(e["ts"], e["ts"] + e["dur"]) for e in by_stream[compute]])
    gaps = [(b[0] - a[1], a[1], b[0]) for a, b in zip(busy, busy[1:])]
    print(f"\ncompute stream: busy {total(busy) / 1e3:.1f} ms, idle {sum(g[0] for g in gaps) / 1e3:.1f} ms "
          f"in {len(gaps)} gaps ({sum(g[0] for g in gaps if g[0] > 1000) / 1e3:.1f} ms in gaps > 1 ms)")

    def host_doing(a: float, b: float) -> str:
        names = [e["name"] for e in ranges if e["ts"] < b and e["ts"] + e["dur"] > a]
        return ", ".join(sorted(set(names))[:4])

    print(f"\nlongest {args.gaps} compute-stream gaps (ms from start: length, megatrain ranges overlapping)")
    for length, a, b in sorted(gaps, reverse=True)[: args.gaps]:
        print(f"  at {(a - t0) / 1e3:8.1f}: {length / 1e3:7.2f}  {host_doing(a, b)}")

    show_ranges(ranges, t0)


def show_ranges(ranges: list[dict], t0: float) -> None:
    by_thread: dict[object, list[dict]] = collections.defaultdict(list)
    for e in ranges:
        by_thread[e.get("tid")].append(e)
    print("\nmegatrain ranges per thread (ms from start)")
    for tid, es in by_thread.items():
        es.sort(key=lambda e: e["ts"])
        names = collections.Counter(e["name"].split("[")[0] for e in es)
        spans = union([(e["ts"], e["ts"] + e["dur"]) for e in es])
        print(f"  thread {tid}: {dict(names)}; busy {total(spans) / 1e3:.1f} ms, "
              f"first {(es[0]['ts'] - t0) / 1e3:.1f}, last end {(max(e['ts'] + e['dur'] for e in es) - t0) / 1e3:.1f}")
        for e in es[:60]:
            print(f"      {e['name']:<40} {(e['ts'] - t0) / 1e3:8.1f} +{e['dur'] / 1e3:6.1f}")


if __name__ == "__main__":
    main()
