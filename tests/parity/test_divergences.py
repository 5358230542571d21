"""Ordinary uses of Trainer where megatrain once trained differently without a word: each now behaves as
plain Trainer does (CPU, fp32, every loss and parameter within 1e-6), or is refused with the way out.

The list of what megatrain replaces, and how each stays exact, is in docs/architecture.md.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from transformers import Trainer, TrainerCallback, get_linear_schedule_with_warmup

from tests.helpers import (
    RandomTokens,
    assert_close_losses,
    assert_close_params,
    state_of,
    tiny_model,
    train,
    training_args,
)
from megatrain_hf import MegaTrainPlugin, attach, engine_of
from megatrain_hf.errors import AttachedModelError, IncompatibleOptionsError

ATOL = 1e-6


def _both(tmp_path, build, args=None, callbacks=lambda model: [], **trainer_kwargs):
    """Train ``build()`` under plain Trainer and under megatrain; return both (losses, params, extras)."""
    out = []
    for name, plugin in (("ref", []), ("mt", [MegaTrainPlugin()])):
        model = build()
        extra = callbacks(model)
        kwargs = {k: (v(model) if callable(v) else v) for k, v in trainer_kwargs.items()}
        trainer, losses = train(model, training_args(tmp_path / name, **(args or {})), callbacks=[*plugin, *extra],
                                **kwargs)
        out.append((losses, state_of(model), extra, trainer, model))
    return out


def _assert_same(ref, got):
    assert_close_losses(ref[0], got[0], ATOL)
    assert_close_params(ref[1], got[1], ATOL)


# ---------------------------------------------------------------------------------- 1. optimizer + scheduler
@pytest.mark.slow  # ~5-10 s: in `make test`, not in `make test-fast`
def test_user_optimizer_and_scheduler_stay_bound(tmp_path):
    """Trainer(optimizers=(AdamW, warmup schedule)): the scheduler drives the optimizer that steps
    (once the AdamW was replaced and its learning rate stayed 0 under warmup: nothing trained)."""

    def optimizers(model):
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
        return opt, get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=6)

    ref, got = _both(tmp_path, lambda: tiny_model("llama"), optimizers=optimizers)
    _assert_same(ref, got)
    trainer = got[3]
    assert trainer.lr_scheduler.optimizer is getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert any(not torch.equal(a, b) for a, b in zip(state_of(tiny_model("llama")).values(), got[1].values()))


# ---------------------------------------------------------------------------------- 2. tensor hooks
def _mask_new_rows(model):
    """The usual way to train only new token rows of the embedding: a hook masks the others."""
    weight = model.get_input_embeddings().weight
    mask = torch.zeros_like(weight)
    mask[-8:] = 1.0
    calls = []
    weight.register_hook(lambda g: g * mask)
    weight.register_post_accumulate_grad_hook(lambda p: calls.append(float(p.grad.abs().sum())))
    return [calls]


@pytest.mark.slow  # ~5-10 s: in `make test`, not in `make test-fast`
def test_parameter_tensor_hooks_run_as_autograd_runs_them(tmp_path):
    ref, got = _both(tmp_path, lambda: _hooked(tiny_model("llama", attention_dropout=0.0)), args=dict(weight_decay=0.0))
    _assert_same(ref, got)
    rows = got[1]["model.embed_tokens.weight"][:-8]
    assert torch.equal(rows, state_of(tiny_model("llama", attention_dropout=0.0))["model.embed_tokens.weight"][:-8])
    assert _HOOK_CALLS[id(ref[4])] == _HOOK_CALLS[id(got[4])] and len(_HOOK_CALLS[id(got[4])]) == 12


_HOOK_CALLS: dict[int, list] = {}


def _hooked(model):
    _HOOK_CALLS[id(model)] = _mask_new_rows(model)[0]
    return model


def test_layer_major_refuses_parameters_with_tensor_hooks():
    model = _hooked(tiny_model("llama", attention_dropout=0.0))
    engine = attach(model, device="cpu")
    ids = torch.randint(0, 128, (2, 16))
    with pytest.raises(IncompatibleOptionsError, match=r"tensor hooks.*layer_major=False"):
        engine.accumulate([lambda: model(input_ids=ids, labels=ids).loss] * 2)


# ---------------------------------------------------------------------------------- 3. trainability
class _FreezeAtStep(TrainerCallback):
    """Progressive freezing: the first layer stops training from optimizer step 3 on."""

    def __init__(self, model):
        self.model = model

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 2:
            for p in self.model.model.layers[0].parameters():
                p.requires_grad_(False)


@pytest.mark.slow  # ~5-10 s: in `make test`, not in `make test-fast`
def test_requires_grad_turned_off_during_training_is_followed(tmp_path):
    ref, got = _both(tmp_path, lambda: tiny_model("llama"), callbacks=lambda m: [_FreezeAtStep(m)])
    _assert_same(ref, got)


def test_unfreezing_a_parameter_frozen_at_attach_is_refused(tmp_path):
    model = tiny_model("llama")
    for p in model.model.layers[0].mlp.parameters():
        p.requires_grad_(False)
    trainer = Trainer(model=model, args=training_args(tmp_path), train_dataset=RandomTokens(),
                      callbacks=[MegaTrainPlugin()])
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(True)
    with pytest.raises(AttachedModelError, match=r"mlp.up_proj.weight was frozen .* when megatrain attached.*Fix"):
        trainer.train()


# ---------------------------------------------------------------------------------- 4. recorded outputs, module hooks
def _ids():
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))


def test_output_attentions_and_hidden_states_equal_plain():
    ref = tiny_model("llama", attention_dropout=0.0, attn_implementation="eager")
    ref.eval()
    with torch.no_grad():
        ref(input_ids=_ids(), output_hidden_states=True)  # a capturing forward before attach
        expected = ref(input_ids=_ids(), output_attentions=True, output_hidden_states=True)
    model = tiny_model("llama", attention_dropout=0.0, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        model(input_ids=_ids(), output_hidden_states=True)
    attach(model, device="cpu")
    with torch.no_grad():
        got = model(input_ids=_ids(), output_attentions=True, output_hidden_states=True)
    assert len(got.attentions) == len(expected.attentions) == 2
    assert len(got.hidden_states) == len(expected.hidden_states) == 3
    for a, b in zip((*expected.attentions, *expected.hidden_states), (*got.attentions, *got.hidden_states)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.mark.slow  # ~5-10 s: in `make test`, not in `make test-fast`
def test_submodule_hooks_fire_once_for_their_own_layer(tmp_path):
    """A forward hook on layers[0].mlp fires for layer 0 only, once per forward (also in training,
    where the backward recomputes the layer), and one that changes the output trains as in plain."""
    counts = {}

    def build():
        model = tiny_model("llama", attention_dropout=0.0)
        seen = counts.setdefault(len(counts), [])
        model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: seen.append(1))
        model.model.layers[1].mlp.register_forward_hook(lambda m, a, out: out * 0.5)
        return model

    ref, got = _both(tmp_path, build)
    _assert_same(ref, got)
    assert len(counts[0]) == len(counts[1]) == 12  # 6 steps x 2 micro-batches, one forward each


# ---------------------------------------------------------------------------------- 5. dropout and the model's mode
@pytest.mark.slow  # ~5-10 s: in `make test`, not in `make test-fast`
def test_layer_major_auto_does_not_depend_on_the_models_mode(tmp_path):
    """A model in eval mode when train() starts (straight after from_pretrained, after an evaluation)
    still has dropout: layer-major stays off and the masks are drawn in plain Trainer's order."""

    def build():
        model = tiny_model("llama")  # attention_dropout=0.1
        model.eval()
        return model

    ref, got = _both(tmp_path, build, args=dict(eval_strategy="steps", eval_steps=2),
                     eval_dataset=RandomTokens(n=4, seed=5))
    _assert_same(ref, got)


