"""Trainer features through megatrain, each against plain Trainer (CPU, fp32, exact to 1e-6):
PEFT LoRA with dropout, resume from a mid-run checkpoint, checkpoints loadable by plain
``from_pretrained``, evaluation loss, ``generate()`` after training, HF activation checkpointing.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import (
    LogRecorder,
    RandomTokens,
    assert_close_losses,
    assert_close_params,
    state_of,
    tiny_model,
    train,
    training_args,
)
from megatrain_hf import MegaTrainPlugin, engine_of

ATOL = 1e-6


LORA_TARGETS = {
    "llama": ["q_proj", "v_proj", "down_proj"],
    "phi3": ["qkv_proj", "down_proj"],  # fused projections
    "mixtral": ["q_proj", "v_proj"],  # the experts are fused tensors, not Linear modules
    "gpt2": ["c_attn", "c_proj"],  # Conv1D: its weight is stored transposed (fan_in_fan_out)
}


def _lora(model, family: str = "llama"):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=LORA_TARGETS[family],
                             fan_in_fan_out=family == "gpt2")
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("family", sorted(LORA_TARGETS))
def test_lora_parity(tmp_path, family):
    ref = _lora(tiny_model(family), family)
    _, ref_losses = train(ref, training_args(tmp_path / "ref"))
    model = _lora(tiny_model(family), family)
    trainer, losses = train(model, training_args(tmp_path / "mt"), callbacks=[MegaTrainPlugin()])
    assert_close_losses(ref_losses, losses, ATOL)
    assert_close_params(state_of(ref), state_of(model), ATOL)
    # frozen base weights: no fp32 master, no grad, no optimizer state
    engine = engine_of(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert engine.store.trainable_numel() < 2 * trainable  # only adapters (+ alignment padding)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    # the adapter saves and loads like any PEFT adapter
    trainer.save_model(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_resume_equals_uninterrupted_run(tmp_path, family):
    args = dict(save_strategy="steps", save_steps=3)
    full_model = tiny_model(family)
    _, full_losses = train(full_model, training_args(tmp_path / "run", **args), callbacks=[MegaTrainPlugin()])

    resumed = tiny_model(family, seed=123)  # different init: everything must come from the checkpoint
    _, resumed_losses = train(
        resumed,
        training_args(tmp_path / "run", **args),
        callbacks=[MegaTrainPlugin()],
        resume=str(tmp_path / "run" / "checkpoint-3"),
    )
    assert_close_losses(full_losses[6:], resumed_losses, ATOL)
    assert_close_params(state_of(full_model), state_of(resumed), ATOL)

    # the reference agrees with the uninterrupted megatrain run
    ref = tiny_model(family)
    _, ref_losses = train(ref, training_args(tmp_path / "ref"))
    assert_close_losses(ref_losses, full_losses, ATOL)
    assert_close_params(state_of(ref), state_of(full_model), ATOL)


def test_moe_resume_matches_plain_trainer(tmp_path):
    """A mid-run checkpoint of an MoE model resumes under megatrain exactly as under plain Trainer:
    every micro-batch loss and every final parameter, router and experts included. (Not as the
    uninterrupted run: transformers 5.17-5.24 write the experts in the per-expert Hub format and
    Trainer's resume loads them without converting back, so experts and routers keep the new
    model's init -- huggingface/transformers#48805 -- under plain Trainer and megatrain alike.)"""
    args = dict(save_strategy="steps", save_steps=3)
    runs = {}
    for name, callbacks in (("plain", None), ("mt", [MegaTrainPlugin()])):
        full = tiny_model("mixtral")
        _, full_losses = train(full, training_args(tmp_path / name, **args), callbacks=callbacks)
        resumed = tiny_model("mixtral", seed=123)
        _, resumed_losses = train(resumed, training_args(tmp_path / name, **args), callbacks=callbacks,
                                  resume=str(tmp_path / name / "checkpoint-3"))
        runs[name] = (full_losses, state_of(full), resumed_losses, state_of(resumed))
    (ref_full, ref_state, ref_resumed, ref_resumed_state), (full, state, resumed, resumed_state) = runs.values()
    assert len(ref_resumed) == 6
    assert_close_losses(ref_full, full, ATOL)
    assert_close_params(ref_state, state, ATOL)
    assert_close_losses(ref_resumed, resumed, ATOL)
    assert_close_params(ref_resumed_state, resumed_state, ATOL)


def test_checkpoint_loads_with_plain_from_pretrained(tmp_path):
    model = tiny_model("gemma")  # tied embeddings
    trainer, _ = train(
        model, training_args(tmp_path / "run", save_strategy="steps", save_steps=3), callbacks=[MegaTrainPlugin()]
    )
    trainer.save_model(tmp_path / "final")
    for path in (tmp_path / "final", tmp_path / "run" / "checkpoint-6"):
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert_close_params(state_of(model), state_of(loaded), atol=0.0)


def test_eval_loss_and_generate(tmp_path):
    eval_ds = RandomTokens(n=8, seed=7)
    ref = tiny_model("qwen3")
    ref_trainer, _ = train(ref, training_args(tmp_path / "ref"), eval_dataset=eval_ds)
    model = tiny_model("qwen3")
    trainer, _ = train(model, training_args(tmp_path / "mt"), eval_dataset=eval_ds, callbacks=[MegaTrainPlugin()])
    ref_eval = ref_trainer.evaluate()["eval_loss"]
    got_eval = trainer.evaluate()["eval_loss"]
    assert abs(ref_eval - got_eval) <= ATOL, (ref_eval, got_eval)

    prompt = torch.tensor([[1, 5, 9, 3]])
    ref.eval()
    model.eval()
    expected = ref.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    got = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(expected, got)


def test_activation_checkpointing_flag_is_translated(tmp_path, caplog):
    """gradient_checkpointing=True: megatrain already recomputes per layer; results stay exact."""
    ref = tiny_model("llama")
    _, ref_losses = train(ref, training_args(tmp_path / "ref", gradient_checkpointing=True))
    model = tiny_model("llama")
    with caplog.at_level("INFO", logger="megatrain_hf"):
        _, losses = train(
            model, training_args(tmp_path / "mt", gradient_checkpointing=True), callbacks=[MegaTrainPlugin()]
        )
    assert_close_losses(ref_losses, losses, ATOL)
    assert_close_params(state_of(ref), state_of(model), ATOL)
    assert not model.model.layers[0].gradient_checkpointing
    assert "already checkpoints every layer" in caplog.text


@pytest.mark.parametrize("level", ["basic", "all", "none"])
def test_engine_metrics_reach_the_reporters_at_their_level(tmp_path, level):
    """megatrain's metrics join what the reporters receive (console, TensorBoard, W&B), at the level
    asked for, and never the trainer_state that checkpoints keep; keys that do not apply to the
    device (GPU memory, link traffic on a CPU) are left out."""
    model = tiny_model("llama")
    recorder = LogRecorder()
    trainer, _ = train(model, training_args(tmp_path / "mt"), callbacks=[MegaTrainPlugin(metrics=level), recorder])
    logs = [h for h in recorder.logs if "loss" in h]
    keys = {k for h in logs for k in h if k.startswith("megatrain/")}
    basic = {"megatrain/tokens_per_s", "megatrain/tflops", "megatrain/tflops_causal", "megatrain/optimizer_wait_frac",
             "megatrain/host_rss_GiB"}
    assert not any(k.startswith("megatrain/") for h in trainer.state.log_history for k in h)
    assert not any("gpu" in k or "link" in k or "h2d" in k for k in keys)  # a CPU run
    if level == "none":
        assert not keys
        return
    assert basic <= keys and (keys == basic) == (level == "basic")
    assert logs[-1]["megatrain/tflops"] > logs[-1]["megatrain/tflops_causal"] > 0
    if level == "basic":
        return
    assert logs[-1]["megatrain/tokens"] == 2 * 2 * 16  # 2 micro-batches x 2 sequences x 16 tokens
    # a log reads the updates that finished since the previous one (the last step's may still run)
    rates = [h["megatrain/update_Gparams_per_s"] for h in logs if "megatrain/update_frac" in h]
    assert rates and all(r > 0 for r in rates)
    optimizer = trainer.optimizer.optimizer  # one more update by hand: the counters cover every updated element
    optimizer.take_update_stats()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.synchronize()
    seconds, numel = optimizer.take_update_stats()
    assert seconds > 0 and numel == sum(p.numel() for p in model.parameters() if p.requires_grad)
