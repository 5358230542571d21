"""A hand-written training loop of a tiny Llama: plain PyTorch, or megatrain attached with the CUDA
transfer pipelines emulated on the CPU (``core/streams.py``), alone or under torchrun.

``--megatrain``: ``attach(..., streams=EmulatedStreams())`` and HostAdamW (the copy stream, the
gradient worker, three receive slots: the GPU code paths of data parallelism); otherwise
``torch.optim.AdamW`` on the plain model. Each rank takes its share of every micro-batch; two
micro-batches per step, clipping at 0.5. Rank 0 writes ``{"losses": [...], "norms": [...]}`` to
``--out`` and the final parameters to ``--out`` + ``.pt``.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE))]  # this checkout

from tests.helpers import RandomTokens, tiny_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--megatrain", action="store_true")
    cli = parser.parse_args()
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model = tiny_model("llama", attention_dropout=0.0)
    if cli.megatrain:
        import megatrain_hf
        from megatrain_hf.core.streams import EmulatedStreams
        from megatrain_hf.optim.host_adamw import HostAdamW

        engine = megatrain_hf.attach(model, megatrain_hf.MegaTrainConfig(), device="cpu", streams=EmulatedStreams())
        optimizer = HostAdamW(list(model.parameters()), engine.store, lr=2e-3, weight_decay=0.1)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    data, per_rank = RandomTokens(n=24).ids, 6 // world
    losses, norms = [], []
    for step in range(2):
        for mb in range(2):
            ids = data[(2 * step + mb) * 6:(2 * step + mb + 1) * 6][rank * per_rank:(rank + 1) * per_rank]
            loss = model(input_ids=ids, labels=ids).loss
            (loss / 2).backward()
            loss = loss.detach().clone()
            if world > 1:
                dist.all_reduce(loss)
                loss /= world
            losses.append(float(loss))
        if cli.megatrain:
            norm = engine.clip_grad_norm_(0.5, optimizer=optimizer)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        norms.append(float(norm))
        optimizer.step()
        optimizer.zero_grad()
    from megatrain_hf import gather_state_dict

    state = gather_state_dict(model)  # every rank; the full state on rank 0 (a plain state_dict() unattached)
    if rank == 0:
        torch.save({n: state[n].detach().clone() for n, _ in model.named_parameters()}, cli.out + ".pt")
        with open(cli.out, "w") as f:
            json.dump({"losses": losses, "norms": norms}, f)


if __name__ == "__main__":
    main()
