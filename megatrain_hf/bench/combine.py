"""One report from several ``megatrain bench`` runs of the same workload.

A run of every system does not fit one bounded device call, so the GPU suite runs the systems of
one workload in several invocations; this puts their results side by side afterwards, on any
machine (no torch, no GPU)::

    python -m megatrain_hf.bench.combine --out combined/ part1/results.json part2/results.json

The workloads must be equal (the same check as ``--merge``, both ways); a system in several
files is taken from the last. Each result keeps where it came from (``source``: file, commit,
date), and the report lists the invocations; the meta section (hardware, versions) is the first
file's, the others' hardware is compared and a difference is stated.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from ..errors import MegatrainConfigError
from .report import write_reports
from .runner import _same_workload
from .systems import SYSTEMS

logger = logging.getLogger(__name__)


def combine(reports: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The combined report of ``(name, results.json contents)`` pairs; ValueError on a workload mismatch."""
    if not reports:
        raise MegatrainConfigError("no results to combine")
    first_name, first = reports[0]
    workload = first["workload"]
    results: dict[str, Any] = {}
    sources = []
    for name, report in reports:
        other = report.get("workload") or {}
        if not (_same_workload(other, workload) and _same_workload(workload, other)):
            raise MegatrainConfigError(f"{name}: workload {other} differs from {first_name}'s {workload}")
        meta = report.get("meta", {})
        source = {"file": name, "git_commit": meta.get("git", {}).get("commit"),
                  "created_utc": meta.get("created_utc"), "gpus": meta.get("hardware", {}).get("gpus")}
        sources.append(source)
        for system, result in report.get("results", {}).items():
            results[system] = {**result, "source": source}
    meta = dict(first["meta"])
    meta["combined_from"] = sources
    different = sorted({str(s["gpus"]) for s in sources})
    if len(different) > 1:
        meta["combined_note"] = f"the invocations ran on different GPUs: {'; '.join(different)}"
    order = [s for s in SYSTEMS if s in results] + sorted(s for s in results if s not in SYSTEMS)
    return {"meta": meta, "workload": workload, "results": {s: results[s] for s in order}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatrain_hf.bench.combine", description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="results.json files of megatrain bench, same workload")
    parser.add_argument("--out", type=Path, required=True, help="folder for the combined results.json/.md/.png")
    args = parser.parse_args(argv)
    try:
        combined = combine([(str(p), json.loads(p.read_text())) for p in args.results])
    except (OSError, ValueError, KeyError) as exc:
        parser.exit(2, f"combine: error: {exc}\n")
    paths = write_reports(combined, args.out)
    print(paths["markdown"].read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
