"""``MegaTrainAccelerator``: megatrain for hand-written Accelerate loops.

``prepare()`` attaches the engine to every model it is given before Accelerate would place it
(placement of an attached model on its compute device is a no-op). ``clip_grad_norm_`` over an
attached model's parameters is ``Engine.clip_grad_norm_`` (exact; the norm from the per-unit norms;
with a prepared ``HostAdamW`` the multiply runs inside its next update); everything else --
autocast, ``backward``, dataloaders, schedulers -- is stock Accelerate. Optimizers built on
``model.parameters()`` keep working since the engine keeps the Parameter objects; for the per-layer
host optimizer build ``HostAdamW(model.parameters(), store=engine.store, ...)``.

Example::

    accelerator = MegaTrainAccelerator(mixed_precision="bf16")
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DistributedType, DynamoBackend
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
        dynamo = self.state.dynamo_plugin
        if dynamo.backend != DynamoBackend.NO and not self.megatrain_config.compile:
            # dynamo_backend=...: the engine compiles its layer templates (runtime/compiled.py), not the whole model
            mode = dynamo.mode if dynamo.mode != "default" else None
            self.megatrain_config = replace(self.megatrain_config, compile=True,
                                            compile_backend=dynamo.backend.value.lower(), compile_mode=mode)
        self.engines: list[Engine] = []

    def prepare(self, *args: Any, device_placement=None):
        for obj in args:
            if isinstance(obj, nn.Module) and engine_of(obj) is None:
                engine = attach(obj, self.megatrain_config, device=self.device, bf16=self.mixed_precision == "bf16")
                self.engines.append(engine)
        return super().prepare(*args, device_placement=device_placement)

    def prepare_model(self, model: nn.Module, device_placement=None, evaluation_mode: bool = False):
        """Accelerate's, except that an attached model is not compiled whole (its layers are, by the engine)."""
        dynamo = self.state.dynamo_plugin
        if engine_of(model) is None or dynamo.backend == DynamoBackend.NO:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        saved, dynamo.backend = dynamo.backend, DynamoBackend.NO
        try:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        finally:
            dynamo.backend = saved

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """Accelerate's ``clip_grad_norm_``; over exactly an attached model's trainable parameters, the
        engine's (``Engine.clip_grad_norm_``), with a prepared ``HostAdamW`` of that model deferring the
        multiply into its update."""
        params = list(parameters)
        ids = {id(p) for p in params}
        engines = dict.fromkeys([*self.engines, *(engine_of(m) for m in self._models)])  # (attached before prepare too)
        for engine in filter(None, engines):
            owned = {id(e.tensor) for u in range(len(engine.store.entries)) for e in engine.store.owned_trainable(u)}
            if ids == owned:
                optimizer = next((o for o in (getattr(w, "optimizer", w) for w in self._optimizers)
                                  if getattr(o, "store", None) is engine.store), None)
                return engine.clip_grad_norm_(max_norm, norm_type, optimizer=optimizer)
        return super().clip_grad_norm_(params, max_norm, norm_type=norm_type)
