"""The native host AdamW kernel (megatrain_hf/csrc/host_adamw.cpp) against torch's fused AdamW.

The kernel follows torch's vectorised fp32 path op for op (one FMA in the lerp, nothing else
fused), so it agrees with torch bitwise except on the few elements torch handles in the scalar
tail of each of its parallel chunks (a non-fused lerp there: one rounding apart). Tested on
CPU with clipping, two weight-decay groups, parameters without gradients in a step, bf16
staging written in the same pass, and through Trainer.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close_losses, assert_close_params, state_of, tiny_model, train, training_args
from megatrain_hf import HostAdamW, MegaTrainPlugin, attach, engine_of
from megatrain_hf.optim import native

pytestmark = pytest.mark.skipif(native.host_adamw() is None, reason="no C++ compiler to build the kernel")


def _groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


@pytest.mark.parametrize("clip", [None, 0.37])
def test_native_matches_torch_fused_adamw(clip):
    models = [tiny_model("llama", hidden_size=96, intermediate_size=200), tiny_model("llama", hidden_size=96,
                                                                                       intermediate_size=200)]
    engine = attach(models[1], device="cpu", config=None, bf16=True)  # bf16: a staging copy exists
    ref_opt = torch.optim.AdamW(_groups(models[0]), lr=3e-3, betas=(0.9, 0.95), eps=1e-7, fused=True)
    opt = HostAdamW(_groups(models[1]), store=engine.store, lr=3e-3, betas=(0.9, 0.95), eps=1e-7, kernel="native")
    assert opt.kernel == "native"
    for step in range(5):
        grads = {}
        torch.manual_seed(step)
        for n, p in models[0].named_parameters():
            grads[n] = torch.randn_like(p) * (10.0 ** (step % 3 - 2))
        for model, optimizer in ((models[0], ref_opt), (models[1], opt)):
            for n, p in model.named_parameters():
                p.grad = grads[n].clone()
            if step == 2:  # a parameter without a gradient keeps its step count
                model.model.layers[0].mlp.up_proj.weight.grad = None
            if clip is not None:
                if optimizer is ref_opt:
                    torch._foreach_mul_([p.grad for p in model.parameters() if p.grad is not None], clip)
                else:
                    optimizer.set_clip_coef(torch.tensor(clip))
            optimizer.step()
            optimizer.zero_grad()
    opt.synchronize()
    ref, got = state_of(models[0]), state_of(models[1])
    exact = sum(int(torch.equal(ref[n], got[n])) for n in ref)
    differing = sum(int((ref[n] != got[n]).sum()) for n in ref)
    total = sum(v.numel() for v in ref.values())
    # torch's scalar tails: a handful of elements per chunk may be one rounding apart
    print(f"native vs torch: {differing} of {total} elements differ, {exact} tensors bitwise equal")
    assert differing <= total * 0.01, (differing, total, exact)
    assert_close_params(ref, got, atol=1e-7, rtol=1e-6)
    for n, p in models[1].named_parameters():
        e = engine.store.home_of(p)[1]
        if e.wire == torch.bfloat16:  # the staging copy written in the same pass
            staged = engine.store.buffers[e.owner].staging_host[e.offset : e.offset + e.numel]
            assert torch.equal(staged, p.detach().reshape(-1).to(torch.bfloat16)), n
    assert all(engine.store.staging.fresh(u) for u, b in enumerate(engine.store.buffers) if b.staging_host is not None)
    for p_ref, p in zip(models[0].parameters(), models[1].parameters()):
        st_ref, st = ref_opt.state[p_ref], opt.state[p]
        assert float(st_ref["step"]) == float(st["step"])
        torch.testing.assert_close(st["exp_avg_sq"], st_ref["exp_avg_sq"], atol=0, rtol=1e-6)


def test_trainer_with_native_kernel(tmp_path):
    ref_model = tiny_model("llama")
    _, ref_losses = train(ref_model, training_args(tmp_path / "ref"))
    model = tiny_model("llama")
    trainer, losses = train(model, training_args(tmp_path / "mt"), callbacks=[MegaTrainPlugin(host_adamw_kernel="native")])
    assert trainer.optimizer.optimizer.kernel == "native"
    assert engine_of(model) is not None
    assert_close_losses(ref_losses, losses, 1e-6)
    assert_close_params(state_of(ref_model), state_of(model), 1e-6)


def test_build_failure_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    native.host_adamw.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="megatrain_hf.native"):
            assert native.host_adamw() is None
        assert "unavailable" in caplog.text
        model = tiny_model("llama")
        engine = attach(model, device="cpu")
        assert HostAdamW(model.parameters(), store=engine.store, kernel="native").kernel == "torch"
    finally:
        native.host_adamw.cache_clear()



def test_native_kernel_over_many_chunks_and_threads():
    """Tensors of odd sizes (one empty) spanning several of the kernel's work chunks, which the
    threads take from a shared counter: any thread count gives the same bits, every element is
    updated once (against torch's fused AdamW), and the staging copy is the result in bf16."""
    lib = native.host_adamw()
    sizes = [1, 300_001, 0, 262_143, 524_289, 77]  # > 4 chunks of 2^18 elements, boundaries inside tensors
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen) for n in sizes]
    lr, wd, b1, b2, eps, clip = 1e-2, 0.1, 0.9, 0.95, 1e-8, 0.5
    scalars = dict(decay=[1 - lr * wd] * len(sizes), lerp=[1 - b1] * len(sizes), beta2=[b2] * len(sizes),
                   sq_coef=[1 - b2] * len(sizes), bc2_sqrt=[(1 - b2) ** 0.5] * len(sizes), eps=[eps] * len(sizes),
                   neg_step_size=[-lr / (1 - b1)] * len(sizes))
    results = []
    for threads in (1, 3, 8):
        ps = [b.clone() for b in base]
        ms, vs = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
        stages = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
        native.adamw(lib, ps, grads, ms, vs, stages, scalars, clip, False, threads)
        results.append((ps, ms, vs, stages))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    ps, ms, vs, stages = results[0]
    ref = [b.clone() for b in base]
    ref_m, ref_v = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
    torch._fused_adamw_(ref, [g * clip for g in grads], ref_m, ref_v, [], [torch.tensor(1.0)] * len(sizes),
                        amsgrad=False, lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps, maximize=False,
                        grad_scale=None, found_inf=None)
    for p, r, s in zip(ps, ref, stages):
        torch.testing.assert_close(p, r, atol=1e-7, rtol=1e-6)
        assert torch.equal(s, p.to(torch.bfloat16))
    assert all(not torch.equal(p, b) for p, b in zip(ps, base) if p.numel())  # every tensor was updated
