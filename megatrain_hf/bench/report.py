"""Turn a benchmark run into results.json (raw), results.md (tables) and results.png (chart).

A system that did not run (status "unavailable" or "failed") gets its status and, below the
table, its reason; no cell of its row ever holds a number. Speed-ups are ratios of tokens/s and
appear only where both systems ran. TFLOPS follow the convention of :mod:`.flops` (PaLM's model
FLOPs), stated at the top of the report. A system whose measured steps still trend
(:mod:`.trend`) carries the flag next to its name ("still warming up: steps trend -4.1 %/step"),
and every measured step's time is listed. Each system's own configuration (the DeepSpeed and
FSDP configs written out, megatrain's options) is listed at the end.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from .trend import RULE as TREND_RULE
from .trend import trend_label

logger = logging.getLogger(__name__)

DASH = "—"


def write_reports(report: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write the three files into ``out``; returns their paths by kind."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "results.md", "png": out / "results.png"}
    paths["json"].write_text(json.dumps(report, indent=2, default=str) + "\n")
    paths["markdown"].write_text(render_markdown(report))
    plot(report, paths["png"])
    logger.info("bench: wrote %s", ", ".join(str(p) for p in paths.values()))
    return paths


def _ok(r: dict[str, Any]) -> bool:
    return r.get("status") == "ok"


def _num(value: float | None, fmt: str) -> str:
    return DASH if value is None else format(value, fmt)


def _speedup(r: dict[str, Any], base: dict[str, Any] | None) -> str:
    if base is None or not _ok(base) or not _ok(r) or r is base:
        return DASH
    return f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x"


def _name_cell(name: str, r: dict[str, Any]) -> str:
    label = trend_label(r.get("trend")) if _ok(r) else ""
    return f"{name} ({label})" if label else name


def _main_row(name: str, r: dict[str, Any], results: dict[str, Any], cuda: bool) -> list[str]:
    if not _ok(r):
        return [name, r.get("status", "failed")] + [DASH] * 8
    link = r.get("link_bytes_per_step")
    gpu = _num(r.get("gpu_peak_allocated_gib"), ".2f") if cuda else "n/a (cpu)"
    return [
        _name_cell(name, r), "ok",
        f"{r['tokens_per_s']:,.0f}",
        f"{r['tflops']:.1f}" if r["tflops"] >= 1 else f"{r['tflops']:.3g}",
        f"{r['step_time_mean_s']:.3f} / {r['step_time_median_s']:.3f}",
        gpu,
        f"{r['host_peak_rss_gib']:.2f}",
        f"{link['total'] / 1e9:.2f}" if link else DASH,
        _speedup(r, results.get("deepspeed")),
        _speedup(r, results.get("plain")),
    ]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _workload_line(w: dict[str, Any]) -> str:
    s = w["shape"]
    return (f"Model `{w['model']}` (hidden {s['hidden']}, intermediate {s['intermediate']}, {s['layers']} layers, "
            f"{s['heads']} heads / {s['kv_heads']} kv, vocab {s['vocab']}, ~{w['approx_params'] / 1e9:.3g}B params), "
            f"seq {w['seq_len']} x micro-batch {w['micro_batch']} x grad-accum {w['grad_accum']} = "
            f"{w['tokens_per_step']:,} tokens per optimizer step, {w['dtype']}, activation checkpointing, "
            f"{w['warmup_steps']} warmup + {w['steps']} measured steps, device {w['device']}.")


def render_markdown(report: dict[str, Any]) -> str:
    w, results, meta = report["workload"], report["results"], report["meta"]
    cuda = w["device"] == "cuda"
    header = ["system", "status", "tokens/s", "TFLOPS", "step time s (mean / median)", "GPU peak GiB",
              "host peak RSS GiB", "link GB/step", "vs deepspeed", "vs plain"]
    convention = meta.get("flops_convention") or meta.get("flops_formula")
    lines = ["# megatrain benchmark", "", _workload_line(w), "", f"{convention}.", ""]
    lines += _table(header, [_main_row(n, r, results, cuda) for n, r in results.items()])
    lines += [""]
    if "deepspeed_zenflow" in results:
        lines += ["deepspeed_zenflow's updates are stale by design (ZenFlow applies most of each gradient "
                  "asynchronously, steps later): its throughput is not that of the same optimizer as the others'.", ""]
    carried = [f"{n} ({r['carried_over'].get('created_utc')}, commit {r['carried_over'].get('git_commit')})"
               for n, r in results.items() if r.get("carried_over")]
    if carried:
        lines += [f"Carried over with --merge from an earlier invocation: {'; '.join(carried)}.", ""]
    lines += _steps_section(results) + _phase_section(results) + _memory_section(results, cuda)
    lines += _loss_section(results) + _not_run_section(results) + _config_section(results)
    lines += _definitions_section(meta) + _meta_section(meta)
    return "\n".join(lines) + "\n"


def _times(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values) if values else DASH


def _steps_section(results: dict[str, Any]) -> list[str]:
    ok = {n: r for n, r in results.items() if _ok(r) and r.get("step_times_s")}
    if not ok:
        return []
    rows = []
    for n, r in ok.items():
        t = r.get("trend") or {}
        slope, halves = t.get("slope_rel_per_step"), t.get("halves_rel")
        rows.append([n, _times(r.get("warmup_step_times_s", [])), _times(r["step_times_s"]),
                     DASH if slope is None else f"{100 * slope:+.1f}",
                     DASH if halves is None else f"{100 * halves:+.1f}",
                     trend_label(t) or "steady"])
    header = ["system", "warm-up steps s (untimed)", "measured steps s", "slope %/step", "last vs first half %",
              "trend"]
    return (["## Per-step times (seconds, in step order)", ""] + _table(header, rows)
            + ["", f"Trend rule: {TREND_RULE}.", ""])


def _config_section(results: dict[str, Any]) -> list[str]:
    configured = {n: r["system_config"] for n, r in results.items() if r.get("system_config")}
    if not configured:
        return []
    lines = ["## System configurations", ""]
    for name, config in configured.items():
        lines.append(f"- **{name}**: {config.get('note', '')}")
        for key, value in config.items():
            if key == "note":
                continue
            nested = isinstance(value, dict) and any(isinstance(v, dict) for v in value.values())
            for sub, item in (value.items() if nested else [(None, value)]):
                label = f"{key}.{sub}" if sub is not None else key
                lines.append(f"  - `{label}`: `{json.dumps(item)}`")
    return lines + [""]


def _phase_section(results: dict[str, Any]) -> list[str]:
    ok = {n: r for n, r in results.items() if _ok(r)}
    if not ok:
        return []
    rows = [[n] + [f"{r['phases_mean_s'][p]:.3f}" for p in ("between", "fwd_bwd", "optimizer", "post")]
            for n, r in ok.items()]
    return (["## Step-time breakdown (mean seconds per optimizer step, Trainer phases)", ""]
            + _table(["system", "between steps", "forward+backward", "optimizer.step", "post"], rows)
            + ["", "DeepSpeed steps its optimizer inside backward, so its optimizer time is in forward+backward.", ""])


def _memory_section(results: dict[str, Any], cuda: bool) -> list[str]:
    ok = {n: r for n, r in results.items() if _ok(r)}
    if not ok or not cuda:
        return []
    rows = [[n, _num(r.get("gpu_peak_allocated_gib"), ".2f"), _num(r.get("gpu_peak_reserved_gib"), ".2f"),
             _num(r.get("gpu_peak_device_used_gib"), ".2f"), f"{r['host_peak_rss_gib']:.2f}",
             f"{r['host_ru_maxrss_gib']:.2f}"] for n, r in ok.items()]
    header = ["system", "GPU allocated", "GPU reserved", "GPU in use (driver)", "host RSS (sampled)", "host ru_maxrss"]
    return ["## Memory peaks (GiB, whole worker process)", ""] + _table(header, rows) + [""]


def _loss_section(results: dict[str, Any]) -> list[str]:
    ok = {n: r for n, r in results.items() if _ok(r) and r.get("losses")}
    if not ok:
        return []
    steps = sorted({e["step"] for r in ok.values() for e in r["losses"]})
    by_system = {n: {e["step"]: e["loss"] for e in r["losses"]} for n, r in ok.items()}
    rows = [[str(s)] + [_num(by_system[n].get(s), ".6f") for n in ok] for s in steps]
    return (["## Training loss per optimizer step (sanity check: same data, same seed)", ""]
            + _table(["step"] + list(ok), rows) + [""])


def _not_run_section(results: dict[str, Any]) -> list[str]:
    missing = {n: r for n, r in results.items() if not _ok(r)}
    if not missing:
        return []
    lines = ["## Systems that did not run", ""]
    for name, r in missing.items():
        reason = " ".join(str(r.get("reason", "no reason recorded")).split())
        lines.append(f"- **{name}** ({r.get('status')}): {reason[:600]}")
    return lines + [""]


def _definitions_section(meta: dict[str, Any]) -> list[str]:
    definitions = meta.get("definitions") or {}
    if not definitions:
        return []
    return ["## Definitions", ""] + [f"- {name}: {text}" for name, text in definitions.items()] + [""]


def _meta_section(meta: dict[str, Any]) -> list[str]:
    hw, git, v = meta["hardware"], meta["git"], meta["versions"]
    gpus = "; ".join(hw["gpus"]) if hw.get("gpus") else "none seen by nvidia-smi"
    commit = git["commit"] or f"unknown ({git['note']})"
    dirty = " (uncommitted changes)" if git.get("dirty") else ""
    versions = ", ".join(f"{k} {val}" for k, val in v.items() if val)
    combined = [f"- Combined from `{c['file']}` (commit {c.get('git_commit')}, {c.get('created_utc')})"
                for c in meta.get("combined_from", [])]
    if meta.get("combined_note"):
        combined.append(f"- Note: {meta['combined_note']}")
    return [
        "## Run", "", *combined,
        (f"- Hardware: GPU {gpus}; CPU {hw.get('cpu_model')} ({hw['cpu_logical']} logical / "
         f"{hw['cpu_physical']} physical cores); RAM {hw['ram_total_gib']:.1f} GiB"),
        f"- Commit: {commit}{dirty}",
        f"- Versions: {versions}",
        f"- Command: `{meta['command_line']}` (argv {meta['argv']})",
        f"- Date (UTC): {meta['created_utc']}",
    ]


def plot(report: dict[str, Any], path: Path) -> None:
    """Three panels: tokens/s per system (status in place of a bar when it did not run), the
    step-time breakdown and the memory peaks of the systems that ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    results = report["results"]
    _plot_throughput(axes[0], results)
    _plot_phases(axes[1], results)
    _plot_memory(axes[2], results, report["workload"]["device"] == "cuda")
    w = report["workload"]
    fig.suptitle(f"{w['model']}: {w['tokens_per_step']:,} tokens/step (seq {w['seq_len']} x mb {w['micro_batch']} "
                 f"x ga {w['grad_accum']}), {w['dtype']}", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_throughput(ax, results: dict[str, Any]) -> None:
    names = list(results)
    values = [results[n]["tokens_per_s"] if _ok(results[n]) else 0.0 for n in names]
    bars = ax.bar(names, values, color=["tab:green" if n == "megatrain" else "tab:blue" for n in names])
    top = max(values) if any(values) else 1.0
    for bar, name in zip(bars, names):
        r = results[name]
        label = f"{r['tokens_per_s']:,.0f}\n{r['tflops']:.3g} TFLOPS" if _ok(r) else r.get("status", "failed")
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + 0.01 * top, label,
                ha="center", va="bottom", fontsize=8, color="black" if _ok(r) else "tab:red")
    ax.set_ylim(0, top * 1.25)
    ax.set_ylabel("tokens / s (higher is better)")
    ax.set_title("Throughput")


