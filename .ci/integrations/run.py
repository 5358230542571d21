"""The tools people fine-tune with, plain vs megatrain, through each tool's own command (``make test-integrations``).

For each case (tool x full / LoRA x processes) the tool trains the tiny local model of ``fixtures.py`` twice
in its own venv (``.ci/integrations.sh`` makes them): once as the tool's plain command, once behind
``python -m megatrain_hf.run``. Both save a checkpoint at the last step; the job compares every loss and
gradient norm of ``trainer_state.json``'s log history and every tensor of the saved weights (the model, or
the adapter) within 1e-6, and checks that megatrain trained the second run (its ``megatrain_optimizer``
folder is in the checkpoint) and not the first. fp32 on the CPU.

    python .ci/integrations/run.py WORK [TOOL ...]      # tools: trl, llamafactory, axolotl (default: all)

Prints one line per case and writes the table to WORK/results.md; exits 1 if a case differs or fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch
from safetensors.torch import load_file

STEPS = 6
ATOL = 1e-6
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def trl_command(work: str, out: str, mode: str, procs: int) -> tuple[list[str], dict]:
    cmd = ["trl", "sft", "--model_name_or_path", f"{work}/model", "--dataset_name", f"{work}/data/jsonl",
           "--output_dir", out, "--max_steps", str(STEPS), "--per_device_train_batch_size", "2",
           "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3", "--logging_steps", "1",
           "--save_strategy", "steps", "--save_steps", str(STEPS), "--report_to", "none", "--use_cpu", "true",
           "--seed", "0", "--max_length", "32", "--bf16", "false", "--dtype", "float32",
           "--gradient_checkpointing", "false", "--dataloader_num_workers", "0", "--max_grad_norm", "1.0"]
    if mode == "lora":
        cmd += ["--use_peft", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.0",
                "--lora_target_modules", *LORA_TARGETS]
    if procs > 1:
        cmd += ["--num_processes", str(procs)]
    return cmd, {}


def llamafactory_command(work: str, out: str, mode: str, procs: int) -> tuple[list[str], dict]:
    config = {
        "model_name_or_path": f"{work}/model", "stage": "pt", "do_train": True, "finetuning_type": mode,
        "dataset": "tiny", "dataset_dir": f"{work}/data/lf", "template": "empty", "cutoff_len": 32,
        "output_dir": out, "overwrite_output_dir": True, "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2, "learning_rate": 1.0e-3, "max_steps": STEPS, "logging_steps": 1,
        "save_strategy": "steps", "save_steps": STEPS, "report_to": "none", "use_cpu": True, "bf16": False,
        "seed": 0, "plot_loss": False, "dataloader_num_workers": 0, "max_grad_norm": 1.0,
    }
    if mode == "lora":
        config.update(lora_rank=8, lora_alpha=16, lora_dropout=0.0, lora_target="all")
    path = f"{out}.yaml"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)  # JSON is YAML
    env = {"DISABLE_VERSION_CHECK": "0"}
    if procs > 1:
        env.update(FORCE_TORCHRUN="1", NPROC_PER_NODE=str(procs))
    return ["llamafactory-cli", "train", path], env


def axolotl_command(work: str, out: str, mode: str, procs: int) -> tuple[list[str], dict]:
    config = {
        "base_model": f"{work}/model", "datasets": [{"path": f"{work}/data/jsonl/text.jsonl", "ds_type": "json",
                                                    "type": "completion"}],
        "sequence_len": 32, "output_dir": out, "micro_batch_size": 2, "gradient_accumulation_steps": 2,
        "max_steps": STEPS, "learning_rate": 1.0e-3, "optimizer": "adamw_torch_fused", "lr_scheduler": "cosine",
        "logging_steps": 1, "save_strategy": "steps", "save_steps": STEPS, "bf16": False, "fp16": False,
        "tf32": False, "seed": 0, "val_set_size": 0, "dataloader_num_workers": 0, "sample_packing": False,
        "max_grad_norm": 1.0, "use_tensorboard": False, "special_tokens": {"pad_token": "<pad>"},
        "dataset_prepared_path": f"{out}-prepared",
    }
    if mode == "lora":
        # axolotl's q/k/v and o LoRA kernels (torch autograd functions, bound per attention module: what
        # megatrain rebinds) run on the CPU; its MLP kernel is Triton's SwiGLU, which needs CUDA even without
        # megatrain (plain axolotl fails with "Found no NVIDIA driver")
        config.update(adapter="lora", lora_r=8, lora_alpha=16, lora_dropout=0.0, lora_target_modules=LORA_TARGETS,
                      lora_qkv_kernel=True, lora_o_kernel=True, lora_mlp_kernel=False)
    path = f"{out}.yml"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    cmd = ["axolotl", "train", path]
    if procs > 1:
        cmd += ["--num-processes", str(procs)]
    return cmd, {"TRITON_INTERPRET": "1"}


TOOLS = {"trl": trl_command, "llamafactory": llamafactory_command, "axolotl": axolotl_command}
CASES = {"trl": [("full", 1), ("lora", 1)], "llamafactory": [("full", 1), ("lora", 1), ("full", 2)],
         "axolotl": [("full", 1), ("lora", 1)]}


def _checkpoint(out: str) -> str:
    path = os.path.join(out, f"checkpoint-{STEPS}")
    if not os.path.isdir(path):
        raise RuntimeError(f"no {path}")
    return path


def _weights(checkpoint: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(checkpoint)):
        if name.endswith(".safetensors"):
            out.update({f"{name}:{k}": v.float() for k, v in load_file(os.path.join(checkpoint, name)).items()})
    if not out:
        raise RuntimeError(f"no weights in {checkpoint}")
    return out


def _history(checkpoint: str) -> list[dict]:
    with open(os.path.join(checkpoint, "trainer_state.json"), encoding="utf-8") as f:
        return [e for e in json.load(f)["log_history"] if "loss" in e]


def _run(tool: str, venv: str, work: str, out: str, mode: str, procs: int, wrapped: bool) -> tuple[float, str]:
    cmd, extra = TOOLS[tool](work, out, mode, procs)
    cmd = [os.path.join(venv, "bin", cmd[0]), *cmd[1:]]
    if wrapped:
        cmd = [os.path.join(venv, "bin", "python"), "-m", "megatrain_hf.run", *cmd]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MEGATRAIN_CONFIG", "VIRTUAL_ENV")}
    # no network here: the hub offline, the tools' telemetry off (axolotl's would retry its upload)
    env.update(PATH=f"{venv}/bin:{env.get('PATH', '')}", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               CUDA_VISIBLE_DEVICES="", DO_NOT_TRACK="1", AXOLOTL_DO_NOT_TRACK="1", **extra)
    started = time.time()
    log = f"{out}.log"
    with open(log, "w", encoding="utf-8") as f:
        code = subprocess.call(cmd, cwd=work, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=1200)
    if code != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` exited {code}; last lines of {log}:\n" + _tail(log))
    return time.time() - started, log


def _tail(path: str, n: int = 25) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return "".join(f.readlines()[-n:])


def compare(plain_out: str, mt_out: str) -> tuple[float, float, int]:
    """(worst loss/grad-norm difference, worst weight difference, logged steps); raises if megatrain did not run."""
    plain, mt = _checkpoint(plain_out), _checkpoint(mt_out)
    if os.path.isdir(os.path.join(plain, "megatrain_optimizer")):
        raise RuntimeError(f"the plain run has megatrain's optimizer folder: {plain}")
    if not os.path.isdir(os.path.join(mt, "megatrain_optimizer")):
        raise RuntimeError(f"megatrain did not train the wrapped run: {mt} has no megatrain_optimizer/")
    a, b = _history(plain), _history(mt)
    if len(a) != len(b) or not a:
        raise RuntimeError(f"{len(a)} logged steps plain, {len(b)} with megatrain")
    logs = max(abs(x[k] - y[k]) for x, y in zip(a, b) for k in ("loss", "grad_norm") if k in x)
    wa, wb = _weights(plain), _weights(mt)
    if wa.keys() != wb.keys():
        raise RuntimeError(f"saved tensors differ: {sorted(set(wa) ^ set(wb))[:5]}")
    weights = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    return logs, weights, len(a)


def main(argv: list[str]) -> int:
    work, tools = argv[0], argv[1:] or list(TOOLS)
    lines, failed = [], False
    for tool in tools:
        venv = os.path.join(work, "venv-" + tool)
        only = os.environ.get("CASES")  # e.g. CASES=lora-1 runs only those cases
        for mode, procs in CASES[tool]:
            if only and f"{mode}-{procs}" not in only.split(","):
                continue
            name = f"{tool}-{mode}-{procs}p"
            plain_out, mt_out = os.path.join(work, "out", name, "plain"), os.path.join(work, "out", name, "megatrain")
            os.makedirs(os.path.dirname(plain_out), exist_ok=True)
            try:
                t_plain, _ = _run(tool, venv, work, plain_out, mode, procs, wrapped=False)
                t_mt, _ = _run(tool, venv, work, mt_out, mode, procs, wrapped=True)
                logs, weights, steps = compare(plain_out, mt_out)
                ok = logs <= ATOL and weights <= ATOL
                line = (f"| {tool} | {mode} | {procs} | {steps} | {logs:.2e} | {weights:.2e} | {t_plain:.0f} s / "
                        f"{t_mt:.0f} s | {'ok' if ok else 'DIFFERS'} |")
            except Exception as exc:  # noqa: BLE001 (one case's failure is reported; the others still run)
                ok = False
                line = f"| {tool} | {mode} | {procs} | - | - | - | - | FAILED: {str(exc).splitlines()[0][:200]} |"
                print(str(exc), file=sys.stderr)
            failed |= not ok
            lines.append(line)
            print(line, flush=True)
    header = ["| tool | mode | processes | logged steps | worst loss / grad-norm diff | worst weight diff | "
              "time plain / megatrain | result |", "|---|---|---|---|---|---|---|---|"]
    with open(os.path.join(work, "results.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(header + lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
