"""Layer-major gradient accumulation (CPU, fp32): same training as plain Trainer, fewer transfers.

With ``gradient_accumulation_steps=K`` the plugin runs the K micro-batches of each optimizer step
through every unit before the next (``megatrain_hf/layer_major.py``). Reference: plain Trainer
(losses of every micro-batch, final parameters) and ``loss.backward()`` per micro-batch
(gradients). The device-side sums add the micro-batches in plain accumulation's order, except
for units next to autograd nodes made in the micro-batch threads (final norm, lm_head, a tied
embedding), whose backward autograd orders by per-thread sequence numbers: with 3+
micro-batches those sums can run in another order, so gradients agree to fp32 rounding
(measured <= 4e-9; 2 micro-batches: bitwise) and parameters after 6-7 AdamW steps to ~1e-6
(AdamW's normalisation amplifies rounding in small gradients; measured worst 1.2e-6).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatrain_hf.memory.budget import BUDGET_MARGIN
from tests.helpers import (
    FAMILY_CONFIGS,
    RandomTokens,
    assert_close_losses,
    assert_close_params,
    state_of,
    tiny_model,
    train,
    training_args,
    without_dropout,
)
from megatrain_hf import Engine, MegaTrainPlugin, attach, engine_of
from megatrain_hf.errors import MegatrainConfigError, UsageError
from transformers import Trainer

ATOL = 1e-6
ATOL_PARAMS = 5e-6  # 3+ micro-batches: sums at the head may add in another order (see above)


@pytest.fixture
def group_calls(monkeypatch):
    """Counts layer-major groups run by any engine."""
    calls = []
    original = Engine.run_layer_major

    def spy(self, fns):
        calls.append(len(fns))
        return original(self, fns)

    monkeypatch.setattr(Engine, "run_layer_major", spy)
    return calls


def _microbatch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("megatrain-microbatch")]


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_trainer_parity_layer_major(family, tmp_path, group_calls):
    args = dict(gradient_accumulation_steps=4)
    ref_model = tiny_model(family, **without_dropout(family))
    _, ref_losses = train(ref_model, training_args(tmp_path / "ref", **args))
    model = tiny_model(family, **without_dropout(family))
    _, losses = train(model, training_args(tmp_path / "mt", **args), callbacks=[MegaTrainPlugin()])
    assert group_calls == [4] * 6  # every optimizer step ran as one layer-major group
    assert len(ref_losses) == 24
    assert_close_losses(ref_losses, losses, ATOL)
    assert_close_params(state_of(ref_model), state_of(model), ATOL_PARAMS)
    assert not _microbatch_threads()


@pytest.mark.slow  # ~5-10 s: in `make test`, not in `make test-fast`
def test_uneven_last_step_and_one_epoch(tmp_path, group_calls):
    """20 micro-batches per epoch, GA 3: six groups of 3, then a step of 2."""
    args = dict(gradient_accumulation_steps=3, max_steps=-1, num_train_epochs=1)
    data = RandomTokens(n=40)
    ref_model = tiny_model("qwen2", attention_dropout=0.0)
    _, ref_losses = train(ref_model, training_args(tmp_path / "ref", **args), dataset=data)
    model = tiny_model("qwen2", attention_dropout=0.0)
    _, losses = train(model, training_args(tmp_path / "mt", **args), dataset=data, callbacks=[MegaTrainPlugin()])
    assert group_calls == [3] * 6 + [2]
    assert_close_losses(ref_losses, losses, ATOL)
    assert_close_params(state_of(ref_model), state_of(model), ATOL_PARAMS)


def _batches(k: int, per: int = 2) -> list[dict]:
    data = RandomTokens(n=k * per)
    return [{key: torch.stack([data[i * per + j][key] for j in range(per)]) for key in data[0]} for i in range(k)]


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_accumulate_gradients_and_transfers(family):
    """engine.accumulate == loss.backward() per micro-batch; each unit uploaded once per direction."""
    k = 4
    batches = _batches(k)
    ref = tiny_model(family, attention_dropout=0.0)
    ref_losses = []
    for b in batches:
        loss = ref(**b).loss / k
        loss.backward()
        ref_losses.append(loss.detach())

    model = tiny_model(family, attention_dropout=0.0)
    engine = attach(model, device="cpu")
    engine.stats.reset()
    losses = engine.accumulate([lambda b=b: model(**b).loss / k for b in batches])
    engine.synchronize()
    assert torch.equal(torch.stack(ref_losses), torch.stack(losses))
    units = len(engine.units)
    # forward: every unit once; backward: every unit but the head, still resident from the forward
    assert engine.stats.uploads == 2 * units - 1
    assert engine.stats.fetches == 2 * units * k
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-8, rtol=0, msg=name)
    exact = [n for (n, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()) if torch.equal(p.grad, q.grad)]
    assert len(exact) >= len(list(ref.parameters())) - 2  # all but the final norm / tied embedding bitwise

    # the same step micro-batch by micro-batch uploads every unit for every micro-batch
    model.zero_grad()
    engine.stats.reset()
    for b in batches:
        (model(**b).loss / k).backward()
    assert engine.stats.uploads == (2 * units - 1) * k
    engine.detach()


@pytest.mark.slow  # ~5-10 s: in `make test`, not in `make test-fast`
def test_auto_keeps_plain_order_with_dropout(tmp_path, group_calls, caplog):
    """Active dropout: 'auto' runs micro-batch by micro-batch (same random masks as plain Trainer)."""
    ref_model = tiny_model("llama")  # attention_dropout=0.1
    _, ref_losses = train(ref_model, training_args(tmp_path / "ref"))
    model = tiny_model("llama")
    with caplog.at_level("INFO", logger="megatrain_hf.integrations.trainer"):
        _, losses = train(model, training_args(tmp_path / "mt"), callbacks=[MegaTrainPlugin()])
    assert group_calls == []
    assert "has dropout" in caplog.text and "self_attn.attention_dropout" in caplog.text
    assert_close_losses(ref_losses, losses, ATOL)
    assert_close_params(state_of(ref_model), state_of(model), ATOL)


def test_every_random_draw_counts_as_dropout():
    """Layer-major 'auto' must see every random draw of a training forward, whatever its name."""
    from megatrain_hf.models.checks import dropout_modules

    starcoder2 = dropout_modules(tiny_model("starcoder2", attention_dropout=0.0))
    assert "model.embedding_dropout" in starcoder2
    assert "model.layers.0.mlp.residual_dropout" in starcoder2
    assert "model.layers.0.resid_attn_dropout" in dropout_modules(tiny_model("phi3", attention_dropout=0.0))
    mixtral = dropout_modules(tiny_model("mixtral", attention_dropout=0.0, router_jitter_noise=0.1))
    assert mixtral == ["model.layers.0.mlp.jitter_noise", "model.layers.1.mlp.jitter_noise"]
    for family in ("starcoder2", "phi3", "mixtral", "gpt2"):
        assert dropout_modules(tiny_model(family, **without_dropout(family))) == [], family


def test_forced_layer_major_with_dropout_trains(tmp_path, group_calls):
    model = tiny_model("llama")
    trainer, losses = train(model, training_args(tmp_path / "mt"), callbacks=[MegaTrainPlugin(layer_major=True)])
    assert group_calls == [2] * 6
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] + 0.5


@pytest.mark.slow  # ~5-10 s: in `make test`, not in `make test-fast`
def test_layer_major_off(tmp_path, group_calls):
    model = tiny_model("llama", attention_dropout=0.0)
    train(model, training_args(tmp_path / "mt"), callbacks=[MegaTrainPlugin(layer_major=False)])
    assert group_calls == []


@pytest.mark.slow  # ~5-10 s: in `make test`, not in `make test-fast`
def test_lora_layer_major_parity(tmp_path, group_calls):
    peft = pytest.importorskip("peft")

    def lora(model):
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        return peft.get_peft_model(model, config)

    args = dict(gradient_accumulation_steps=4, learning_rate=1e-2)
    ref_model = lora(tiny_model("llama", attention_dropout=0.0))
    _, ref_losses = train(ref_model, training_args(tmp_path / "ref", **args))
    model = lora(tiny_model("llama", attention_dropout=0.0))
    _, losses = train(model, training_args(tmp_path / "mt", **args), callbacks=[MegaTrainPlugin()])
    assert group_calls == [4] * 6
    assert_close_losses(ref_losses, losses, ATOL)
    assert_close_params(state_of(ref_model), state_of(model), ATOL_PARAMS)


class _FailingTrainer(Trainer):
    """Raises ``error`` in the forward of the ``fail_at``-th micro-batch."""

    fail_at = 2
    error: BaseException = ValueError("bad micro-batch")

    def compute_loss(self, model, inputs, *args, **kwargs):
        self.seen = getattr(self, "seen", 0) + 1
        if self.seen == self.fail_at:
            raise self.error
        return super().compute_loss(model, inputs, *args, **kwargs)


def _trainer(cls, tmp_path, grad_accum: int, **plugin):
    """A ``cls`` Trainer with the plugin on a tiny dropout-free Llama; returns (trainer, model)."""
    model = tiny_model("llama", attention_dropout=0.0)
    trainer = cls(
        model=model,
        args=training_args(tmp_path, gradient_accumulation_steps=grad_accum),
        train_dataset=RandomTokens(),
        callbacks=[MegaTrainPlugin(**plugin)],
    )
    return trainer, model


@pytest.mark.parametrize("error", [ValueError("bad micro-batch"), KeyboardInterrupt()])
def test_error_in_a_micro_batch_is_raised_and_nothing_hangs(tmp_path, error):
    trainer, model = _trainer(_FailingTrainer, tmp_path, 4)
    trainer.error = error
    with pytest.raises(type(error)):
        trainer.train()
    assert not _microbatch_threads()
    engine = engine_of(model)
    assert engine.runner.group is None and not engine.grads.in_group
    # the engine still trains afterwards
    trainer.fail_at = -1
    trainer.train()
    assert trainer.state.global_step == 6


class _DirectBackwardTrainer(Trainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = self.compute_loss(model, inputs)
        loss.backward()  # bypasses accelerator.backward
        return loss.detach()


def test_direct_backward_inside_a_group_is_refused(tmp_path):
    trainer, _ = _trainer(_DirectBackwardTrainer, tmp_path, 2, layer_major=True)
    with pytest.raises(UsageError, match=r"accelerator\.backward\(loss\).*layer_major=False"):
        trainer.train()
    assert not _microbatch_threads()


def test_auto_runs_an_overridden_training_step_micro_batch_by_micro_batch(tmp_path, caplog):
    """A Trainer subclass's own training_step may keep state across calls (TRL's GRPO counts them):
    under layer_major="auto" it runs in plain Trainer's order, logged with the reason."""
    trainer, _ = _trainer(_DirectBackwardTrainer, tmp_path, 2)
    with caplog.at_level("INFO", logger="megatrain_hf"):
        trainer.train()
    assert trainer.state.global_step == 6
    assert "_DirectBackwardTrainer.training_step may keep state across micro-batches" in caplog.text