def _plot_phases(ax, results: dict[str, Any]) -> None:
    ok = [n for n in results if _ok(results[n])]
    bottom = [0.0] * len(ok)
    labels = {"between": "between steps", "fwd_bwd": "forward+backward", "optimizer": "optimizer.step", "post": "post"}
    for phase, label in labels.items():
        values = [results[n]["phases_mean_s"][phase] for n in ok]
        ax.bar(ok, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("seconds per optimizer step")
    ax.set_title("Step-time breakdown (Trainer phases)")
    if ok:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no system ran", ha="center", transform=ax.transAxes)


def _plot_memory(ax, results: dict[str, Any], cuda: bool) -> None:
    ok = [n for n in results if _ok(results[n])]
    x = range(len(ok))
    host = [results[n]["host_peak_rss_gib"] for n in ok]
    offset = 0.2 if cuda else 0.0
    ax.bar([i - offset for i in x], host, width=0.4, label="host peak RSS")
    if cuda:
        gpu = [results[n].get("gpu_peak_allocated_gib") or 0.0 for n in ok]
        ax.bar([i + offset for i in x], gpu, width=0.4, label="GPU peak allocated")
    ax.set_xticks(list(x), ok)
    ax.set_ylabel("GiB")
    ax.set_title("Memory peaks")
    ax.legend(fontsize=8)
