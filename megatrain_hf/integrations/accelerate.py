"""``MegaTrainAccelerator``: megatrain for hand-written Accelerate loops.

``prepare()`` attaches the engine to every model it is given before Accelerate would place it
(placement of an attached model on its compute device is a no-op); everything else -- autocast,
``backward``, ``clip_grad_norm_``, dataloaders, schedulers -- is stock Accelerate. Optimizers
built on ``model.parameters()`` keep working since the engine keeps the Parameter objects; for
the per-layer host optimizer build ``HostAdamW(model.parameters(), store=engine.store, ...)``.

Example::

    accelerator = MegaTrainAccelerator(mixed_precision="bf16")
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
"""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn

from ..config import MegaTrainConfig
from ..engine import Engine, attach, engine_of
from .refusals import check_precision_and_sharding


class MegaTrainAccelerator(Accelerator):
    def __init__(self, *args: Any, megatrain_config: MegaTrainConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_precision_and_sharding(
            fp16=self.mixed_precision == "fp16",
            deepspeed=self.distributed_type == DistributedType.DEEPSPEED,
            fsdp=self.distributed_type.value if self.distributed_type == DistributedType.FSDP else None,
        )
        self.megatrain_config = megatrain_config or MegaTrainConfig()
        self.engines: list[Engine] = []

    def prepare(self, *args: Any, device_placement=None):
        for obj in args:
            if isinstance(obj, nn.Module) and engine_of(obj) is None:
                engine = attach(obj, self.megatrain_config, device=self.device, bf16=self.mixed_precision == "bf16")
                self.engines.append(engine)
        return super().prepare(*args, device_placement=device_placement)
