"""On a CUDA GPU: megatrain through Trainer against plain full-GPU Trainer.

Marked `gpu` (skipped without CUDA). Tolerances are explicit per dtype; the measured differences
are appended to $MEGATRAIN_GPU_REPORT (JSON lines) when set, so docs/benchmarks.md can quote them.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers import (GPU_SHAPE, LogRecorder, RandomTokens, assert_close_losses, state_of, tiny_model, train,
                     training_args)
from megatrain_hf import MegaTrainPlugin, engine_of

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

# bf16: both runs round matmul weights to bf16 the same way (autocast vs staging), but GPU kernels
# (atomics in the embedding backward, split-K matmuls) are not bitwise reproducible. Adam divides by
# sqrt(v), so an element whose gradient is ~0 can move by ~lr either way: compare each tensor's
# whole update (final - initial) instead, relative to its size. First H200 run: loss diff 9.2e-5.
BF16_LOSS_ATOL = 2e-2
BF16_UPDATE_RTOL = 0.05
FP32_LOSS_ATOL = 1e-4
FP32_UPDATE_RTOL = 1e-2  # embedding backward uses atomics on CUDA: last-bit noise, amplified by Adam

SHAPE = GPU_SHAPE


def _report(name, ref_losses, losses, ref_state, state):
    path = os.environ.get("MEGATRAIN_GPU_REPORT")
    record = {
        "test": name,
        "max_loss_diff": max(abs(a - b) for a, b in zip(ref_losses, losses)),
        "max_param_diff": max((ref_state[n] - state[n]).abs().max().item() for n in ref_state),
        "ref_losses": ref_losses,
        "losses": losses,
    }
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    return record


def assert_close_updates(init: dict, ref: dict, got: dict, rtol: float) -> dict:
    """Per tensor: ||(got - init) - (ref - init)|| <= rtol * ||ref - init||; returns the ratios."""
    ratios = {}
    for n in init:
        if n.endswith("k_proj.bias"):
            continue  # softmax is invariant to it: its gradient is 0 in exact math, rounding noise here
        ref_update = ref[n] - init[n]
        denom = ref_update.norm().item()
        ratios[n] = (got[n] - ref[n]).norm().item() / max(denom, 1e-12)
    worst = max(ratios, key=ratios.get)
    assert ratios[worst] <= rtol, f"{worst}: update differs by {ratios[worst]:.3g} of its norm"
    return ratios


def _args(path, **kw):
    return training_args(path, use_cpu=False, **kw)


def _data():
    return RandomTokens(n=64, seq=128, vocab=SHAPE["vocab_size"])


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


# mixtral, qwen3_moe: transformers' grouped_mm experts kernel ignores autocast, so plain bf16 Trainer computes the
# experts with the fp32 weights. At 6872d95 megatrain sent them in bf16 and both cases failed (the router's update
# 0.139 of its norm off); experts_dtype="auto" sends them in fp32 now (docs/log-moe.md).
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "phi3", "cohere", "mixtral", "qwen3_moe"])
def test_bf16_parity(tmp_path, family):
    ref = tiny_model(family, **SHAPE)
    init = state_of(ref)
    _, ref_losses = train(ref, _args(tmp_path / "ref", bf16=True), dataset=_data())
    model = tiny_model(family, **SHAPE)
    _, losses = train(model, _args(tmp_path / "mt", bf16=True), dataset=_data(), callbacks=[MegaTrainPlugin()])
    engine = engine_of(model)
    assert engine.device.type == "cuda" and engine.compute_dtype == torch.bfloat16 and engine.store.pin
    assert all(p.device.type == "cpu" for p in model.parameters())  # masters never left the host
    if family in ("mixtral", "qwen3_moe"):
        assert engine.plan.precision.experts == torch.float32  # as plain computes them (grouped_mm)
    ref_state = {n: p.cpu() for n, p in state_of(ref).items()}
    _report(f"bf16_parity_{family}", ref_losses, losses, ref_state, state_of(model))
    assert_close_losses(ref_losses, losses, BF16_LOSS_ATOL)
    assert_close_updates(init, ref_state, state_of(model), BF16_UPDATE_RTOL)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_bf16_parity_layer_major(tmp_path, family, monkeypatch):
    """Gradient accumulation 4, no dropout: every step runs layer-major (sums on the GPU)."""
    from megatrain_hf import Engine

    groups = []
    original = Engine.run_layer_major
    monkeypatch.setattr(Engine, "run_layer_major", lambda self, fns: groups.append(len(fns)) or original(self, fns))
    shape = {**SHAPE, "attention_dropout": 0.0}
    ref = tiny_model(family, **shape)
    init = state_of(ref)
    args = dict(bf16=True, gradient_accumulation_steps=4)
    _, ref_losses = train(ref, _args(tmp_path / "ref", **args), dataset=_data())
    model = tiny_model(family, **shape)
    _, losses = train(model, _args(tmp_path / "mt", **args), dataset=_data(), callbacks=[MegaTrainPlugin()])
    assert groups == [4] * 6
    ref_state = {n: p.cpu() for n, p in state_of(ref).items()}
    _report(f"bf16_parity_layer_major_{family}", ref_losses, losses, ref_state, state_of(model))
    assert_close_losses(ref_losses, losses, BF16_LOSS_ATOL)
    assert_close_updates(init, ref_state, state_of(model), BF16_UPDATE_RTOL)


def test_bf16_parity_without_host_staging(tmp_path):
    """host_staging=False: fp32 masters go up the link and are rounded to bf16 on the GPU."""
    ref = tiny_model("llama", **SHAPE)
    init = state_of(ref)
    _, ref_losses = train(ref, _args(tmp_path / "ref", bf16=True), dataset=_data())
    model = tiny_model("llama", **SHAPE)
    _, losses = train(model, _args(tmp_path / "mt", bf16=True), dataset=_data(),
                      callbacks=[MegaTrainPlugin(host_staging=False)])
    engine = engine_of(model)
    assert not engine.store.staging.enabled and all(b.staging_host is None for b in engine.store.buffers)
    ref_state = {n: p.cpu() for n, p in state_of(ref).items()}
    _report("bf16_parity_no_host_staging_llama", ref_losses, losses, ref_state, state_of(model))
    assert_close_losses(ref_losses, losses, BF16_LOSS_ATOL)
    assert_close_updates(init, ref_state, state_of(model), BF16_UPDATE_RTOL)


def test_fp32_parity_and_generate(tmp_path):
    ref = tiny_model("llama", **SHAPE)
    init = state_of(ref)
    _, ref_losses = train(ref, _args(tmp_path / "ref"), dataset=_data())
    model = tiny_model("llama", **SHAPE)
    _, losses = train(model, _args(tmp_path / "mt"), dataset=_data(), callbacks=[MegaTrainPlugin()])
    ref_state = {n: p.cpu() for n, p in state_of(ref).items()}
    _report("fp32_parity_llama", ref_losses, losses, ref_state, state_of(model))
    assert_close_losses(ref_losses, losses, FP32_LOSS_ATOL)
    assert_close_updates(init, ref_state, state_of(model), FP32_UPDATE_RTOL)
    prompt = torch.tensor([[1, 5, 9, 3]], device="cuda")
    ref.eval()
    model.eval()
    assert model.device.type == "cpu"  # the parameters live in host RAM; generate() keeps its tensors on the prompt's
    expected = ref.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    got = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(expected, got)


def test_lora_bf16(tmp_path):
    peft = pytest.importorskip("peft")

    def build():
        cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
        return peft.get_peft_model(tiny_model("llama", **SHAPE), cfg)

    ref = build()
    _, ref_losses = train(ref, _args(tmp_path / "ref", bf16=True), dataset=_data())
    model = build()
    _, losses = train(model, _args(tmp_path / "mt", bf16=True), dataset=_data(), callbacks=[MegaTrainPlugin()])
    ref_state = {n: p.cpu() for n, p in state_of(ref).items()}
    _report("lora_bf16_llama", ref_losses, losses, ref_state, state_of(model))
    assert_close_losses(ref_losses, losses, BF16_LOSS_ATOL)
    # lora_B starts at 0, so lora_A's gradient is 0 at the first step and tiny for a while; AdamW
    # scales those tiny gradients up, so lora_A's early updates are mostly bf16 rounding in BOTH runs
    # (H200, commit 05f3396: worst lora_A ratio 0.062, every lora_B within 0.05). lora_B is held to
    # the full fine-tuning tolerance, lora_A to twice it.
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    init = {n: v for n, v in state_of(build()).items() if n in trainable}
    got = state_of(model)
    for part, rtol in (("lora_B", BF16_UPDATE_RTOL), ("lora_A", 2 * BF16_UPDATE_RTOL)):
        names = [n for n in init if part in n]
        assert names
        assert_close_updates({n: init[n] for n in names}, {n: ref_state[n] for n in names},
                             {n: got[n] for n in names}, rtol)
    # History: at commit 2aa7742 lora_B of layer 3 q_proj differed by 0.57 of its update norm on the
    # H200 while losses agreed to 2.9e-4: LoRA matrices went to the GPU in bf16 (PEFT then ran LoRA
    # dropout in bf16). They travel in fp32 since (docs/log.md); the update check above is back.


@pytest.mark.parametrize("layer_major", [False, True])
def test_streams_with_low_arithmetic_intensity(tmp_path, layer_major):
    """Big layers, 8 tokens: transfers take far longer than compute, so a missing stream wait
    (weights read before they land, device sums or accumulators reused before their copy ends) changes
    the numbers. Gradient accumulation 3, micro-batch by micro-batch and layer-major."""
    shape = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=6, num_attention_heads=16,
                 num_key_value_heads=16, vocab_size=512, max_position_embeddings=64, attention_dropout=0.0)
    data = RandomTokens(n=24, seq=8, vocab=512)
    args = dict(max_steps=4, per_device_train_batch_size=1, gradient_accumulation_steps=3)
    logs = LogRecorder()
    trainer, _ = _fp32_parity(tmp_path, f"streams_low_intensity_fp32_layer_major={layer_major}", shape, data, args,
                              MegaTrainPlugin(layer_major=layer_major), logs)
    # transfers dominate here: the compute stream must have been seen waiting for uploads
    assert sum(h.get("megatrain/h2d_wait_frac", 0.0) for h in logs.logs) > 0


def _fp32_parity(tmp_path, name: str, shape: dict, data, args: dict, plugin: MegaTrainPlugin, *callbacks):
    """Plain Trainer and Trainer + ``plugin`` in fp32 on the GPU: losses and updates must agree."""
    ref = tiny_model("llama", **shape)
    init = state_of(ref)
    _, ref_losses = train(ref, _args(tmp_path / "ref", **args), dataset=data)
    model = tiny_model("llama", **shape)
    trainer, losses = train(model, _args(tmp_path / "mt", **args), dataset=data, callbacks=[plugin, *callbacks])
    ref_state = {n: p.cpu() for n, p in state_of(ref).items()}
    _report(name, ref_losses, losses, ref_state, state_of(model))
    assert_close_losses(ref_losses, losses, FP32_LOSS_ATOL)
    assert_close_updates(init, ref_state, state_of(model), FP32_UPDATE_RTOL)
    return trainer, model


@pytest.mark.parametrize("offload", [False, "auto"])
def test_gpu_budget_caps_memory_and_sizes_groups(tmp_path, offload):
    """max_gpu_memory below what 4 micro-batches in flight take: the engine caps the allocator
    (set_per_process_memory_fraction), runs step 1 one micro-batch at a time, step 2 at most two,
    then as many per group as fit; the run finishes under the cap and matches plain Trainer.
    With offload_checkpoints="auto" the plan (3 of 4) makes it offload the checkpoints, measure
    again (steps 3 and 4) and then run more micro-batches per group than fit without it."""
    import gc

    shape = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=8, vocab_size=1024, max_position_embeddings=512, attention_dropout=0.0)
    data = RandomTokens(n=96, seq=512, vocab=1024)
    args = dict(bf16=True, gradient_accumulation_steps=4, per_device_train_batch_size=4,
                max_steps=4 if offload is False else 6)

    ref = tiny_model("llama", **shape)
    init = state_of(ref)
    ref_trainer, ref_losses = train(ref, _args(tmp_path / "ref", **args), dataset=data)
    ref_state = {n: p.cpu() for n, p in state_of(ref).items()}
    del ref, ref_trainer  # the plain run's model and AdamW state must not count against the cap
    gc.collect()
    torch.cuda.empty_cache()

    free = tiny_model("llama", **shape)  # uncapped, layer-major: what 4 in flight take
    before = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    free_trainer, _ = train(free, _args(tmp_path / "free", **args), dataset=data, callbacks=[MegaTrainPlugin()])
    need = torch.cuda.max_memory_reserved() - before
    engine_of(free).detach()
    del free, free_trainer
    gc.collect()
    torch.cuda.empty_cache()

    per_microbatch = 10 * 2048 * 1024 * 4  # checkpoints: 10 units x 2048 tokens x hidden 1024 x fp32
    budget = int(torch.cuda.memory_reserved() + need - 1.5 * per_microbatch)
    model = tiny_model("llama", **shape)
    try:
        torch.cuda.reset_peak_memory_stats()
        _, losses = train(model, _args(tmp_path / "mt", **args), dataset=data,
                          callbacks=[MegaTrainPlugin(max_gpu_memory=budget, offload_checkpoints=offload)])
        engine = engine_of(model)
        peak = max(torch.cuda.max_memory_reserved(), engine.budget.max_peak_reserved)
        _report(f"gpu_budget_offload={offload} in_flight={engine.budget.in_flight} peak={peak} budget={budget}",
                ref_losses, losses, ref_state, state_of(model))
        if offload is False:
            assert 1 <= engine.budget.in_flight < 4, engine.budget.in_flight  # step 1: 1, step 2: <= 2, then what fits
        else:
            # the budget leaves room for ~2.5 micro-batches' checkpoints: offloading them fits more
            # (the H200 planned 3 of 4 with offload: what else a micro-batch adds is kept with margin)
            assert engine.offload is not None and engine.budget.in_flight >= 3, engine.budget.in_flight
        assert peak <= budget, (peak, budget, need)
        assert_close_losses(ref_losses, losses, BF16_LOSS_ATOL)
        assert_close_updates(init, ref_state, state_of(model), BF16_UPDATE_RTOL)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


@pytest.mark.parametrize("layer_major", [False, True])
def test_offloaded_checkpoints_with_transfer_bound_shapes(tmp_path, layer_major):
    """offload_checkpoints=True with narrow layers and many tokens: each checkpoint's trip to the
    host and back takes longer than the layer's compute, so a missing wait (a checkpoint read
    before it landed, a host buffer reused before its upload read it) changes the numbers."""
    shape = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=256, max_position_embeddings=256, attention_dropout=0.0)
    data = RandomTokens(n=384, seq=256, vocab=256)
    args = dict(max_steps=3, per_device_train_batch_size=32, gradient_accumulation_steps=4)
    _, model = _fp32_parity(tmp_path, f"offload_checkpoints_fp32_layer_major={layer_major}", shape, data, args,
                            MegaTrainPlugin(layer_major=layer_major, offload_checkpoints=True))
    assert engine_of(model).offload.pool_bytes > 0


def test_offloaded_checkpoints_keep_gpu_memory_flat_with_depth(tmp_path):
    """The GPU peak grows with depth by the checkpoints (one fp32 tokens x hidden per layer and
    micro-batch in flight) unless they are offloaded: then by less than a quarter of that."""
    import gc

    data = RandomTokens(n=32, seq=1024, vocab=1024)
    args = dict(bf16=True, max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=4)
    peaks = {}
    for offload in (False, True):
        for layers in (4, 12):
            shape = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=1024, max_position_embeddings=1024, attention_dropout=0.0)
            model = tiny_model("llama", **shape)
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            train(model, _args(tmp_path / f"{offload}-{layers}", **args), dataset=data,
                  callbacks=[MegaTrainPlugin(offload_checkpoints=offload)])
            peaks[(offload, layers)] = torch.cuda.max_memory_allocated()
            engine_of(model).detach()
            del model
    grow_kept = peaks[(False, 12)] - peaks[(False, 4)]
    grow_offloaded = peaks[(True, 12)] - peaks[(True, 4)]
    checkpoints = 8 * 4 * 2048 * 1024 * 4  # 8 more layers x 4 micro-batches x tokens x hidden x fp32
    report = {"peaks": {f"offload={o},layers={n}": v for (o, n), v in peaks.items()},
          "checkpoint_bytes_of_8_layers": checkpoints}
    path = os.environ.get("MEGATRAIN_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": "offload_depth_memory", **report}) + "\n")
    assert grow_kept >= 0.8 * checkpoints, (grow_kept, checkpoints)
    assert grow_offloaded < 0.25 * checkpoints, (grow_offloaded, checkpoints)


def test_bf16_resume_equals_uninterrupted_run(tmp_path):
    """Resume from checkpoint-3 of a bf16 layer-major run (sharded optimizer state, RNG, scheduler,
    data order) and end where the uninterrupted run ends, within the bf16 tolerances above."""
    shape = {**SHAPE, "attention_dropout": 0.0}
    args = dict(bf16=True, gradient_accumulation_steps=2, save_strategy="steps", save_steps=3)
    full = tiny_model("llama", **shape)
    init = state_of(full)
    _, full_losses = train(full, _args(tmp_path / "run", **args), dataset=_data(), callbacks=[MegaTrainPlugin()])
    resumed = tiny_model("llama", seed=123, **shape)  # another init: everything must come from the checkpoint
    _, resumed_losses = train(resumed, _args(tmp_path / "run", **args), dataset=_data(), callbacks=[MegaTrainPlugin()],
                              resume=str(tmp_path / "run" / "checkpoint-3"))
    full_state = state_of(full)
    _report("bf16_resume_llama", full_losses[6:], resumed_losses, full_state, state_of(resumed))
    assert len(resumed_losses) == len(full_losses) - 6
    assert_close_losses(full_losses[6:], resumed_losses, BF16_LOSS_ATOL)
    assert_close_updates(init, full_state, state_of(resumed), BF16_UPDATE_RTOL)


def test_unit_sent_twice_in_one_backward_gets_both_contributions():
    """Two forwards and one backward (as reward modelling does with chosen and rejected): each
    unit's gradients are sent twice in the same backward, the second while the first transfer may
    still be in flight (wide layers, 8 tokens: transfers dominate). The gradients equal those of
    the same model on the GPU without megatrain (fp32): the second send adds to the first."""
    import copy

    from megatrain_hf import attach

    shape = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=16,
                 num_key_value_heads=16, vocab_size=512, max_position_embeddings=64, attention_dropout=0.0)
    model = tiny_model("llama", **shape)
    ref = copy.deepcopy(model).cuda()
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, 512, (1, 8), generator=gen).cuda() for _ in range(2))
    (ref(input_ids=a, labels=a).loss + ref(input_ids=b, labels=b).loss).backward()
    engine = attach(model, device="cuda")
    try:
        (model(input_ids=a, labels=a).loss + model(input_ids=b, labels=b).loss).backward()
        for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, r.grad.cpu(), rtol=1e-4, atol=1e-6, msg=name)
    finally:
        engine.detach()


def test_bf16_parity_with_device_update(tmp_path):
    """device_update=True: the GPU updates the first units (from the second step on with the
    gradients the sink kept on the GPU) while the host updates the rest; training matches plain
    Trainer within the bf16 tolerances, and both shared the work."""
    shape = {**SHAPE, "attention_dropout": 0.0}
    args = dict(bf16=True, gradient_accumulation_steps=2)
    ref = tiny_model("llama", **shape)
    init = state_of(ref)
    _, ref_losses = train(ref, _args(tmp_path / "ref", **args), dataset=_data())
    model = tiny_model("llama", **shape)
    logs = LogRecorder()
    trainer, losses = train(model, _args(tmp_path / "mt", **args), dataset=_data(),
                            callbacks=[MegaTrainPlugin(device_update=True, metrics="all"), logs])
    ref_state = {n: p.cpu() for n, p in state_of(ref).items()}
    _report("bf16_parity_device_update_llama", ref_losses, losses, ref_state, state_of(model))
    assert_close_losses(ref_losses, losses, BF16_LOSS_ATOL)
    assert_close_updates(init, ref_state, state_of(model), BF16_UPDATE_RTOL)
    shares = [h["megatrain/update_device_frac"] for h in logs.logs if "megatrain/update_device_frac" in h]
    assert shares and max(shares) > 0, shares
    assert trainer.optimizer.optimizer.kept_grad_units > 0


@pytest.mark.parametrize("accumulation", [1, 2])
def test_bf16_parity_trl_sft_trainer_fused_head(tmp_path, accumulation):
    """TRL's SFTTrainer (trl >= 1 scores with its fused LM head): with megatrain the head runs as
    the kernel of the engine's head unit on the GPU, on weights fetched after their update; losses
    and updates match SFTTrainer alone within the bf16 tolerances."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from megatrain_hf.integrations import trl as megatrain_trl

    data = _data()
    dataset = datasets.Dataset.from_dict({"input_ids": [data[i]["input_ids"].tolist() for i in range(len(data))]})
    vocab = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=vocab, pad_token="[PAD]", eos_token="[PAD]", unk_token="[UNK]")
    shape = {**SHAPE, "attention_dropout": 0.0}

    def run(out, callbacks):
        model = tiny_model("llama", **shape)
        init = state_of(model)
        config = trl.SFTConfig(output_dir=str(out), max_steps=6, per_device_train_batch_size=4, bf16=True,
                               gradient_accumulation_steps=accumulation, learning_rate=2e-3, report_to=[],
                               logging_steps=1, disable_tqdm=True, save_strategy="no", seed=0, data_seed=0,
                               dataset_kwargs={"skip_prepare_dataset": True})
        trainer = trl.SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                                 callbacks=callbacks)
        trainer.train()
        return init, trainer, model, [h["loss"] for h in trainer.state.log_history if "loss" in h]

    init, _, ref, ref_losses = run(tmp_path / "ref", [])
    served = []
    forward = megatrain_trl.FusedLogProbs.forward
    megatrain_trl.FusedLogProbs.forward = lambda self, *a: served.append(1) or forward(self, *a)
    try:
        _, trainer, model, losses = run(tmp_path / "mt", [MegaTrainPlugin()])
    finally:
        megatrain_trl.FusedLogProbs.forward = forward
    ref_state = {n: p.detach().cpu() for n, p in state_of(ref).items()}
    _report(f"bf16_parity_trl_sft_ga{accumulation}", ref_losses, losses, ref_state, state_of(model))
    if hasattr(__import__("trl.trainer.utils", fromlist=["x"]), "add_fused_lm_head"):
        assert len(served) == 6 * accumulation  # every micro-batch's head ran in the head unit
    assert "mean_token_accuracy" in trainer.state.log_history[0]
    assert_close_losses(ref_losses, losses, BF16_LOSS_ATOL)
    assert_close_updates(init, ref_state, state_of(model), BF16_UPDATE_RTOL)
    engine_of(model).detach()


