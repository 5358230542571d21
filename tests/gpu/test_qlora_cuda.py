"""On a CUDA GPU: the quantized base's dequantization on the device against the CPU's, bit for bit,
and LoRA on an NF4 base through Trainer on the GPU against the same run on the CPU.

Marked `gpu` (skipped without CUDA). The dequantization is two fp32 multiplications and one
addition per element, as separate kernels, so the device's result must equal the host's exactly.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import state_of, tiny_model, train, training_args
from megatrain_hf import MegaTrainPlugin, engine_of
from megatrain_hf.core import frozen_formats as Q

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.mark.parametrize("scheme", Q.SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_dequantization_equals_the_host_bitwise(scheme, dtype, monkeypatch):
    w = torch.randn(1024, 4096, generator=torch.Generator().manual_seed(0)) * 0.02
    fmt = Q.quant_format(scheme, tuple(w.shape), dtype)
    raw = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    Q.quantize_tensor(fmt, w, raw)
    host = Q.dequantize(fmt, raw)
    assert torch.equal(Q.dequantize(fmt, raw.cuda()).cpu(), host)
    monkeypatch.setattr(Q, "DEQUANT_CHUNK_ELEMENTS", 4096 * 7)  # chunked on the device too
    assert torch.equal(Q.dequantize(fmt, raw.cuda()).cpu(), host)


def test_lora_on_an_nf4_base_on_the_gpu_matches_the_cpu(tmp_path):
    peft = pytest.importorskip("peft")

    def run(device: str):
        model = peft.get_peft_model(tiny_model("llama", attention_dropout=0.0), peft.LoraConfig(
            r=4, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], lora_dropout=0.0))
        args = training_args(tmp_path / device, use_cpu=device == "cpu")
        _, losses = train(model, args, callbacks=[MegaTrainPlugin(base_quantization="nf4", compute_dtype="fp32")])
        assert engine_of(model).device.type == device
        return losses, {n: p for n, p in state_of(model).items() if "lora_" in n}

    cpu_losses, cpu_state = run("cpu")
    gpu_losses, gpu_state = run("cuda")
    assert max(abs(a - b) for a, b in zip(cpu_losses, gpu_losses)) < 1e-4
    assert max((cpu_state[n] - gpu_state[n]).abs().max().item() for n in cpu_state) < 1e-3
