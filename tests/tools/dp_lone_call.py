"""Model calls made on one data-parallel rank alone (issue 33, item 4), under torchrun with 2 ranks (gloo,
CPU): a tiny Llama attached with megatrain. Each rank writes ``--out`` + ``.<rank>`` (JSON): for each probe
the error type, its message and the seconds it took (or the result).

Probes, in order: ``generate`` on every rank (its tokens, to compare with the plain model's); then on
rank 0 alone, while rank 1 waits in a barrier: ``generate``, a forward under ``no_grad``, an evaluation
forward with labels (eval mode), ``state_dict()``; then a mismatch: rank 0 generates while rank 1 runs a
training forward.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE))]  # this checkout

from tests.helpers import RandomTokens, tiny_model


def _probe(fn) -> dict:
    start = time.time()
    try:
        value = fn()
        return {"result": value, "seconds": time.time() - start}
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc), "seconds": time.time() - start}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    import megatrain_hf

    model = tiny_model("llama", attention_dropout=0.0)
    megatrain_hf.attach(model, megatrain_hf.MegaTrainConfig(collective_timeout_s=5), device="cpu")
    prompt = RandomTokens(n=1).ids[:, :6]
    ids = RandomTokens(n=2).ids
    found = {}

    def generate():
        return model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)[0].tolist()

    def no_grad_forward():
        with torch.no_grad():
            return model(input_ids=ids).logits.shape[-1]

    def evaluation():
        model.eval()
        try:
            with torch.no_grad():
                return float(model(input_ids=ids, labels=ids).loss)
        finally:
            model.train()

    found["all_generate"] = _probe(generate)
    for name, fn in (("generate", generate), ("no_grad_forward", no_grad_forward), ("evaluation", evaluation),
                     ("state_dict", lambda: len(model.state_dict()))):
        if rank == 0:
            found[name] = _probe(fn)
        dist.barrier()
    if rank == 0:
        found["mismatch"] = _probe(generate)
    else:
        found["mismatch"] = _probe(lambda: model(input_ids=ids, labels=ids).loss.backward())
    dist.barrier()
    found["all_generate_after"] = _probe(generate)  # the ranks agree again
    with open(f"{cli.out}.{rank}", "w") as f:
        json.dump(found, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
