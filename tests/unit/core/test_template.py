"""core/template.py on its own: weight-less templates, binding, hook mirroring and the replay rule."""

from __future__ import annotations

import torch
from torch import nn

from megatrain_hf.core.template import HookRecord, Template, TemplateCache, structure_key


class Layer(nn.Module):
    def __init__(self, layer_idx: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layer_idx = layer_idx
        self.factor = 1.0
        self.inner = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.register_buffer("shift", torch.full((4,), float(layer_idx)))

    def forward(self, x):
        return self.norm(self.inner(x)) * self.factor + self.shift


def _tensors(real: nn.Module, requires_grad: bool = False) -> dict[str, torch.Tensor]:
    """The unit's own tensors, as the streamer would hand them (fresh tensors, not the Parameters)."""
    out = {n: p.detach().clone().requires_grad_(requires_grad) for n, p in real.named_parameters()}
    out.update({n: b.clone() for n, b in real.named_buffers()})
    return out


def _compute(template: Template, real: nn.Module, x, hooks=None, recompute=False, requires_grad=False):
    module = template.bind(_tensors(real, requires_grad), template.mirror_of(real), hooks, recompute)
    try:
        return module.forward(x)  # as the engine calls it: the real unit's own __call__ ran its hooks
    finally:
        template.unbind()


# ---------------------------------------------------------------------- cache
def test_units_of_one_structure_share_a_template():
    cache = TemplateCache()
    a, b = Layer(0, 0), Layer(1, 1)
    assert cache.get(a) is cache.get(b) and len(cache) == 1
    frozen = Layer(2, 2)
    frozen.inner.weight.requires_grad_(False)  # another trainability: another template
    assert cache.get(frozen) is not cache.get(a) and len(cache) == 2
    wider = nn.Linear(4, 8)
    assert structure_key(wider) != structure_key(nn.Linear(4, 4))
    cache.get(wider)
    cache.get(nn.Linear(4, 8))
    assert len(cache) == 3
    bf16 = Layer(3, 3).to(torch.bfloat16)  # another dtype: another template
    assert cache.get(bf16) is not cache.get(a) and len(cache) == 4


def test_a_template_holds_no_memory_and_no_real_tensor():
    real = Layer(0, 0)
    template = Template(real)
    for p in template.module.parameters():
        assert p.device.type == "meta"
    for b in template.module.buffers():
        assert b.device.type == "meta"
    assert set(template.slots) == {"inner.weight", "inner.bias", "norm.weight", "norm.bias", "shift"}
    assert template.slots["shift"].is_buffer and not template.slots["inner.weight"].is_buffer
    # trainability is kept on the meta copies
    frozen = Layer(0, 0)
    frozen.norm.bias.requires_grad_(False)
    assert not Template(frozen).module.norm.bias.requires_grad


# ---------------------------------------------------------------------- binding
def test_bind_puts_the_given_tensors_in_the_slots_and_computes_like_the_real_unit():
    real = Layer(5, 0)
    template = Template(real)
    tensors = _tensors(real)
    module = template.bind(tensors, template.mirror_of(real))
    assert module.inner.weight is tensors["inner.weight"] and module.norm.bias is tensors["norm.bias"]
    assert module.shift is tensors["shift"]
    x = torch.randn(3, 4)
    assert torch.equal(module.forward(x), real(x))
    template.unbind()


def test_bind_mirrors_plain_attributes_at_bind_time():
    real = Layer(7, 0)
    template = Template(real)
    mirror = template.mirror_of(real)
    real.factor = 3.0  # changed after the mirror was made: bind reads the live value
    real.eval()
    real.inner.extra_flag = "on"  # a new attribute of a sub-module after mirror_of: not mirrored
    module = template.bind(_tensors(real), mirror)
    assert module.layer_idx == 7 and module.factor == 3.0
    assert not module.training and not module.inner.training
    x = torch.randn(2, 4)
    assert torch.equal(module.forward(x), real(x))
    template.unbind()
    other = Layer(1, 1)
    module = template.bind(_tensors(other), template.mirror_of(other))
    assert module.layer_idx == 1 and module.factor == 1.0 and module.training
    template.unbind()


def test_unbind_drops_the_tensors():
    real = Layer(0, 0)
    template = Template(real)
    module = template.bind(_tensors(real), template.mirror_of(real))
    template.unbind()
    assert module.inner.weight is None and module.norm.weight is None and module.shift is None
    assert all(p is None for p in module._parameters.values())


def test_template_forces_gradient_checkpointing_off():
    real = Layer(0, 0)
    real.gradient_checkpointing = True
    template = Template(real)
    assert template.module.gradient_checkpointing is False
    module = template.bind(_tensors(real), template.mirror_of(real))
    assert module.gradient_checkpointing is False  # not mirrored either
    template.unbind()


# ---------------------------------------------------------------------- hooks
def test_a_template_carries_none_of_the_real_modules_hooks():
    real = Layer(0, 0)
    fired = []
    real.register_forward_hook(lambda m, a, o: fired.append("root"))
    real.inner.register_forward_hook(lambda m, a, o: fired.append("inner"))
    real.norm.register_forward_pre_hook(lambda m, a: fired.append("norm-pre"))
    real.inner.register_full_backward_hook(lambda m, gi, go: fired.append("inner-bw"))
    template = Template(real)
    for m in template.module.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks
    # the real module keeps its hooks
    assert len(real._forward_hooks) == 1 and len(real.inner._forward_hooks) == 1
    # computing another unit of the template fires none of them
    other = Layer(1, 1)
    x = torch.randn(2, 4, requires_grad=True)
    out = _compute(template, other, x, requires_grad=True, hooks=HookRecord(), recompute=True)
    out.sum().backward()
    assert fired == []


def test_sub_module_hooks_fire_only_for_their_own_unit():
    a, b = Layer(0, 0), Layer(1, 1)
    fired = []
    a.inner.register_forward_hook(lambda m, args, out: fired.append(("a.inner", out.shape)))
    cache = TemplateCache()
    template = cache.get(a)
    assert cache.get(b) is template
    x = torch.randn(2, 4)
    _compute(template, a, x)
    assert fired == [("a.inner", torch.Size([2, 4]))]
    _compute(template, b, x)  # the same template computing another unit: a's hook stays out
    assert len(fired) == 1
    _compute(template, a, x)
    assert len(fired) == 2


def test_a_modifying_sub_module_hook_changes_the_template_output():
    real = Layer(0, 0)
    x = torch.randn(2, 4)
    plain = _compute(Template(real), real, x)
    real.inner.register_forward_hook(lambda m, args, out: out * 2)
    expected = real(x)
    assert not torch.equal(plain, expected)
    assert torch.equal(_compute(Template(real), real, x), expected)


def test_recording_and_replay_rule():
    """Forward (record, no recompute): every hook once, the modifying ones recorded. Recompute: only
    the recorded ones again, so the recomputed output is the forward's; backward hooks only there."""
    real = Layer(0, 0)
    ran = []

    def modifying_pre(m, args):
        ran.append("modifying-pre")
        return (args[0] + 1.0,)

    def observing_pre(m, args):
        ran.append("observing-pre")

    def modifying(m, args, out):
        ran.append("modifying")
        return out * 2

    def observing(m, args, out):
        ran.append("observing")

    def backward(m, grad_in, grad_out):
        ran.append("backward")

    real.inner.register_forward_pre_hook(modifying_pre)
    real.inner.register_forward_pre_hook(observing_pre)
    real.norm.register_forward_hook(modifying)
    real.norm.register_forward_hook(observing)
    real.inner.register_full_backward_hook(backward)
    template = Template(real)
    x = torch.randn(2, 4, requires_grad=True)
    record = HookRecord()

    with torch.no_grad():  # the forward of a training call (its graph is recomputed later)
        forward_out = _compute(template, real, x, hooks=record)
    assert sorted(ran) == ["modifying", "modifying-pre", "observing", "observing-pre"]
    assert len(record.modifying) == 2
    ran.clear()

    with torch.enable_grad():
        out = _compute(template, real, x, hooks=record, recompute=True, requires_grad=True)
    assert sorted(ran) == ["modifying", "modifying-pre"]  # the observers fired once, in the forward
    assert torch.equal(out, forward_out)
    ran.clear()
    out.sum().backward()
    assert ran == ["backward"]  # the recompute is the pass with a graph
    assert torch.equal(forward_out, real(x).detach())  # the hooks' effect is the real module's


def test_backward_hooks_do_not_run_in_the_forward():
    real = Layer(0, 0)
    ran = []
    real.inner.register_full_backward_hook(lambda m, gi, go: ran.append("backward"))
    template = Template(real)
    x = torch.randn(2, 4, requires_grad=True)
    out = _compute(template, real, x, hooks=HookRecord(), recompute=False, requires_grad=True)
    out.sum().backward()
    assert ran == []


def test_without_a_record_every_hook_runs_once():
    """A call without a recompute (no grad: eval, generation) runs every forward hook once."""
    real = Layer(0, 0)
    ran = []
    real.inner.register_forward_hook(lambda m, a, o: ran.append("observing"))
    real.inner.register_forward_hook(lambda m, a, o: (ran.append("modifying"), o + 1)[1])
    template = Template(real)
    x = torch.randn(2, 4)
    with torch.no_grad():
        out = _compute(template, real, x)
    assert ran == ["observing", "modifying"]  # registration order
    assert torch.equal(out, real(x))