def test_device_update_kept_gradients_equal_uploaded_ones(tmp_path, monkeypatch):
    """device_update with the gradients kept on the GPU gives bitwise the results of uploading the
    host's copy of the same sums (same units on each side: a fixed split, no taking of the other's
    units; the GPU's units then run the same CUDA kernel on the same values). Accumulation 2 sends
    each unit's sum once (layer-major); a kept copy that were stale or partial would differ."""
    import collections

    from megatrain_hf.optim.device_update import DeviceShareScheduler

    shape = {**SHAPE, "attention_dropout": 0.0}
    args = dict(bf16=True, gradient_accumulation_steps=2, max_steps=4)

    def fixed_split(self, jobs):
        return [j for j in jobs if j.unit % 2 == 1], [j for j in jobs if j.unit % 2 == 0]

    drain = DeviceShareScheduler._drain_lists
    monkeypatch.setattr(DeviceShareScheduler, "_assign", fixed_split)
    monkeypatch.setattr(DeviceShareScheduler, "_drain_lists",
                        lambda self, own, other, on_device: drain(self, own, collections.deque(), on_device))
    runs = []
    for keep in (True, False):
        if not keep:
            monkeypatch.setattr(DeviceShareScheduler, "_keep_set", lambda self, jobs: frozenset())
        model = tiny_model("llama", **shape)
        trainer, losses = train(model, _args(tmp_path / f"keep{keep}", **args), dataset=_data(),
                                callbacks=[MegaTrainPlugin(device_update=True)])
        optimizer = trainer.optimizer.optimizer
        assert (optimizer.kept_grad_units > 0) == keep
        runs.append((losses, state_of(model)))
        engine_of(model).detach()
    (kept_losses, kept), (sent_losses, sent) = runs
    assert kept_losses == sent_losses
    for name in kept:
        assert torch.equal(kept[name], sent[name]), name
