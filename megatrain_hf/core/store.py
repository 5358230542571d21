"""Host store: the home of every tensor the engine streams.

Each streamed unit (embedding, decoder layer, final norm, head) owns, laid out by ``layout.py``:

* ``master_host``  -- one contiguous fp32 flat holding its trainable parameters,
* ``grad_host``    -- the gradient accumulator of those parameters, laid out the same way (its
  bf16 part ``grad_low`` with ``grad_dtype=torch.bfloat16``), managed by ``GradAccumulators``
  (``grad_accumulators.py``),
* ``staging_host`` -- the compute-dtype copy of ``master_host[:n_staged]`` that crosses the link
  (absent for fp32 compute, or with ``staging=False``: the fp32 masters are sent and rounded on the
  device), managed by the store's ``staging`` (``staging.py``),
* ``frozen_host``  -- one flat per storage dtype for frozen parameters (PEFT base weights, a
  reference model): no master, no gradient, no optimizer state. Stored in the wire dtype (2 B/param
  for bf16 matrices), or in fp32 with ``frozen_in_wire_dtype=False`` (for weights that are edited in
  place, e.g. a reference synchronised with the policy; rounded to the wire dtype on the device
  instead). A frozen matrix the caller asks to quantize (``quantize``) is a byte range of the
  ``uint8`` frozen flat instead (``frozen_formats.py``), quantized as it is filled; its parameter then holds
  a one-element NaN placeholder of its shape (the weight exists only quantized).

The registered ``nn.Parameter`` objects are kept (optimizers, PEFT, ``named_parameters`` keep
working) but their data is re-pointed into these flats, each through a storage of its own
aliasing its slice (through a NumPy view): ``save_pretrained`` treats tensors that share a
storage as tied weights and drops or clones them. A slice is filled from the tensor, or by the
tensor's *source* when the caller gives one (a read of a checkpoint straight into the slice: the
weights then never exist twice). Pinning uses ``cudaHostRegister`` on ordinary
memory: the caching host allocator would round every flat up to a power of two.

The fp32 masters of a unit are read through two views of its buffers, ``staged_master``
(``master[:n_staged]``) and ``master_tail`` (``master[n_staged:]``): views of ``master_host``, of a
receive slot (data parallelism, ``ownership.py``), or a mapping of the disk tier's file and a RAM
tail (``mapped_masters.py``). Readers never ask which.

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
from .frozen_formats import QuantWork, quantize_into, quantize_tensor
from .grad_accumulators import GradAccumulators
from .host_pages import TRIM_EVERY_BYTES, trim
from .layout import Entry, Kind
from .ownership import LocalOwnership
from .readiness import UnitGates
from .staging import NoStaging, StagingCache
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


def absent(e: Entry) -> torch.Tensor:
    """What a parameter whose values are not in this process reads as: NaN, in its shape (one element,
    expanded; a gradient of its shape can still be assigned). A quantized frozen weight (its values
    exist only quantized) and, under data parallelism, a unit another rank owns (its masters live on
    the owner: ``ownership.py``) hold it, so a read is never stale, only loud."""
    return torch.full((), float("nan"), dtype=e.tensor.dtype).expand(e.shape)


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
    staged_master: torch.Tensor | None = None  # master[:n_staged], wherever the masters live
    master_tail: torch.Tensor | None = None  # master[n_staged:], wherever the masters live
    master_paged: torch.Tensor | None = None  # masters on disk: staged_master is this mapping (mapped_masters.py)
    # masters on disk: waits for the disk tier's write-backs into that file (a weak method: None once it is gone)
    master_writes: Callable[[], Callable[[], None] | None] | None = None

    def set_masters(self, flat: torch.Tensor) -> None:
        """The masters live in ``flat`` (a RAM flat or a receive slot)."""
        self.master_host = flat
        self.staged_master, self.master_tail = flat[: self.n_staged], flat[self.n_staged :]


def unfrozen_error(unit_name: str, entry_name: str) -> AttachedModelError:
    """A parameter frozen when the store laid it out (no master, gradient or state) is trainable now."""
    return AttachedModelError(
        f"megatrain: {unit_name}.{entry_name} was frozen (requires_grad=False) when megatrain attached and is "
        "trainable now; the host store holds frozen weights without an fp32 master, gradient or optimizer "
        "state, so it cannot train. Fix: set requires_grad before building the Trainer (or before attach()), "
        "e.g. unfreeze everything you will train and freeze it again in a callback; or detach "
        "(megatrain_hf.engine_of(model).detach()) and attach again."
    )


class HostStore:
    """Allocates the per-unit flats and re-points the model's tensors into them.

    ``units`` is a list of ``(unit_name, module)``; ``embedding_units`` the indices whose weights
    are lookup tables; ``sources(tensor)``, if given, returns what fills the tensor's slice of its
    flat (called with the slice, 1-D, in the flat's dtype) or None to copy the tensor into it;
    ``quantize(tensor)`` the scheme a frozen tensor is stored in (None: as is), and ``ranges(tensor)``
    what reads its elements ``[first, first + n)`` into an fp32 buffer (a checkpoint read) or None
    (read the tensor); ``stored_quantized(tensor)`` what copies a tensor stored quantized already
    (``fill(format, byte_range)``), or None; ``on_unit(store, u)``, if given, runs once unit ``u``'s flats
    are filled (the disk tier takes the masters of the units of its ``masters`` there, filled unpinned,
    before the next unit's exist); ``ownership`` which units this process holds (``ownership.py``:
    all of them by default); ``fp32_params`` the ids of parameters that cross the link in fp32 whatever
    their shape (routed experts whose kernel ignores autocast). The store does not know what a model is.

    Composed of ``accumulators`` (the gradient flats, ``grad_accumulators.py``), ``staging`` (the
    compute-dtype copy, ``staging.py``) and ``gates`` (each unit's update gate, ``readiness.py``).
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
        ownership: LocalOwnership | None = None,
        grad_dtype: torch.dtype = torch.float32,
        on_unit: Callable[["HostStore", int], None] | None = None,
        fp32_params: frozenset[int] = frozenset(),
    ) -> None:
        self.compute_dtype = compute_dtype
        self.frozen_in_wire_dtype = frozen_in_wire_dtype
        self.pin = pin
        self.names = [name for name, _ in units]
        self.buffers: list[UnitBuffers] = []
        self._registered: list[torch.Tensor] = []
        # Unpinned when the store goes away even without release(): the finalizer holds the flats,
        # so their memory cannot return to malloc (and be registered again) while still pinned.
        self._unpin = weakref.finalize(self, _unregister, self._registered)
        self._quantize = quantize
        self.entries, self._sizes, self._param_home = plan_units(units, embedding_units, compute_dtype,
                                                                 self.frozen_storage, quantize, fp32_params)
        self.staging = (StagingCache(self, compute_dtype) if staging and compute_dtype != torch.float32
                        else NoStaging(self))
        self.accumulators = GradAccumulators(self, grad_dtype)
        self.ownership = (ownership or LocalOwnership()).bind(self)
        self.resident = None  # the resident units' device state (resident.py), set by the engine when the plan has some
        self.tier_files = None  # the disk tier's files (moments, masters), if ``on_unit`` made them (optim/tier_files.py)
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

    @property
    def remote(self) -> frozenset[int]:
        """Units another rank owns (laid into receive slots; empty without data parallelism)."""
        return self.ownership.remote

    def _allocate(self, sources, ranges, stored_quantized=None, on_unit=None) -> None:
        work = None  # the quantization's chunk buffers, one set for every tensor
        filled = 0  # master bytes filled from ``sources`` since the heap was last trimmed
        remote = self.remote
        for u, entries in enumerate(self.entries):
            bufs = UnitBuffers()
            sizes = self._sizes[u]
            bufs.n_staged = sizes.n_staged
            if u in remote:
                self.ownership.lay_out(u, bufs, sizes)
            elif sizes.n_train:
                leaving = u in getattr(on_unit, "masters", ())  # to disk once filled: no need to pin them
                bufs.set_masters(torch.empty(sizes.n_train) if leaving else self.allocate(sizes.n_train, torch.float32))
                self.accumulators.allocate(u, bufs, sizes.n_train, sizes.n_staged)
                self.staging.allocate(u, bufs)
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
                    e.tensor.data = absent(e)
                    continue
                if u in remote and e.kind is Kind.TRAINABLE:  # the owner's masters arrive with each fetch
                    e.tensor.data = absent(e)
                    continue
                fill = sources(e.tensor) if sources is not None else None
                with torch.no_grad():
                    if fill is None:
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
        self.accumulators.mark_dtypes()
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
        total = self.ownership.nbytes()
        for u, b in enumerate(self.buffers):
            tensors = (*b.frozen_host.values(),) if u in self.remote else (
                b.master_host, b.master_tail if b.master_paged is not None else None, b.grad_host, b.grad_low,
                b.staging_host, *b.frozen_host.values())
            for t in tensors:
                if t is not None:
                    total += t.numel() * t.element_size()
        return total

    def owns(self, u: int) -> bool:
        """Whether this process holds unit ``u``'s gradient and optimizer state (always, without sharding)."""
        return self.ownership.owns(u)

    def home_of(self, param: torch.Tensor) -> tuple[int, Entry] | None:
        """(owner unit, entry) of a parameter the store manages, else None."""
        return self._param_home.get(id(param))

    def entries_of(self, u: int, kind: Kind) -> list[Entry]:
        """Unit ``u``'s entries of ``kind`` (tied ones included: they live in their owner's flat)."""
        return [e for e in self.entries[u] if e.kind is kind]

    def owned_trainable(self, u: int) -> list[Entry]:
        """The trainable entries whose master lives in unit ``u``'s own flat."""
        return [e for e in self.entries[u] if e.owner == u and e.kind is Kind.TRAINABLE]

    def entry_name(self, u: int, e: Entry) -> str:  # for errors
        return f"{self.names[u]}.{e.name}"

    # ------------------------------------------------------------------ masters
    def mark_dirty(self, u: int | None = None) -> None:
        """The masters of unit ``u`` (all units if None) changed: re-stage before the next fetch."""
        targets = range(len(self.buffers)) if u is None else (u,)
        for i in targets:
            self.staging.mark_dirty(i)
            self.gates.bump(i)

    def staging_changed(self, u: int) -> None:
        """Unit ``u``'s staging copy no longer matches (a receive slot now holds another unit's masters)."""
        self.staging.mark_dirty(u)

    def wait_master_writes(self) -> None:
        """The disk tier's write-backs into the files the paged masters map have landed: the parameters that
        alias those mappings read the last update (the update ends a unit's gate before its write-back)."""
        waited = set()
        for b in self.buffers:
            flush = b.master_writes() if b.master_writes is not None else None
            if flush is not None and id(flush.__self__) not in waited:
                waited.add(id(flush.__self__))
                flush()

    def staged_master(self, u: int) -> torch.Tensor:
        """master[:n_staged] of unit ``u``: in the RAM flat, a receive slot, or mapped (on disk)."""
        return self.buffers[u].staged_master

    def source(self, u: int, key: tuple[Kind, torch.dtype]) -> tuple[torch.Tensor, int]:
        """(host flat, element offset of its first element in the entries' numbering) for ``key``."""
        bufs = self.buffers[u]
        kind, wire = key
        if kind is Kind.FROZEN:  # one frozen flat per unit and storage dtype (rounded to the wire dtype on fetch)
            return bufs.frozen_host[self.frozen_storage(wire)], 0
        if wire != torch.float32:  # the staging copy (refreshed), or the fp32 masters rounded on the device
            return self.staging.read(u, bufs.staged_master), 0
        return bufs.master_tail, bufs.n_staged

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
        self.accumulators.restore_dtypes()
        _unregister(self._registered)