def test_direct_backward_works_with_layer_major_off(tmp_path):
    trainer, _ = _trainer(_DirectBackwardTrainer, tmp_path, 2, layer_major=False)
    trainer.train()
    assert trainer.state.global_step == 6


def test_config_rejects_bad_layer_major():
    from megatrain_hf import MegaTrainConfig

    with pytest.raises(MegatrainConfigError, match="layer_major='yes'.*True, False or 'auto'"):
        MegaTrainConfig(layer_major="yes")


def test_resume_equals_uninterrupted_run_layer_major(tmp_path, group_calls):
    """Checkpoint at step 3 of 6 (GA 3, layer-major, chunked loss), resume in a fresh model:
    the remaining micro-batch losses and the final parameters equal the uninterrupted run."""
    args = dict(gradient_accumulation_steps=3, save_strategy="steps", save_steps=3)
    full = tiny_model("qwen3", attention_dropout=0.0)
    _, full_losses = train(full, training_args(tmp_path / "run", **args), callbacks=[MegaTrainPlugin()])
    assert group_calls == [3] * 6
    resumed = tiny_model("qwen3", seed=123, attention_dropout=0.0)  # everything must come from the checkpoint
    _, resumed_losses = train(resumed, training_args(tmp_path / "run", **args), callbacks=[MegaTrainPlugin()],
                              resume=str(tmp_path / "run" / "checkpoint-3"))
    assert group_calls == [3] * 9
    assert_close_losses(full_losses[9:], resumed_losses, ATOL)
    assert_close_params(state_of(full), state_of(resumed), ATOL)


