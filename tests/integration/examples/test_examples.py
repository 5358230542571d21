"""The user-facing examples and notebooks run: every examples/*.py with --smoke, every examples/notebooks/*.ipynb.

Each example runs in a subprocess from a temporary working directory (PYTHONPATH = the repository
root, as for an uninstalled clone) and must exit 0 and print its summary line; the demo's must also
write its chart and summary.json, with the training and held-out loss falling. Notebooks are
executed top to bottom with nbclient (skipped, with the reason, where nbclient/nbformat/ipykernel
are not installed: they are in the `test` extra) and must raise in no cell. CPU only, seconds each.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT
EXAMPLES = ROOT / "examples"
NOTEBOOKS = EXAMPLES / "notebooks"

# script -> (extra arguments, a line its stdout must contain)
SMOKE_RUNS = {
    "sft_trainer.py": ([], "sft_trainer: done:"),
    "lora_peft.py": ([], "lora_peft: done:"),
    "accelerate_loop.py": ([], "accelerate_loop: done:"),
    "accelerate_loop.py --host_adamw": (["--host_adamw"], "with HostAdamW"),
    "trl_sft.py": ([], "trl_sft: done:"),
    # no time limit: the demo's smoke run must finish its 40 steps on a slow CI machine too
    "demo.py": (["--time_limit", "0"], "demo: done in"),
}
NOT_EXAMPLES = {"common.py"}  # shared helpers imported by the examples, not a script


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")
    return env


def test_every_example_script_has_a_smoke_run():
    scripts = {p.name for p in EXAMPLES.glob("*.py")} - NOT_EXAMPLES
    covered = {key.split()[0] for key in SMOKE_RUNS}
    assert scripts == covered, (
        f"examples without a smoke run here: {sorted(scripts - covered)}; stale: {sorted(covered - scripts)}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SMOKE_RUNS))
def test_example_smoke(name, tmp_path):
    script = name.split()[0]
    extra, expected = SMOKE_RUNS[name]
    if script == "trl_sft.py" and importlib.util.find_spec("trl") is None:
        pytest.skip("trl is not installed (pip install --no-deps trl: it needs no packages beyond the test extra)")
    cmd = [sys.executable, str(EXAMPLES / script), "--smoke", "--output_dir", str(tmp_path / "out"), *extra]
    started = time.time()
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    elapsed = time.time() - started
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert expected in proc.stdout, f"{name}: {expected!r} not in its output:\n{proc.stdout[-3000:]}"
    if script in OUTPUT_CHECKS:
        OUTPUT_CHECKS[script](tmp_path / "out", proc.stdout)
    print(f"{name}: {elapsed:.1f} s")


def _demo_summary(out: Path) -> dict:
    chart = out / "loss.png"
    assert chart.is_file(), f"the demo wrote no chart at {chart}"
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{chart} is not a PNG"
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert summary["chart"] == str(chart)
    return summary


def _check_demo(out: Path, stdout: str) -> None:
    """The smoke run learns: eval loss and the train loss (first vs last 5 logs) fall by > 1 nat."""
    summary = _demo_summary(out)
    assert summary["steps"] == summary["max_steps"] == 40 and not summary["stopped_by_time_limit"], summary
    train = [loss for _, loss in summary["train_loss"]]
    evals = [loss for _, loss in summary["eval_loss"]]
    assert len(train) >= 10 and len(evals) >= 3, summary
    assert summary["eval_loss"][0][0] == 0 and summary["eval_loss"][-1][0] == 40, summary["eval_loss"]
    # measured on a 2-core CPU: eval 6.25 -> 4.50, train (mean of 5 logs) 6.08 -> 4.17
    assert evals[-1] < evals[0] - 1.0, f"eval loss did not fall: {evals}"
    assert sum(train[-5:]) / 5 < sum(train[:5]) / 5 - 1.0, f"train loss did not fall: {train}"
    assert math.isclose(summary["eval_perplexity_last"], math.exp(evals[-1]))
    assert summary["sample_after"].startswith(summary["prompt"]) and summary["sample_after"] != summary["sample_before"]
    for line in ("train loss:", "eval loss:", "perplexity", "sample after training", "chart:"):
        assert line in stdout, f"demo summary lacks {line!r}:\n{stdout[-3000:]}"


OUTPUT_CHECKS = {"demo.py": _check_demo}  # script -> check(output_dir, stdout), after its smoke run


@pytest.mark.slow
def test_demo_time_limit_stops_training_with_a_final_evaluation(tmp_path):
    out = tmp_path / "out"
    # a 1 s limit has passed by the first step: training stops there, evaluates, and the demo still reports
    cmd = [sys.executable, str(EXAMPLES / "demo.py"), "--smoke", "--output_dir", str(out), "--time_limit", "1"]
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"demo exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    summary = _demo_summary(out)
    assert summary["stopped_by_time_limit"] and summary["steps"] == 1, summary
    assert [step for step, _ in summary["eval_loss"]] == [0, 1], summary["eval_loss"]
    assert "stopped by --time_limit 1" in proc.stdout, proc.stdout[-3000:]


def test_token_accuracy_metric_loads_from_the_local_file():
    evaluate = pytest.importorskip("evaluate")
    metric = evaluate.load(str(EXAMPLES / "metrics" / "token_accuracy.py"))
    assert metric.compute(predictions=[5, 7, 9], references=[5, 8, -100]) == {
        "token_accuracy": 0.5,
        "counted_tokens": 2,
    }
    assert metric.compute(predictions=[1], references=[-100])["token_accuracy"] == 0.0


def _notebook_tools():
    missing = [m for m in ("nbclient", "nbformat", "ipykernel") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (they are in the `test` extra: pip install -e '.[test]')")
    import nbclient
    import nbformat

    return nbclient, nbformat


def test_notebooks_are_stored_without_outputs():
    _, nbformat = _notebook_tools()
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
        assert not dirty, f"{path.name}: code cells {dirty} have stored outputs; clear them before committing"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")))
def test_notebook_runs(name, tmp_path, monkeypatch):
    nbclient, nbformat = _notebook_tools()
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    for key, value in _env().items():  # the kernel inherits this process's environment
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the kernel's tempfile folders land here, not in the system's
    workdir = tmp_path / "notebooks"  # what the notebook writes (Trainer output dirs) lands here
    workdir.mkdir()
    shutil.copy(NOTEBOOKS / name, workdir / name)
    client = nbclient.NotebookClient(
        nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}, allow_errors=False
    )
    started = time.time()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as err:
        pytest.fail(f"{name}: a cell raised:\n{str(err)[-4000:]}")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, f"{name}: error outputs: {errors}"
    left = sorted(p.name for p in tmp_path.glob("megatrain_nb_*"))
    assert not left, f"{name}: left temporary folders behind: {left}"
    print(f"{name}: {time.time() - started:.1f} s")
