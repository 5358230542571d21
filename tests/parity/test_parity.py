"""Trainer + MegaTrainPlugin trains exactly like plain Trainer (CPU, fp32).

Gradient accumulation 2, clipping (max_grad_norm 0.5 triggers), warmup + cosine, weight decay,
attention dropout 0.1, 6 optimizer steps: the loss of every micro-batch and every final
parameter must agree within 1e-6 for every supported family.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import (
    FAMILY_CONFIGS,
    assert_close_losses,
    assert_close_params,
    state_of,
    tiny_model,
    train,
    training_args,
)
from megatrain_hf import HostAdamW, MegaTrainPlugin, engine_of

ATOL_FP32 = 1e-6


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_trainer_parity_fp32(family, tmp_path):
    ref_model = tiny_model(family)
    _, ref_losses = train(ref_model, training_args(tmp_path / "ref"))

    model = tiny_model(family)
    trainer, losses = train(model, training_args(tmp_path / "mt"), callbacks=[MegaTrainPlugin()])

    assert isinstance(trainer.optimizer.optimizer, HostAdamW)
    # accelerate must not copy the host-resident state to the device and back (8 B/param each way)
    assert trainer.optimizer.device_placement is False
    assert engine_of(model) is not None
    assert len(ref_losses) == 12  # 6 steps x 2 micro-batches
    assert_close_losses(ref_losses, losses, ATOL_FP32)
    assert_close_params(state_of(ref_model), state_of(model), ATOL_FP32)


def test_plugins_kwarg_and_stock_optimizer(tmp_path):
    """`plugins=` works, and a non-AdamW optimizer the user picked still trains exactly (synchronously)."""
    ref_model = tiny_model("llama")
    _, ref_losses = train(ref_model, training_args(tmp_path / "ref", optim="sgd", learning_rate=0.05))
    model = tiny_model("llama")
    trainer, losses = train(
        model, training_args(tmp_path / "mt", optim="sgd", learning_rate=0.05), plugins=[MegaTrainPlugin()]
    )
    assert isinstance(trainer.optimizer.optimizer, torch.optim.SGD)
    assert_close_losses(ref_losses, losses, ATOL_FP32)
    assert_close_params(state_of(ref_model), state_of(model), ATOL_FP32)


def test_parameters_live_in_host_flats():
    model = tiny_model("llama")
    names = [n for n, _ in model.named_parameters()]
    from megatrain_hf import attach

    engine = attach(model, device="cpu")
    assert [n for n, _ in model.named_parameters()] == names
    q = model.model.layers[0].self_attn.q_proj.weight
    flat = engine.store.buffers[1].master_host
    start = flat.data_ptr()
    assert start <= q.data_ptr() < start + flat.numel() * 4
    # each parameter has a storage of its own (save_pretrained must not see them as tied)
    k = model.model.layers[0].self_attn.k_proj.weight
    assert q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
    assert engine.num_templates == 4  # embedding, decoder layer, norm, head
    engine.detach()
    assert "forward" not in vars(model.model.layers[0])


@pytest.mark.parametrize("scheduler", ["linear", "constant_with_warmup", "cosine_with_restarts", "polynomial"])
def test_lr_schedulers(tmp_path, scheduler):
    ref_model = tiny_model("llama")
    _, ref_losses = train(ref_model, training_args(tmp_path / "ref", lr_scheduler_type=scheduler))
    model = tiny_model("llama")
    trainer, losses = train(model, training_args(tmp_path / "mt", lr_scheduler_type=scheduler), callbacks=[MegaTrainPlugin()])
    assert isinstance(trainer.optimizer.optimizer, HostAdamW)
    assert_close_losses(ref_losses, losses, ATOL_FP32)
    assert_close_params(state_of(ref_model), state_of(model), ATOL_FP32)


def test_trainer_subclass(tmp_path):
    """A Trainer subclass (as TRL's trainers are) goes through the same path."""
    from transformers import Trainer

    calls = []

    class MyTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            calls.append(1)
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def run(model, path, callbacks):
        from tests.helpers import LossRecorder, RandomTokens

        recorder = LossRecorder(model)
        MyTrainer(model=model, args=training_args(path), train_dataset=RandomTokens(), callbacks=callbacks).train()
        return recorder.losses

    ref_model = tiny_model("qwen2")
    ref_losses = run(ref_model, tmp_path / "ref", None)
    model = tiny_model("qwen2")
    losses = run(model, tmp_path / "mt", [MegaTrainPlugin()])
    assert engine_of(model) is not None and len(calls) == 24
    assert_close_losses(ref_losses, losses, ATOL_FP32)
    assert_close_params(state_of(ref_model), state_of(model), ATOL_FP32)


def test_host_adamw_matches_torch_adamw_with_unused_parameters():
    """Per-parameter step counts: a parameter without a gradient in a step keeps its count."""
    from megatrain_hf import attach

    models = [tiny_model("llama"), tiny_model("llama")]
    engine = attach(models[1], device="cpu")
    ref_opt = torch.optim.AdamW(models[0].parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    opt = HostAdamW(models[1].parameters(), store=engine.store, lr=1e-2, weight_decay=0.1)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    for step in range(4):
        for model, optimizer in ((models[0], ref_opt), (models[1], opt)):
            torch.manual_seed(step)
            model(input_ids=ids, labels=ids).loss.backward()
            if step == 1:  # the first layer's MLP gets no update this step
                for p in model.model.layers[0].mlp.parameters():
                    p.grad = None
            optimizer.step()
            optimizer.zero_grad()
    opt.synchronize()
    assert_close_params(state_of(models[0]), state_of(models[1]), ATOL_FP32)
    up = models[1].model.layers[0].mlp.up_proj.weight
    assert float(opt.state[up]["step"]) == 3.0


def test_host_adamw_load_state_dict_copies_in_place(monkeypatch):
    """A saved state loads into the existing host flats (no second copy of the moments), from any
    tensor layout torch's state_dict gives, and training continues exactly as torch's AdamW."""
    from megatrain_hf import attach

    models = [tiny_model("llama"), tiny_model("llama")]
    engine = attach(models[1], device="cpu")
    ref_opt = torch.optim.AdamW(models[0].parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    opt = HostAdamW(models[1].parameters(), store=engine.store, lr=1e-2, weight_decay=0.1)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))

    def step(model, optimizer):
        torch.manual_seed(0)  # the same dropout masks for both models
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):
        step(models[0], ref_opt)
        step(models[1], opt)
    saved = opt.state_dict()
    saved = {"param_groups": saved["param_groups"],
             "state": {i: {k: v.clone() for k, v in st.items()} for i, st in saved["state"].items()}}
    flats = {u: (t["exp_avg"].data_ptr(), t["exp_avg_sq"].data_ptr()) for u, t in opt.moments.in_ram.items()}
    for u in flats:  # scribble over the live state: the load must restore every byte of it
        opt.moments.in_ram[u]["exp_avg"].fill_(7.0)
        opt.moments.in_ram[u]["exp_avg_sq"].fill_(7.0)
    def no_copies(*args, **kwargs):
        raise AssertionError("torch built a new tensor for a state value: a second copy of the moments")

    monkeypatch.setattr(torch.optim.Optimizer, "_process_value_according_to_param_policy", no_copies)
    opt.load_state_dict(saved)
    monkeypatch.undo()
    assert {u: (t["exp_avg"].data_ptr(), t["exp_avg_sq"].data_ptr()) for u, t in opt.moments.in_ram.items()} == flats
    up = models[1].model.layers[0].mlp.up_proj.weight
    assert opt.state[up]["exp_avg"].data_ptr() >= min(p for p, _ in flats.values())
    assert float(opt.state[up]["step"]) == 2.0
    step(models[0], ref_opt)
    step(models[1], opt)
    opt.synchronize()
    assert_close_params(state_of(models[0]), state_of(models[1]), ATOL_FP32)


@pytest.mark.parametrize("family", ["gemma", "gemma2"])
def test_tied_embeddings_bitwise(tmp_path, family):
    """The head's contribution to a tied weight is summed with the embedding's on the device and
    accumulated once, as autograd does: bitwise equal under gradient accumulation (was 1e-8 off)."""
    ref_model = tiny_model(family)
    _, ref_losses = train(ref_model, training_args(tmp_path / "ref"))
    model = tiny_model(family)
    _, losses = train(model, training_args(tmp_path / "mt"), callbacks=[MegaTrainPlugin()])
    assert_close_losses(ref_losses, losses, 0.0)
    assert_close_params(state_of(ref_model), state_of(model), 0.0)