# ---------------------------------------------------------------------------------- 6./7. what callbacks see
class _Observer(TrainerCallback):
    """Reads the gradients before the step (and halves them), and keeps an EMA of the weights at step end."""

    def __init__(self, model):
        self.model, self.norms, self.ema = model, [], None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        for g in grads:
            g.mul_(0.5)

    def on_step_end(self, args, state, control, **kwargs):
        current = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        if self.ema is None:
            self.ema = current
        else:
            self.ema = {n: 0.9 * self.ema[n] + 0.1 * current[n] for n in current}


@pytest.mark.slow  # ~5-10 s: in `make test`, not in `make test-fast`
def test_callbacks_see_clipped_gradients_and_finished_updates(tmp_path, caplog):
    with caplog.at_level("INFO", logger="megatrain_hf"):
        ref, got = _both(tmp_path, lambda: tiny_model("llama"), callbacks=lambda m: [_Observer(m)],
                         args=dict(max_grad_norm=0.1))
    _assert_same(ref, got)
    (ref_cb,), (got_cb,) = ref[2], got[2]
    assert got_cb.norms == pytest.approx(ref_cb.norms, abs=1e-6) and max(got_cb.norms) <= 0.1 + 1e-6
    assert_close_params(ref_cb.ema, got_cb.ema, ATOL)
    assert "observe(s) the step's end" in caplog.text and "clipping is applied to them at once" in caplog.text