@pytest.mark.parametrize("budget, expected", [(10**12, 4), (1, 1)])
def test_gpu_budget_sizes_the_groups(tmp_path, group_calls, budget, expected):
    """max_gpu_memory: step 1 runs its micro-batches one at a time and measures; later steps run as
    many per group as the budget allows (the GPU peak is simulated here: CPU)."""
    trainer, model = _trainer(Trainer, tmp_path, 4, max_gpu_memory="1GiB", offload_checkpoints=False)
    engine = engine_of(model)
    engine.budget.budget, engine.budget.peak_source = budget, lambda: 5_000
    trainer.train()
    # step 1 one at a time, step 2 at most two (second measurement), then what fits
    assert group_calls == [1] * 4 + [min(2, expected)] * (4 // min(2, expected)) + [expected] * (4 * 4 // expected)
    assert engine.budget.in_flight == expected
    assert engine.budget.per_microbatch_bytes == sum(  # every graph call's checkpoint: token ids (int64), then fp32 hidden states
        16 * 2 * (8 if u == 0 else 4 * 64) for u in range(len(engine.units))
    )


def test_gpu_budget_keeps_exactness(tmp_path):
    args = dict(gradient_accumulation_steps=4)
    ref = tiny_model("llama", attention_dropout=0.0)
    _, ref_losses = train(ref, training_args(tmp_path / "ref", **args))
    model = tiny_model("llama", attention_dropout=0.0)
    trainer = Trainer(model=model, args=training_args(tmp_path / "mt", **args), train_dataset=RandomTokens(),
                      callbacks=[MegaTrainPlugin(max_gpu_memory="1GiB", offload_checkpoints=False)])
    engine = engine_of(model)
    per_microbatch = 16 * 2 * 8 + 16 * 2 * 4 * 64 * (len(engine.units) - 1)
    engine.budget.budget = int((1000 + 2.5 * per_microbatch) / BUDGET_MARGIN)
    engine.budget.peak_source = lambda: 1000 + (engine.budget.in_flight or 1) * per_microbatch  # a GPU where 2 fit
    trainer.train()
    assert engine.budget.in_flight == 2  # 4 micro-batches per step, as 2 groups of 2
    assert_close_params(state_of(ref), state_of(model), ATOL_PARAMS)


def test_gpu_budget_measures_per_microbatch_growth_and_frozen_embeddings(tmp_path, group_calls):
    """The peak's growth per micro-batch (here 3x the checkpoints: say, full logits) limits the groups,
    and a LoRA model (frozen embedding: no graph call at unit 0) is measured too."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model("llama", attention_dropout=0.0),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    trainer = Trainer(model=model, args=training_args(tmp_path, gradient_accumulation_steps=4),
                      train_dataset=RandomTokens(), callbacks=[MegaTrainPlugin(max_gpu_memory="1GiB", offload_checkpoints=False)])
    engine = engine_of(model)
    ckpt = 16 * 2 * 4 * 64 * (len(engine.units) - 1)  # per micro-batch; unit 0 (frozen) saves nothing
    engine.budget.budget = int((10_000 + 7 * ckpt) / BUDGET_MARGIN)  # fits 2 of the real growth, 6 of the naive
    engine.budget.peak_source = lambda: 10_000 + 3 * ckpt * (engine.budget.in_flight or 1)
    trainer.train()
    assert engine.budget.per_microbatch_bytes == ckpt
    assert group_calls == [1] * 4 + [2] * 2 + [2] * 8
    assert engine.budget.in_flight == 2


def test_gpu_budget_after_a_one_microbatch_step(tmp_path, group_calls):
    """A step of one micro-batch (the end of an epoch) is measured as one in flight, not as the
    previous step's group size (which made the next step overshoot)."""
    model = tiny_model("llama", attention_dropout=0.0)
    trainer = Trainer(model=model, args=training_args(tmp_path, gradient_accumulation_steps=4, max_steps=-1,
                                                      num_train_epochs=3),
                      train_dataset=RandomTokens(n=18),  # 9 micro-batches per epoch: 4, 4, 1
                      callbacks=[MegaTrainPlugin(max_gpu_memory="1GiB", offload_checkpoints=False)])
    engine = engine_of(model)
    per = 16 * 2 * 8 + 16 * 2 * 4 * 64 * (len(engine.units) - 1)
    engine.budget.budget = int((1000 + 2.5 * per) / BUDGET_MARGIN)  # 2 fit, 3 do not
    engine.budget.peak_source = lambda: 1000 + (engine.budget.in_flight or 1) * per
    trainer.train()
    assert max(group_calls) == 2


def test_config_rejects_bad_gpu_budget():
    from megatrain_hf import MegaTrainConfig

    for bad in ("lots", 0, -5, "0GiB", True):
        with pytest.raises(MegatrainConfigError, match=r"max_gpu_memory=.*allowed: None, a positive byte count"):
            MegaTrainConfig(max_gpu_memory=bad)
    assert MegaTrainConfig(max_gpu_memory="24GiB").gpu_memory_bytes() == 24 * 2**30
    assert MegaTrainConfig(max_gpu_memory="1.5 GB").gpu_memory_bytes() == 1_500_000_000


# ---------------------------------------------------------------------------------- review findings
def test_autocast_disabled_inside_a_micro_batch_is_respected():
    """A micro-batch that turns autocast off keeps fp32 although the caller has it on."""
    model = tiny_model("llama", attention_dropout=0.0)
    engine = attach(model, device="cpu")
    ids = torch.randint(0, 128, (2, 16))
    dtypes = {}

    def step(k):
        def fn():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
                logits = model(input_ids=ids).logits
            dtypes[k] = logits.dtype
            engine.backward(logits.float().mean())
            return 0
        return fn

    with torch.autocast("cpu", dtype=torch.bfloat16):
        engine.run_layer_major([step(0), step(1)])
    assert dtypes == {0: torch.float32, 1: torch.float32}


def test_saved_tensor_hooks_apply_to_streamed_checkpoints():
    """saved_tensors_hooks (e.g. save_on_cpu) active in a micro-batch see the units' checkpoints too."""
    model = tiny_model("llama", attention_dropout=0.0)
    engine = attach(model, device="cpu")
    ids = torch.randint(0, 128, (2, 16))
    packed = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t

    def fn():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        engine.backward(loss / 2)
        return loss.detach()

    engine.run_layer_major([fn, fn])
    # 2 decoder layers + final norm + head take (2, 16, 64) hidden states: 4 per micro-batch
    assert sum(1 for s in packed if s == (2, 16, 64)) >= 8


def test_ctrl_c_while_starting_the_coroutines():
    import signal

    from megatrain_hf.runtime import layer_major

    def first():
        signal.raise_signal(signal.SIGINT)
        return 0

    # Python's own handler (an earlier test's library may have installed another): SIGINT -> KeyboardInterrupt
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            layer_major.run(object(), torch.device("cpu"), [first, lambda: 1, lambda: 2], lambda *a: None,
                            lambda i: None)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not _microbatch_threads()


def _trl_run(out, callbacks, gradient_accumulation_steps=2, max_steps=3):
    """TRL's SFTTrainer on the tiny llama (random token ids, a word-level tokenizer); returns
    (trainer, model, losses)."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    data = RandomTokens(n=24)
    dataset = datasets.Dataset.from_dict({"input_ids": [data[i]["input_ids"].tolist() for i in range(24)]})
    vocab = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=vocab, pad_token="[PAD]", eos_token="[PAD]", unk_token="[UNK]")
    model = tiny_model("llama", attention_dropout=0.0)
    config = trl.SFTConfig(output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=2,
                           gradient_accumulation_steps=gradient_accumulation_steps, learning_rate=2e-3, report_to=[],
                           use_cpu=True, logging_steps=1, disable_tqdm=True, save_strategy="no", seed=0, data_seed=0,
                           dataset_kwargs={"skip_prepare_dataset": True})
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                             callbacks=callbacks)
    trainer.train()
    return trainer, model, [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trl_sft_trainer_layer_major(tmp_path, group_calls):
    """TRL's SFTTrainer (a Trainer subclass): layer-major accumulation, the chunked loss off (subclasses
    may read logits), TRL's metrics; same losses and parameters as SFTTrainer without megatrain."""
    _, ref, ref_losses = _trl_run(tmp_path / "ref", [])
    # 2 micro-batches: the device sums add in plain accumulation's order whatever the threads'
    # timing (with 3, autograd may order the head's sums differently under load; see the top)
    trainer, model, losses = _trl_run(tmp_path / "mt", [MegaTrainPlugin()])
    assert group_calls == [2, 2, 2] and not engine_of(model).chunked_loss_active
    assert "mean_token_accuracy" in trainer.state.log_history[0]  # TRL's metrics
    assert_close_losses(ref_losses, losses, ATOL)
    assert_close_params(state_of(ref), state_of(model), ATOL_PARAMS)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_trl_fused_lm_head_runs_in_the_head_unit(tmp_path, monkeypatch, accumulation):
    """trl >= 1 computes SFTTrainer's loss with a *fused LM head* that reads ``lm_head.weight``
    itself: the host master, which the background update may still be writing (seen as a rare
    flake under load; an update slowed down here makes it certain). megatrain serves it in the head
    unit instead, on the weights fetched after their update: bitwise SFTTrainer's losses and
    parameters, with the update slowed."""
    utils = pytest.importorskip("trl.trainer.utils")
    if not hasattr(utils, "add_fused_lm_head"):
        pytest.skip("this trl has no fused LM head")
    from megatrain_hf.integrations import trl as megatrain_trl
    from megatrain_hf.optim.update_worker import UnitUpdater

    _, ref, ref_losses = _trl_run(tmp_path / "ref", [], accumulation)
    run_job = UnitUpdater.update

    def slow_update(self, job, kernel=None):
        time.sleep(0.05)  # the next forward must wait for it; a read that does not sees old weights
        return run_job(self, job, kernel)

    served = []
    forward = megatrain_trl.FusedLogProbs.forward
    monkeypatch.setattr(UnitUpdater, "update", slow_update)
    monkeypatch.setattr(megatrain_trl.FusedLogProbs, "forward", lambda self, *a: served.append(1) or forward(self, *a))
    trainer, model, losses = _trl_run(tmp_path / "mt", [MegaTrainPlugin()], accumulation)
    assert len(served) == 3 * accumulation  # every micro-batch's head ran in the engine's head unit
    assert "mean_token_accuracy" in trainer.state.log_history[0] and "entropy" in trainer.state.log_history[0]
    assert losses == ref_losses
    got = state_of(model)
    for name, value in state_of(ref).items():
        assert torch.equal(value, got[name]), name
