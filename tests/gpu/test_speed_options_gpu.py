"""On a CUDA GPU: the speed options with megatrain against the same options on plain full-GPU Trainer.

* ``torch_compile=True``: megatrain compiles its layer templates (``runtime/compiled.py``); plain Trainer
  compiles the whole model. Both in bf16 with inductor.
* ``use_liger_kernel=True``: Liger's RMSNorm, SwiGLU and rotary kernels in both; plain Trainer's head is
  Liger's fused linear cross-entropy, megatrain's its chunked loss in the head unit (the same loss).

Marked `gpu` (skipped without CUDA); tolerances are those of ``test_cuda_parity.py`` (bf16); measured
differences go to $MEGATRAIN_GPU_REPORT like the other GPU parity tests.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_cuda_parity import (BF16_LOSS_ATOL, BF16_UPDATE_RTOL, SHAPE, _args, _data, _report,
                                        assert_close_updates)
from tests.helpers import assert_close_losses, state_of, tiny_model, train
from megatrain_hf import MegaTrainPlugin, engine_of

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

NO_DROPOUT = {**SHAPE, "attention_dropout": 0.0}


def _pair(tmp_path, name: str, update_rtol: float = BF16_UPDATE_RTOL, **options):
    ref = tiny_model("llama", **NO_DROPOUT)
    init = state_of(ref)
    _, ref_losses = train(ref, _args(tmp_path / "ref", bf16=True, **options), dataset=_data())
    model = tiny_model("llama", **NO_DROPOUT)
    _, losses = train(model, _args(tmp_path / "mt", bf16=True, **options), dataset=_data(),
                      callbacks=[MegaTrainPlugin()])
    ref_state = {n: p.cpu() for n, p in state_of(ref).items()}
    _report(name, ref_losses, losses, ref_state, state_of(model))
    assert_close_losses(ref_losses, losses, BF16_LOSS_ATOL)
    assert_close_updates(init, ref_state, state_of(model), update_rtol)
    return model


def test_bf16_parity_torch_compile(tmp_path):
    # plain Trainer compiles the whole model, megatrain each layer: inductor fuses the bf16 roundings at other
    # places. Measured on an H100 at 6872d95: losses within 8.7e-5 (eager megatrain: 1.1e-4), the largest update
    # difference 0.055 of its norm (embed_tokens; eager megatrain stays under BF16_UPDATE_RTOL = 0.05)
    model = _pair(tmp_path, "bf16_parity_torch_compile_llama", update_rtol=0.08, torch_compile=True)
    compiler = engine_of(model).runner.compiler
    assert compiler is not None and compiler.backend == "inductor"
    assert compiler.compiled_calls > 0 and compiler.recompiles == 0 and compiler.graph_breaks == 0


def test_bf16_parity_liger(tmp_path):
    pytest.importorskip("liger_kernel")
    from transformers.models.llama import modeling_llama

    saved = (modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP,
             modeling_llama.LlamaForCausalLM.forward)
    try:
        # plain Trainer's head is Liger's fused linear cross-entropy, megatrain's the chunked loss: the logits'
        # gradient is rounded to bf16 at other places. Measured on an H200 at ef269f3: losses within 2.4e-4, the
        # largest update difference 0.057 of its norm (embed_tokens, as under compile), the rest under 0.05
        model = _pair(tmp_path, "bf16_parity_liger_llama", update_rtol=0.08, use_liger_kernel=True)
    finally:
        (modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP,
         modeling_llama.LlamaForCausalLM.forward) = saved
    layer = model.model.layers[0]
    assert layer.mlp.__dict__["forward"].__func__.__qualname__ == "LigerSwiGLUMLP.forward"
    assert engine_of(model).chunked_loss_active