def test_without_observers_the_update_stays_in_the_background(tmp_path, caplog):
    with caplog.at_level("INFO", logger="megatrain_hf"):
        train(tiny_model("llama"), training_args(tmp_path), callbacks=[MegaTrainPlugin()])
    assert "observe" not in caplog.text


# ---------------------------------------------------------------------------------- 8. copies of the model
def test_deepcopy_and_torch_save_of_an_attached_model():
    model = tiny_model("llama")
    engine = attach(model, device="cpu")
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    clone = copy.deepcopy(model)
    assert engine_of(clone) is None and "forward" not in vars(clone.model.layers[0])
    assert_close_params(state_of(model), state_of(clone), 0.0)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert engine_of(loaded) is None and type(loaded) is type(model)
    assert_close_params(state_of(model), state_of(loaded), 0.0)
    model.eval(), clone.eval()
    with torch.no_grad():  # the copy is a plain model, the original still streams
        torch.testing.assert_close(clone(input_ids=ids).logits, model(input_ids=ids).logits, atol=ATOL, rtol=0)
    engine.detach()


def test_placement_of_an_attached_model():
    """Trainer and Accelerate place the model with .to(device): silent where it computes; a cast or
    another device is refused (its parameters are the fp32 masters in host RAM)."""
    model = tiny_model("llama")
    attach(model, device="cpu")
    assert model.to("cpu") is model and model.float() is model
    with pytest.raises(AttachedModelError, match=r"cannot cast the attached LlamaForCausalLM to torch.bfloat16"):
        model.to(torch.bfloat16)
    with pytest.raises(AttachedModelError, match="cannot cast"):
        model.model.layers[0].half()
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.float32


def test_trainer_output_is_free_of_megatrain_plumbing(tmp_path, caplog, recwarn):
    """No "already on multiple devices" (Trainer) nor "offloaded modules" (save_pretrained) in a run with a save."""
    with caplog.at_level("DEBUG"):
        train(tiny_model("llama"), training_args(tmp_path, save_strategy="steps", save_steps=3),
              callbacks=[MegaTrainPlugin()])
    text = caplog.text + " ".join(str(w.message) for w in recwarn)
    assert "multiple devices" not in text and "offloaded modules" not in text


class _Timer(TrainerCallback):
    """Times the step: reads no parameter or gradient, and says so."""

    megatrain_observes_weights = False

    def on_optimizer_step(self, args, state, control, **kwargs):
        pass


def test_a_callback_that_reads_no_weights_keeps_the_update_in_the_background(tmp_path, caplog):
    with caplog.at_level("INFO", logger="megatrain_hf"):
        train(tiny_model("llama"), training_args(tmp_path), callbacks=[MegaTrainPlugin(), _Timer()])
    assert "observe" not in caplog.text
