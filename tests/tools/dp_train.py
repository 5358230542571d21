"""One training run of a tiny Llama, plain or with megatrain, under torchrun or alone.

``--case`` is a JSON object: ``megatrain`` (bool), ``batch`` (per device), ``steps``, ``ga``,
``lora`` (bool), ``eval`` (bool), ``save_steps``, ``resume`` (a checkpoint path), ``fail`` ([rank,
step]: that rank raises at that optimizer step), ``then_resume`` (a checkpoint name: train again in the
same processes from that checkpoint of the first run, into ``--out`` + ``.resumed``). Rank 0 writes
``{"logs": [...]}`` to ``--out`` and the final trainable weights (the full state dict, gathered) to
``--out`` + ``.pt``. ``gpu``: on CUDA (one GPU per rank) in bf16.
"""

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE))]  # this checkout

from tests.helpers import LogRecorder, RandomTokens, tiny_model, training_args
from transformers import Trainer, TrainerCallback


class FailAt(TrainerCallback):
    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_step_begin(self, args, state, control, **kwargs):
        if args.process_index == self.rank and state.global_step + 1 == self.step:
            with open(os.path.join(args.output_dir, "failed_at"), "w") as f:
                f.write(repr(time.time()))
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")


def train(case: dict, out: str, output_dir: str, resume: str | None = None) -> None:
    torch.set_num_threads(1)
    model = tiny_model("llama", attention_dropout=0.0, tie_word_embeddings=case.get("tied", False))
    if case.get("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.0))
    args = training_args(
        output_dir, max_steps=case.get("steps", 4), per_device_train_batch_size=case["batch"],
        gradient_accumulation_steps=case.get("ga", 2), save_strategy="steps" if case.get("save_steps") else "no",
        save_steps=case.get("save_steps") or 500, eval_strategy="steps" if case.get("eval") else "no",
        eval_steps=2, per_device_eval_batch_size=case["batch"],
        **(dict(use_cpu=False, bf16=True) if case.get("gpu") else {}),
    )
    callbacks = [LogRecorder()]
    if case.get("fail"):
        callbacks.append(FailAt(*case["fail"]))
    if case.get("megatrain"):
        from megatrain_hf import MegaTrainPlugin

        callbacks.append(MegaTrainPlugin(layer_major=case.get("layer_major", "auto")))
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(n=48),
                      eval_dataset=RandomTokens(n=12, seed=2) if case.get("eval") else None, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    from megatrain_hf import engine_of, gather_state_dict  # (also attached without the plugin here: `megatrain launch`)

    engine = engine_of(model)
    probe = _probe_sharded(trainer, model, out) if case.get("probe") and engine is not None else None
    state = gather_state_dict(model)  # every rank (a collective under data parallelism); None off rank 0
    if args.process_index == 0:
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        torch.save({k: v.detach().float().cpu().clone() for k, v in state.items() if k in trainable}, out + ".pt")
        with open(out, "w") as f:
            json.dump({"logs": [dict(x) for x in callbacks[0].logs], "probe": probe}, f)


def _probe_sharded(trainer, model, out: str) -> dict:
    """What reading the model the ordinary way gives on each rank after train() (data parallelism):
    the parameters of units another rank owns, state_dict(), save_pretrained(), and trainer.save_model()."""
    engine = __import__("megatrain_hf").engine_of(model)
    remote = [e.tensor for u in sorted(engine.store.remote) for e in engine.store.owned_trainable(u)]
    found = {"remote_params": len(remote),
             "remote_all_nan": all(bool(torch.isnan(p.detach()).all()) for p in remote)}
    for name, read in (("state_dict", model.state_dict), ("save_pretrained", lambda: model.save_pretrained(out + ".sp"))):
        try:
            read()
            found[name] = "no error"
        except Exception as exc:  # (UsageError)
            found[name] = str(exc)
    trainer.save_model(out + ".saved")  # gathers: every rank calls it, rank 0 writes
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--output_dir", required=True)
    cli = parser.parse_args()
    case = json.loads(cli.case)
    train(case, cli.out, cli.output_dir, case.get("resume"))
    if case.get("then_resume"):  # a second run in the same processes, resumed from the first's checkpoint
        train(case, cli.out + ".resumed", cli.output_dir + ".resumed",
              os.path.join(cli.output_dir, case["then_resume"]))


if __name__ == "__main__":
    main()
