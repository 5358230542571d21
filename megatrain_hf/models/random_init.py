"""Models of a config whose random initial weights are drawn straight into the host store.

:func:`from_config` builds a model the way :func:`~megatrain_hf.models.loading.from_pretrained` does
(parameters on the meta device, then placeholders), but its weights come from a seeded generator
instead of a checkpoint: norm weights are ones, biases zeros, every other weight is drawn from
``N(0, std)``. The draw happens when megatrain attaches, tensor by tensor, straight into the flat
slice of the tensor, or chunk by chunk into the quantizer for a base weight that
``base_quantization`` stores quantized. So a 70 B model never exists in fp32: it costs only its
host plan. Values depend only on (seed, tensor, position): element block ``j`` of the ``t``-th
parameter comes from its own generator, whatever order or chunking reads it. ``device="cuda"``
draws them on the GPU, which is much faster than the CPU's sequential generator, and copies them
into host memory. The values then depend on that device's generator.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .loading import ATTRIBUTE, DeferredWeights, build_on_meta
from .shards import Stored

BLOCK_ELEMENTS = 1 << 20
"""Elements drawn from one generator (the unit of determinism)."""


class RandomWeights(DeferredWeights):
    """The draws a model built by :func:`from_config` still owes (placeholders as in ``DeferredWeights``)."""

    def __init__(self, seed: int, std: float, device: str) -> None:
        super().__init__(f"<random init, seed {seed}>", {})
        self.seed, self.std, self.device = seed, std, torch.device(device)
        self.kind: dict[str, str] = {}  # key -> "normal" | "ones" | "zeros"
        self.index: dict[str, int] = {}
        self.numel: dict[str, int] = {}
        self._last: tuple[str, int, torch.Tensor] | None = None  # the block drawn last (chunked reads reuse it)

    def add(self, name: str, param: nn.Parameter) -> nn.Parameter:
        leaf = name.rsplit(".", 1)[-1]
        self.kind[name] = "ones" if "norm" in name.lower() and leaf == "weight" else (
            "zeros" if leaf == "bias" else "normal")
        self.index[name] = len(self.index)
        self.numel[name] = param.numel()
        stored = Stored(self.path, torch.float32, tuple(param.shape), 0, 0)
        return self.placeholder(name, stored, param.requires_grad)

    def _draw(self, key: str, first: int, n: int, dest: torch.Tensor) -> None:
        kind = self.kind[key]
        if kind != "normal":
            dest.fill_(1.0 if kind == "ones" else 0.0)
            return
        done = 0
        while done < n:
            block, offset = divmod(first + done, BLOCK_ELEMENTS)
            take = min(n - done, BLOCK_ELEMENTS - offset)
            values = self._block(key, block)
            dest[done : done + take].copy_(values[offset : offset + take])
            done += take

    def _block(self, key: str, block: int) -> torch.Tensor:
        """Block ``block`` of ``key``'s draws, always drawn whole (its values depend on nothing else)."""
        if self._last is not None and self._last[:2] == (key, block):
            return self._last[2]
        self._last = None
        gen = torch.Generator(self.device).manual_seed(self.seed * 1_000_003 + self.index[key] * 65_537 + block)
        size = min(BLOCK_ELEMENTS, self.numel[key] - block * BLOCK_ELEMENTS)
        values = torch.empty(size, dtype=torch.float32, device=self.device).normal_(0.0, self.std, generator=gen)
        self._last = (key, block, values)
        return values

    def ranges(self, tensor: torch.Tensor) -> Callable[[int, int, torch.Tensor], None] | None:
        hit = self.key_of(tensor)
        if hit is None:
            return None
        key = hit[0]
        return lambda first, n, dest: self._draw(key, first, n, dest.view(-1))

    def source(self, tensor: torch.Tensor) -> Callable[[torch.Tensor], None] | None:
        read = self.ranges(tensor)
        if read is None:
            return None
        return lambda dest: read(0, dest.numel(), dest)

    def close(self) -> None:
        super().close()
        self._last = None


def from_config(config: Any, *, seed: int = 0, std: float | None = None, device: str = "cpu",
                model_class: Any = None, **kwargs: Any) -> nn.Module:
    """A causal LM of ``config`` whose seeded random weights are drawn when megatrain attaches.

    ``std``: of the normal draws (default ``config.initializer_range``, else 0.02); ``device``:
    where they are drawn (``"cuda"``: fast; the values are that device's). The model can be
    inspected and wrapped (``peft.get_peft_model``) but not run, saved, moved or cast before it is
    attached, as a model from ``megatrain_hf.from_pretrained``. ``kwargs`` go to ``from_config``.
    """
    from transformers import AutoModelForCausalLM

    cls = model_class or AutoModelForCausalLM
    make = cls.from_config if hasattr(cls, "from_config") else cls._from_config
    model = build_on_meta(lambda: make(config, dtype=torch.float32, **kwargs))
    std = std if std is not None else getattr(config, "initializer_range", 0.02)
    weights = RandomWeights(seed, std, device)
    for name, p in model.named_parameters():  # tied ones once: the first name
        torch.utils.swap_tensors(p, weights.add(name, p))
    weights.install_guards(model)
    model.__dict__[ATTRIBUTE] = weights
    model.eval()
    return model
