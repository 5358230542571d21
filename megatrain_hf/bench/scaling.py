"""Depth and width scaling from several ``megatrain bench`` runs: a table, a chart and the verdict.

The memory issue's demonstrations: at fixed width, the GPU peak must stay flat with depth (within
10 %) and the throughput per layer too (within 15 %); at fixed depth, wider models must keep
running until host RAM is the limit. Each argument is a ``results.json`` written by
``megatrain bench`` (one model shape each; the megatrain row is read)::

    python -m megatrain_hf.bench.scaling --out scaling/ depth32/results.json depth48/results.json ...

writes ``scaling/scaling.md`` (the numbers, the spread of each quantity and whether it is within
its bound) and ``scaling/scaling.png``. "Throughput per layer" is layers x tokens / step time:
the rate at which layer-tokens are processed, flat when every layer costs the same.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from ..errors import MegatrainConfigError

logger = logging.getLogger(__name__)

GPU_PEAK_BOUND = 0.10  # relative spread allowed across depths
PER_LAYER_BOUND = 0.15


def load_points(paths: list[Path], system: str = "megatrain") -> list[dict[str, Any]]:
    """One point per results file: shape, GPU peak, host peak, tokens/s and layer-tokens/s."""
    points = []
    for path in paths:
        report = json.loads(Path(path).read_text())
        result = report.get("results", {}).get(system)
        if result is None or result.get("status") != "ok":
            status = "missing" if result is None else f"{result.get('status')}: {result.get('reason', '')}"
            raise MegatrainConfigError(
                f"{path}: no successful '{system}' result ({status}); rerun it or leave the file out")
        shape = report["workload"]["shape"]
        tokens_per_step = report["workload"]["tokens_per_step"]
        step = result["step_time_mean_s"]
        points.append({
            "file": str(path),
            "layers": shape["layers"],
            "hidden": shape["hidden"],
            "params": result.get("params"),
            "tokens_per_s": result["tokens_per_s"],
            "layer_tokens_per_s": shape["layers"] * tokens_per_step / step,
            "gpu_peak_gib": result.get("gpu_peak_allocated_gib"),
            "host_peak_gib": result.get("host_peak_rss_gib"),
            "commit": report.get("meta", {}).get("git", {}).get("commit"),
        })
    return sorted(points, key=lambda p: (p["hidden"], p["layers"]))


def spread(values: list[float]) -> float:
    """(max - min) / min of the values (0 for fewer than two)."""
    values = [v for v in values if v is not None]
    if len(values) < 2 or min(values) <= 0:
        return 0.0
    return (max(values) - min(values)) / min(values)


def verdict(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Depth scaling (points sharing one width): GPU peak and layer-tokens/s spreads against bounds."""
    widths = {p["hidden"] for p in points}
    out: dict[str, Any] = {"kind": "depth" if len(widths) == 1 else "width", "points": len(points)}
    if out["kind"] == "depth":
        gpu = [p["gpu_peak_gib"] for p in points]
        out["gpu_peak_spread"] = spread(gpu) if all(v is not None for v in gpu) else None
        out["layer_tokens_spread"] = spread([p["layer_tokens_per_s"] for p in points])
        out["gpu_peak_flat"] = None if out["gpu_peak_spread"] is None else out["gpu_peak_spread"] <= GPU_PEAK_BOUND
        out["per_layer_flat"] = out["layer_tokens_spread"] <= PER_LAYER_BOUND
    return out


def render(points: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    def fmt(v, spec):
        return "—" if v is None else format(v, spec)

    lines = [f"# megatrain {summary['kind']} scaling", "",
             "| layers | hidden | params | tokens/s | layer-tokens/s | GPU peak (GiB) | host peak RSS (GiB) | commit |",
             "|---|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['layers']} | {p['hidden']} | {fmt(p['params'] and p['params'] / 1e9, '.2f')} B | "
                     f"{p['tokens_per_s']:,.0f} | {p['layer_tokens_per_s']:,.0f} | {fmt(p['gpu_peak_gib'], '.2f')} | "
                     f"{fmt(p['host_peak_gib'], '.2f')} | {p['commit'] or '—'} |")
    lines.append("")
    if summary["kind"] == "depth":
        gpu = summary["gpu_peak_spread"]
        lines.append(f"- GPU peak spread across depths: {fmt(gpu and 100 * gpu, '.1f')} % (bound "
                     f"{100 * GPU_PEAK_BOUND:.0f} %): {'within' if summary['gpu_peak_flat'] else 'not within' if gpu is not None else 'not measured (no GPU)'}")
        lines.append(f"- layer-tokens/s spread: {100 * summary['layer_tokens_spread']:.1f} % (bound "
                     f"{100 * PER_LAYER_BOUND:.0f} %): {'within' if summary['per_layer_flat'] else 'not within'}")
    else:
        lines.append(f"- {len(points)} widths ran, up to hidden {max(p['hidden'] for p in points)}.")
    lines.append("")
    lines.append("Layer-tokens/s = layers x tokens per step / mean step time. Sources: "
                 + ", ".join(f"`{p['file']}`" for p in points) + ".")
    return "\n".join(lines) + "\n"


def plot(points: list[dict[str, Any]], summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_key = "layers" if summary["kind"] == "depth" else "hidden"
    xs = [p[x_key] for p in points]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    gpu = [p["gpu_peak_gib"] for p in points]
    if all(v is not None for v in gpu):
        axes[0].plot(xs, gpu, "o-", label="GPU peak allocated")
    axes[0].plot(xs, [p["host_peak_gib"] for p in points], "s--", label="host peak RSS")
    axes[0].set_xlabel(x_key)
    axes[0].set_ylabel("GiB")
    axes[0].set_ylim(bottom=0)
    axes[0].legend()
    axes[0].set_title("Memory")
    axes[1].plot(xs, [p["layer_tokens_per_s"] for p in points], "o-", color="tab:green")
    axes[1].set_xlabel(x_key)
    axes[1].set_ylabel("layer-tokens / s")
    axes[1].set_ylim(bottom=0)
    axes[1].set_title("Throughput per layer")
    fig.suptitle(f"megatrain {summary['kind']} scaling", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatrain_hf.bench.scaling", description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="results.json files of megatrain bench, one per shape")
    parser.add_argument("--out", type=Path, required=True, help="folder for scaling.md and scaling.png")
    parser.add_argument("--system", default="megatrain", help="which system's row to read (default megatrain)")
    args = parser.parse_args(argv)
    try:
        points = load_points(args.results, args.system)
    except (OSError, ValueError, KeyError) as exc:
        parser.exit(2, f"scaling: error: {exc}\n")
    summary = verdict(points)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaling.md").write_text(render(points, summary))
    (args.out / "scaling.json").write_text(json.dumps({"points": points, "summary": summary}, indent=2) + "\n")
    plot(points, summary, args.out / "scaling.png")
    print(render(points, summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
