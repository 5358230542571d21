"""Host store: the home of every tensor the engine streams.

Each streamed unit (embedding, decoder layer, final norm, head) owns, laid out by ``layout.py``:

* ``master_host``  -- one contiguous fp32 flat holding its trainable parameters,
* ``grad_host``    -- the gradient accumulator of those parameters, laid out the same way (its
  bf16 part ``grad_low`` with ``grad_dtype=torch.bfloat16``: ``grad_home.py``),
* ``staging_host`` -- the compute-dtype copy of ``master_host[:n_staged]`` that crosses the link
  (absent for fp32 compute, or with ``staging=False``: the fp32 masters are sent and rounded on the
  device),
* ``frozen_host``  -- one flat per storage dtype for frozen parameters (PEFT base weights, a
  reference model): no master, no gradient, no optimizer state. Stored in the wire dtype (2 B/param
  for bf16 matrices), or in fp32 with ``frozen_in_wire_dtype=False`` (for weights that are edited in
  place, e.g. a reference synchronised with the policy; rounded to the wire dtype on the device
  instead). A frozen matrix the caller asks to quantize (``quantize``) is a byte range of the
  ``uint8`` frozen flat instead (``quant.py``), quantized as it is filled; its parameter then holds
  a one-element NaN placeholder of its shape (the weight exists only quantized).

The registered ``nn.Parameter`` objects are kept (optimizers, PEFT, ``named_parameters`` keep
working) but their data is re-pointed into these flats, each through a storage of its own
aliasing its slice (through a NumPy view): ``save_pretrained`` treats tensors that share a
storage as tied weights and drops or clones them. A slice is filled from the tensor, or by the
tensor's *source* when the caller gives one (a read of a checkpoint straight into the slice: the
weights then never exist twice). Pinning uses ``cudaHostRegister`` on ordinary
memory: the caching host allocator would round every flat up to a power of two.

Placement suffixes: ``_host`` lives in host RAM, ``_dev`` on the compute device.
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import AttachedModelError, PinnedMemoryError
from .grad_accumulators import GradHome, low_precision_units
from .host_pages import TRIM_EVERY_BYTES, trim
from .layout import Entry, Kind
from .frozen_formats import QuantWork, quantize_into, quantize_tensor
from .readiness import UnitGates
from .sharding import ReceiveSlots
from .unit_plan import plan_units

logger = logging.getLogger(__name__)

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _unregister(flats: list[torch.Tensor]) -> None:
    """cudaHostUnregister every flat of the list (and empty it)."""
    while flats:
        torch.cuda.cudart().cudaHostUnregister(flats.pop().data_ptr())


def alias(flat: torch.Tensor, offset: int, shape: torch.Size) -> torch.Tensor:
    """A tensor viewing ``flat[offset : offset + numel]`` through a storage of its own."""
    numel = math.prod(shape)
    if flat.dtype == torch.bfloat16:
        raw = flat.view(torch.int16).numpy()[offset : offset + numel]
        return torch.from_numpy(raw).view(torch.bfloat16).view(shape)
    return torch.from_numpy(flat.numpy()[offset : offset + numel]).view(shape)


@dataclass
class UnitBuffers:
    """The host flats of one unit (see module docstring)."""

    master_host: torch.Tensor | None = None  # fp32: [compute-dtype-wire params | fp32-wire params]
    grad_host: torch.Tensor | None = None  # fp32: the whole accumulator, or [n_staged:] when grad_low is set
    grad_low: torch.Tensor | None = None  # bf16 accumulator of [:n_staged] (grad_dtype=torch.bfloat16)
    staging_host: torch.Tensor | None = None  # compute-dtype copy of master_host[:n_staged]
    n_staged: int = 0
    frozen_host: dict = field(default_factory=dict)  # storage dtype -> flat
    staging_dirty: bool = True
    staged_versions: tuple[int, ...] = ()
    master_paged: torch.Tensor | None = None  # masters on disk: master[:n_staged], a mapping (master_home.py)
    master_tail: torch.Tensor | None = None  # ... and master[n_staged:] in RAM (master_host is None then)


def unfrozen_error(unit_name: str, entry_name: str) -> AttachedModelError:
    """A parameter frozen when the store laid it out (no master, gradient or state) is trainable now."""
    return AttachedModelError(
        f"megatrain: {unit_name}.{entry_name} was frozen (requires_grad=False) when megatrain attached and is "
        "trainable now; the host store holds frozen weights without an fp32 master, gradient or optimizer "
        "state, so it cannot train. Fix: set requires_grad before building the Trainer (or before attach()), "
        "e.g. unfreeze everything you will train and freeze it again in a callback; or detach "
        "(megatrain_hf.engine_of(model).detach()) and attach again."
    )


class HostStore(GradHome):
    """Allocates the per-unit flats and re-points the model's tensors into them.

    ``units`` is a list of ``(unit_name, module)``; ``embedding_units`` the indices whose weights
    are lookup tables; ``sources(tensor)``, if given, returns what fills the tensor's slice of its
    flat (called with the slice, 1-D, in the flat's dtype) or None to copy the tensor into it;
    ``quantize(tensor)`` the scheme a frozen tensor is stored in (None: as is), and ``ranges(tensor)``
    what reads its elements ``[first, first + n)`` into an fp32 buffer (a checkpoint read) or None
    (read the tensor); ``stored_quantized(tensor)`` what copies a tensor stored quantized already
    (``fill(format, byte_range)``), or None; ``on_unit(store, u)``, if given, runs once unit ``u``'s flats
    are filled (the disk tier takes the masters of the units of its ``masters`` there, filled unpinned,
    before the next unit's exist). The store does not know what a model is.
    """

    def __init__(
        self,
        units: list[tuple[str, torch.nn.Module]],
        compute_dtype: torch.dtype,
        pin: bool,
        embedding_units: frozenset[int] = frozenset(),
        staging: bool = True,
        frozen_in_wire_dtype: bool = True,
        sources: Callable[[torch.Tensor], Callable[[torch.Tensor], None] | None] | None = None,
        quantize: Callable[[torch.Tensor], str | None] | None = None,
        ranges: Callable[[torch.Tensor], Callable[[int, int, torch.Tensor], None] | None] | None = None,
        stored_quantized: Callable[[torch.Tensor], Callable | None] | None = None,
        sharding=None,
        slots: tuple[int, int] = (1, 1),
        grad_dtype: torch.dtype = torch.float32,
        on_unit: Callable[["HostStore", int], None] | None = None,
    ) -> None:
        self.sharding = sharding  # core.sharding.UnitSharding under data parallelism, else None
        self.compute_dtype = compute_dtype
        self.frozen_in_wire_dtype = frozen_in_wire_dtype
        self.staging = staging and compute_dtype != torch.float32
        self.pin = pin
        self.grad_dtype = grad_dtype
        self.low_grad_units = low_precision_units(len(units), grad_dtype)
        self.names = [name for name, _ in units]
        self.buffers: list[UnitBuffers] = []
        self._registered: list[torch.Tensor] = []
        # Unpinned when the store goes away even without release(): the finalizer holds the flats,
        # so their memory cannot return to malloc (and be registered again) while still pinned.
        self._unpin = weakref.finalize(self, _unregister, self._registered)
        self._quantize = quantize
        self.entries, self._sizes, self._param_home = plan_units(units, embedding_units, compute_dtype,
                                                                 self.frozen_storage, quantize)
        self.remote = self._remote_units()
        self._slots = ReceiveSlots(self, *slots) if self.remote else None
        self.disk_tier = None  # the files of the masters and moments on disk, if ``on_unit`` made them
        self._allocate(sources, ranges, stored_quantized, on_unit)
        self.gates = UnitGates(self.names)

    # ------------------------------------------------------------------ layout
    def frozen_storage(self, wire: torch.dtype) -> torch.dtype:
        """The dtype a frozen entry of wire dtype ``wire`` is stored in on the host."""
        return wire if self.frozen_in_wire_dtype or not wire.is_floating_point else torch.float32

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host flat, pinned when the store pins.

        Pinned flats are ordinary (malloc) memory registered with ``cudaHostRegister`` (no
        power-of-two rounding, unlike torch's pinned allocator) over whole pages of their own: a
        small flat sharing a page with another registered one makes the driver refuse the second
        registration (``cudaErrorHostMemoryAlreadyRegistered``). At most two pages are added.
        """
        if not (self.pin and numel):
            return torch.empty(numel, dtype=dtype)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        span = -(-nbytes // PAGE_BYTES) * PAGE_BYTES
        raw = torch.empty(span + PAGE_BYTES, dtype=torch.uint8)
        start = -raw.data_ptr() % PAGE_BYTES
        flat = raw[start : start + nbytes].view(dtype)  # shares raw's storage: raw stays alive
        err = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), span, 0)
        if int(err) != 0:
            raise PinnedMemoryError(
                f"cudaHostRegister refused to pin {span / 2**30:.3f} GiB (error {int(err)}). "
                "The OS limits page-locked memory (ulimit -l) or RAM is short. Fix: raise the "
                "memlock limit, free host RAM, or set MegaTrainConfig(pin_memory=False) "
                "(correct but transfers run several times slower)."
            )
        self._registered.append(flat)
        return flat

    def _remote_units(self) -> frozenset[int]:
        """Units another rank owns, laid into receive slots (a flat another unit reads stays whole)."""
        if self.sharding is None:
            return frozenset()
        tied = {e.owner for u, entries in enumerate(self.entries) for e in entries if e.owner != u}
        return frozenset(u for u in range(len(self.entries))
                         if self._sizes[u].n_train and u not in tied and not self.sharding.owns(u))

    def _allocate(self, sources, ranges, stored_quantized=None, on_unit=None) -> None:
        work = None  # the quantization's chunk buffers, one set for every tensor
        filled = 0  # master bytes filled from ``sources`` since the heap was last trimmed
        for u, entries in enumerate(self.entries):
            bufs = UnitBuffers()
            sizes = self._sizes[u]
            if u in self.remote:
                self._slots.lay_out(u, bufs, sizes)
            elif sizes.n_train:
                leaving = u in getattr(on_unit, "masters", ())  # to disk once filled: no need to pin them
                bufs.master_host = torch.empty(sizes.n_train) if leaving else self.allocate(sizes.n_train, torch.float32)
                bufs.n_staged = sizes.n_staged
                self._allocate_grads(u, bufs, sizes.n_train, sizes.n_staged)
                if self.staging and bufs.n_staged:
                    bufs.staging_host = self.allocate(bufs.n_staged, self.compute_dtype)
            for dtype, n in sizes.frozen.items():
                bufs.frozen_host[dtype] = self.allocate(n, dtype)
                if dtype == torch.uint8:  # quantized weights: their padding bytes too are defined
                    bufs.frozen_host[dtype].zero_()
            for e in entries:
                if e.owner != u or e.kind is Kind.BUFFER:
                    continue
                flat = bufs.master_host if e.kind is Kind.TRAINABLE else bufs.frozen_host[self.frozen_storage(e.wire)]
                region = flat[e.offset : e.offset + e.numel]
                if e.quant is not None:
                    read = ranges(e.tensor) if ranges is not None else None
                    copy = stored_quantized(e.tensor) if stored_quantized is not None else None
                    work = work or QuantWork()
                    with torch.no_grad():
                        if copy is not None:  # already quantized in the checkpoint: its bytes as stored
                            copy(e.quant, region)
                        elif read is None:
                            quantize_tensor(e.quant, e.tensor, region, work)
                        else:
                            quantize_into(e.quant, read, region, work)
                    e.tensor.data = torch.full((), float("nan"), dtype=e.tensor.dtype).expand(e.shape)
                    continue
                fill = sources(e.tensor) if sources is not None else None
                with torch.no_grad():
                    if u in self.remote and e.kind is Kind.TRAINABLE:
                        pass  # the owner's masters arrive with each fetch
                    elif fill is None:
                        region.copy_(e.tensor.detach().reshape(-1))
                    else:
                        fill(region)
                e.tensor.data = alias(flat, e.offset, e.shape)
            self.buffers.append(bufs)
            if on_unit is not None:
                on_unit(self, u)
            filled += 4 * sizes.n_train if sources is not None else 0
            if filled >= TRIM_EVERY_BYTES:  # the fills' temporaries (checkpoint reads, random draws) stay in the heap
                trim()
                filled = 0
        self.mark_grad_dtypes()
        logger.info(
            "host store: %d units, %.3f GiB of fp32 masters, %.3f GiB host buffers in all, pinned=%s",
            len(self.entries), self.trainable_numel() * 4 / 2**30, self.host_bytes() / 2**30, self.pin,
        )

    # ------------------------------------------------------------------ queries
    def trainable_numel(self) -> int:
        """Elements of the fp32 masters this process holds (its own units under data parallelism)."""
        return sum(self.n_train(u) for u in range(len(self.buffers)) if u not in self.remote)

    def n_train(self, u: int) -> int:  # elements of unit u's master flat (= its gradient), alignment included
        return self._sizes[u].n_train

    def n_staged(self, u: int) -> int:  # elements of master[:n_staged]: what the staging copy holds (known before allocation)
        return self._sizes[u].n_staged

    def host_bytes(self) -> int:
        total = self._slots.nbytes() if self._slots is not None else 0
        for u, b in enumerate(self.buffers):
            tensors = (*b.frozen_host.values(),) if u in self.remote else (
                b.master_host, b.master_tail, b.grad_host, b.grad_low, b.staging_host, *b.frozen_host.values())
            for t in tensors:
                if t is not None:
                    total += t.numel() * t.element_size()
        return total

    # ------------------------------------------------------------------ data parallelism
    def before_read(self, u: int) -> None:
        """A fetch reads unit ``u``'s masters: under data parallelism, the owner's arrive first."""
        if self.sharding is None or self.buffers[u].master_host is None:
            return
        if u not in self.remote and self._slots is not None and self._slots.reads_in_place(self.pin):
            self._slots.release()  # no remote unit is read now: the slot's pages go back until the next one
        self.sharding.broadcast_master(u, self.buffers[u].master_host)
        self.buffers[u].staging_dirty = u in self.remote or self.buffers[u].staging_dirty  # a slot's copy
        if u in self.remote:
            self._slots.idle = False

    def grads_landed(self, u: int, computed: dict | None = None) -> None:
        """Unit ``u``'s gradients of this backward are here: sum them into the owner's, tensor by tensor.
        ``computed`` ({entry offset: gradient}; the CPU, a unit another rank owns): sent as computed, so
        the gradient slot is never written (nor resident)."""
        if self.sharding is None or self.buffers[u].grad_host is None:
            return
        owned = self.owned_trainable(u)  # every rank sends unit u in the same backward (same graph)
        mine = self.sharding.owns(u)
        for e in owned:
            g = computed.get(e.offset) if computed is not None and e.tensor.grad is None else None
            if mine or g is None and e.tensor.grad is not None:
                part = self.grad_region(e)
                if e.tensor.grad is None:  # no contribution here: a zero one (the region may be a reused slot)
                    part.zero_()
                    if mine:
                        e.tensor.grad = part.view(e.shape)
                self.sharding.reduce_grad_pieces(u, part, part, e.numel)
            else:  # sent as computed (None: zeros), piece by piece: the slot is never written
                self.sharding.reduce_grad_pieces(u, None, None if g is None else g.detach().reshape(-1), e.numel)
            if not mine:
                e.tensor.grad = None  # the owner holds the sum (and the region may be a slot)

    def held_grads(self) -> list[torch.Tensor]:
        """The gradients this process holds (its own units'), for the per-step mean."""
        return [e.tensor.grad for u in range(len(self.entries)) if self.owns(u)
                for e in self.owned_trainable(u) if e.tensor.grad is not None]

    def owns(self, u: int) -> bool:
        """Whether this process holds unit ``u``'s gradient and optimizer state (always, without sharding)."""
        return self.sharding is None or self.sharding.owns(u)

    def home_of(self, param: torch.Tensor) -> tuple[int, Entry] | None:
        """(owner unit, entry) of a parameter the store manages, else None."""
        return self._param_home.get(id(param))

    def entries_of(self, u: int, kind: Kind) -> list[Entry]:
        """Unit ``u``'s entries of ``kind`` (tied ones included: they live in their owner's flat)."""
        return [e for e in self.entries[u] if e.kind is kind]

    def owned_trainable(self, u: int) -> list[Entry]:
        """The trainable entries whose master lives in unit ``u``'s own flat."""
        return [e for e in self.entries[u] if e.owner == u and e.kind is Kind.TRAINABLE]

    # ------------------------------------------------------------------ staging
    def mark_dirty(self, u: int | None = None) -> None:
        """The masters of unit ``u`` (all units if None) changed: re-stage before the next fetch."""
        targets = range(len(self.buffers)) if u is None else (u,)
        for i in targets:
            self.buffers[i].staging_dirty = True
            self.gates.bump(i)

    def _versions(self, u: int) -> tuple[int, ...]:
        return tuple(e.tensor._version for e in self.owned_trainable(u))

    def staged_master(self, u: int) -> torch.Tensor:  # master[:n_staged]: in the RAM flat, or mapped (on disk)
        bufs = self.buffers[u]
        return bufs.master_paged if bufs.master_paged is not None else bufs.master_host[: bufs.n_staged]

    def stage(self, u: int, master: torch.Tensor | None = None) -> None:
        """Refresh the compute-dtype copy of unit ``u``'s masters (``master``: from there, the update's
        copy of :meth:`staged_master`) if they changed.

        Changes are known from ``mark_dirty`` (optimizer steps) or from the parameters' version
        counters (``load_state_dict``, in-place edits). Version counters alone are not enough:
        the fused CPU AdamW kernel does not bump them.
        """
        bufs = self.buffers[u]
        if bufs.staging_host is None:
            return
        versions = self._versions(u)
        if bufs.staging_dirty or versions != bufs.staged_versions:
            bufs.staging_host.copy_(master if master is not None else self.staged_master(u))
            bufs.staging_dirty = False
            bufs.staged_versions = versions

    def staging_fresh(self, u: int) -> bool:
        """Whether unit ``u``'s compute-dtype copy matches its masters (False if it has none)."""
        bufs = self.buffers[u]
        return bufs.staging_host is not None and not bufs.staging_dirty and self._versions(u) == bufs.staged_versions

    def staging_written(self, u: int) -> None:
        """An update wrote the compute-dtype copy of every master it changed: the copy is fresh."""
        bufs = self.buffers[u]
        bufs.staging_dirty = False
        bufs.staged_versions = self._versions(u)

    def staging_slice(self, e: Entry) -> torch.Tensor | None:
        """Entry ``e``'s slice of its owner's staging copy (None: no copy, or sent in fp32)."""
        staging = self.buffers[e.owner].staging_host
        return staging[e.offset : e.offset + e.numel] if staging is not None and e.wire != torch.float32 else None

    def source(self, u: int, key: tuple[Kind, torch.dtype]) -> tuple[torch.Tensor, int]:
        """(host flat, element offset of its first element in the entries' numbering) for ``key``."""
        bufs = self.buffers[u]
        kind, wire = key
        if kind is Kind.FROZEN:  # one frozen flat per unit and storage dtype (rounded to the wire dtype on fetch)
            return bufs.frozen_host[self.frozen_storage(wire)], 0
        if wire != torch.float32:
            if bufs.staging_host is not None:
                self.stage(u)
                return bufs.staging_host, 0
            return bufs.master_host[: bufs.n_staged], 0
        return bufs.master_tail if bufs.master_paged is not None else bufs.master_host[bufs.n_staged :], bufs.n_staged

    # ------------------------------------------------------------------ teardown
    def free(self, flat: torch.Tensor) -> None:
        """Unpin a flat from :meth:`allocate` that nothing uses any more (its memory goes back to malloc)."""
        for i, registered in enumerate(self._registered):
            if registered is flat:
                del self._registered[i]
                torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())
                return

    def release(self) -> None:
        """Unpin the flats. The parameters keep aliasing them (they stay valid host memory)."""
        self.restore_grad_dtypes()
        _unregister(self._registered)

