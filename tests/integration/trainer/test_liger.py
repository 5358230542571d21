"""TrainingArguments(use_liger_kernel=True) with megatrain, on the CPU: what runs without CUDA.

Liger's Triton kernels launch on CUDA only, so here: Trainer's own patching of the instance reaches the
streamed layers' template (Liger's forwards rebound to it, its attributes mirrored), its fused linear
cross-entropy is replaced by megatrain's chunked loss, the fused head applied by hand is refused, and the
class-level patching before the model is built attaches with Liger's modules in the templates. The
training parity against plain Trainer with Liger is ``tests/gpu/test_liger_gpu.py``. Needs the ``liger``
extra (skipped without it).
"""

from __future__ import annotations

import pytest

pytest.importorskip("liger_kernel")

from transformers import Trainer  # noqa: E402
from transformers.integrations.liger import apply_liger_kernel  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from tests.helpers import RandomTokens, tiny_model, training_args, without_dropout  # noqa: E402
from megatrain_hf import MegaTrainPlugin, attach, engine_of  # noqa: E402
from megatrain_hf.errors import IncompatibleOptionsError  # noqa: E402


@pytest.fixture
def restore_llama(monkeypatch):
    """Liger's class-level patching rewrites transformers' Llama module: undone after the test."""
    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))
    monkeypatch.setattr(modeling_llama.LlamaForCausalLM, "forward", modeling_llama.LlamaForCausalLM.forward)


def _trainer(tmp_path, **args):
    model = tiny_model("llama", **without_dropout("llama"))
    return Trainer(model=model, args=training_args(tmp_path, use_liger_kernel=True, **args),
                   train_dataset=RandomTokens(), callbacks=[MegaTrainPlugin()])


def test_trainer_liger_patches_reach_the_template(tmp_path, restore_llama):
    trainer = _trainer(tmp_path)
    assert trainer.args.liger_kernel_config == {"fused_linear_cross_entropy": False}
    engine = engine_of(trainer.model)
    apply_liger_kernel(trainer.model, trainer.args.liger_kernel_config)  # what Trainer.train() does first
    assert "forward" not in trainer.model.__dict__ or "liger" not in trainer.model.forward.__module__
    plugin = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, MegaTrainPlugin))
    plugin.check_forwards()  # what train() runs first: no refusal, the head is HF's forward with the chunked loss

    unit = engine.units[1]
    tensors = engine.streamer.fetch(1)
    module = unit.template.bind(tensors, unit.mirror)
    try:
        mlp, norm = module.mlp, module.input_layernorm
        assert mlp.__dict__["forward"].__func__.__qualname__ == "LigerSwiGLUMLP.forward"
        assert mlp.__dict__["forward"].__self__ is mlp  # rebound to the template, not the real module
        assert norm.__dict__["forward"].__self__ is norm and norm.casting_mode == "llama" and norm.offset == 0.0
    finally:
        unit.template.unbind()
    assert modeling_llama.apply_rotary_pos_emb.__module__.startswith("liger_kernel")  # module-level: read per call


def test_liger_fused_head_applied_by_hand_is_refused(tmp_path, restore_llama):
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    model = tiny_model("llama", **without_dropout("llama"))
    trainer = Trainer(model=model, args=training_args(tmp_path), train_dataset=RandomTokens(),
                      callbacks=[MegaTrainPlugin()])
    apply_liger_kernel_to_llama(model=model)  # fused_linear_cross_entropy=True by default: model.forward replaced
    with pytest.raises(IncompatibleOptionsError, match=r"fused linear cross-entropy.*lm_head.weight.*Fix: apply "
                                                       r"Liger with fused_linear_cross_entropy=False"):
        trainer.train()


def test_liger_class_patching_before_build(restore_llama):
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    apply_liger_kernel_to_llama(fused_linear_cross_entropy=False)
    model = tiny_model("llama", **without_dropout("llama"))
    engine = attach(model, device="cpu")
    template = engine.units[1].template.module
    assert isinstance(template.mlp, LigerSwiGLUMLP) and isinstance(template.input_layernorm, LigerRMSNorm)
    assert engine.num_templates == len({id(u.template) for u in engine.units})

    apply_liger_kernel_to_llama(fused_linear_cross_entropy=True)  # the class's forward: the fused head
    with pytest.raises(IncompatibleOptionsError, match=r"LlamaForCausalLM is Liger-Kernel's fused linear"):
        attach(tiny_model("llama", **without_dropout("llama")), device="cpu")


def test_liger_on_the_cpu_is_refused_before_training(tmp_path, restore_llama):
    trainer = _trainer(tmp_path)
    with pytest.raises(IncompatibleOptionsError, match=r"use_liger_kernel=True.*cpu.*CUDA only.*Fix"):
        trainer.train()
