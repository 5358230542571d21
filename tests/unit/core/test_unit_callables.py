"""core/unit_callables.py through Template: callables on a unit's modules rebound to the template or refused.

Every form the module docstring names: a method bound to a real sub-module, a partial of one, a closure
holding one or a parameter, a per-instance ``forward`` (sub-module and root), a callable object, a
container, a reference to another unit's parameter, a value changed after attach; plus the message.
"""

from __future__ import annotations

import functools
import types

import pytest
import torch
from torch import nn

from megatrain_hf.core.template import Template
from megatrain_hf.core.unit_callables import UnitCallableError


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x)


class Layer(nn.Module):
    """A layer whose class forward calls ``self.kernel`` when set (axolotl's ``self.apply_qkv`` form)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inner = Inner()
        self.out = nn.Linear(4, 4)

    def forward(self, x):
        h = self.kernel(x) if "kernel" in vars(self) else self.inner(x)
        return self.out(h)


def project(module: nn.Module, x):
    return module.proj(x) * 2


def project_keyword(x, module: nn.Module):
    return project(module, x)


def _streamed(real: nn.Module) -> dict[str, torch.Tensor]:
    """The unit's tensors as the streamer hands them: fresh leaves, not the Parameters."""
    return {n: p.detach().clone().requires_grad_() for n, p in real.named_parameters()}


def _run(real: nn.Module, streamed=frozenset()):
    """(output, streamed tensors, template) of the template computing ``real``; backward run on the output."""
    template = Template(real)
    mirror = template.mirror_of(real, streamed, "layers.0")
    tensors = _streamed(real)
    module = template.bind(tensors, mirror)
    out = module.forward(torch.ones(2, 4))
    out.sum().backward()
    template.unbind()
    return out, tensors, template


def _expected(real: nn.Module, kernel) -> torch.Tensor:
    return real.out(kernel(torch.ones(2, 4)))


@pytest.mark.parametrize("form", ["method", "partial", "partial_keyword"])
def test_a_method_or_partial_bound_to_a_real_sub_module_is_rebound_to_the_template(form):
    real = Layer()
    real.kernel = {"method": lambda: types.MethodType(project, real.inner),
                   "partial": lambda: functools.partial(project, real.inner),
                   "partial_keyword": lambda: functools.partial(project_keyword, module=real.inner)}[form]()
    out, tensors, _ = _run(real)
    torch.testing.assert_close(out, _expected(real, lambda x: project(real.inner, x)), rtol=0, atol=0)
    # the gradient reached the streamed tensors, and none reached the real (host) parameters
    assert tensors["inner.proj.weight"].grad is not None and tensors["inner.proj.weight"].grad.abs().sum() > 0
    assert all(p.grad is None for p in real.parameters())


def test_a_per_instance_forward_of_a_sub_module_runs_on_the_template():
    calls = []

    def kernel(self, x):
        calls.append(self)
        return self.proj(x) - 1.0

    real = Layer()
    real.inner.forward = types.MethodType(kernel, real.inner)
    out, tensors, template = _run(real)
    torch.testing.assert_close(out, real.out(real.inner.proj(torch.ones(2, 4)) - 1.0), rtol=0, atol=0)
    assert calls == [template.module.inner]  # bound to the template's module, not the real one
    assert tensors["inner.proj.weight"].grad is not None and all(p.grad is None for p in real.parameters())


def test_a_per_instance_forward_of_the_root_runs_on_the_template():
    def forward(self, x):
        return self.out(self.inner(x)) * 3.0

    real = Layer()
    real.forward = types.MethodType(forward, real)
    out, tensors, _ = _run(real)
    torch.testing.assert_close(out, forward(real, torch.ones(2, 4)), rtol=0, atol=0)
    assert all(p.grad is None for p in real.parameters())


def test_a_template_shared_by_units_with_and_without_an_instance_forward():
    with_forward, plain = Layer(0), Layer(1)
    with_forward.inner.forward = types.MethodType(lambda self, x: self.proj(x) * 0.0, with_forward.inner)
    template = Template(with_forward)
    mirrors = [template.mirror_of(m) for m in (with_forward, plain)]
    x = torch.ones(2, 4)
    outs = []
    for real, mirror in zip((with_forward, plain), mirrors):
        outs.append(template.bind(_streamed(real), mirror).forward(x))
        template.unbind()
    torch.testing.assert_close(outs[0], with_forward.out(torch.zeros(2, 4)), rtol=0, atol=0)
    torch.testing.assert_close(outs[1], plain(x), rtol=0, atol=0)  # the other unit's forward did not stay


@pytest.mark.parametrize("form", ["closure_module", "closure_parameter", "partial_nested", "callable_object",
                                  "container", "method_of_closure"])
def test_forms_that_cannot_be_rebound_exactly_are_refused_at_attach(form):
    real = Layer()
    inner, weight = real.inner, real.inner.proj.weight

    class Kernel:
        def __init__(self):
            self.module = inner

        def __call__(self, x):
            return self.module.proj(x)

    def closing(self, x):
        return inner.proj(x)

    real.kernel = {
        "closure_module": lambda: (lambda x: project(inner, x)),
        "closure_parameter": lambda: (lambda x: x @ weight.t()),
        "partial_nested": lambda: functools.partial(project, [inner]),
        "callable_object": lambda: Kernel(),
        "container": lambda: [types.MethodType(project, inner)],
        "method_of_closure": lambda: types.MethodType(closing, inner),
    }[form]()
    with pytest.raises(UnitCallableError, match=r"layers\.0\.kernel .*computes with the real module"):
        Template(real).mirror_of(real, frozenset(), "layers.0")


def test_a_callable_holding_another_units_parameter_is_refused():
    other = nn.Linear(4, 4)  # another unit's module: its parameters are streamed too
    real = Layer()
    real.kernel = lambda x: other(x)
    Template(real).mirror_of(real)  # not streamed: a module outside the model is left alone
    with pytest.raises(UnitCallableError, match="holds streamed parameters"):
        Template(real).mirror_of(real, frozenset(id(p) for p in other.parameters()), "layers.0")


def test_callables_that_hold_nothing_of_the_model_are_mirrored_as_they_are():
    real = Layer()
    scale = 2.0
    real.kernel = lambda x: real_free(x) * scale  # noqa: E731 (a closure over plain values)
    real.inner.act = torch.nn.functional.silu
    template = Template(real)
    template.bind(_streamed(real), template.mirror_of(real))
    assert template.module.kernel is real.kernel and template.module.inner.act is torch.nn.functional.silu
    template.unbind()


def real_free(x):
    return x


def test_a_callable_set_after_attach_is_resolved_at_bind():
    real = Layer()
    real.kernel = types.MethodType(project, real.inner)
    template = Template(real)
    mirror = template.mirror_of(real)
    inner = real.inner
    real.kernel = lambda x: project(inner, x)  # replaced after attach by a form that cannot be rebound
    with pytest.raises(UnitCallableError, match="closure cell 'inner'"):
        template.bind(_streamed(real), mirror)


def test_the_message_names_the_tool_and_its_fix():
    real = Layer()
    inner = real.inner

    def apply_qkv(x):
        return inner.proj(x)

    apply_qkv.__module__ = "axolotl.kernels.lora"  # what axolotl's LoRA kernels would look like in this form
    real.inner.apply_qkv = apply_qkv
    with pytest.raises(UnitCallableError, match=r"axolotl's LoRA kernels\. Fix: lora_qkv_kernel: false"):
        Template(real).mirror_of(real, frozenset(), "layers.0")
