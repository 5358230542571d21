"""Host store: the home of every tensor the engine streams.

Each streamed unit (embedding, decoder layer, final norm, head) owns

* ``master_host``  -- one contiguous fp32 buffer holding its trainable parameters,
* ``grad_host``    -- one contiguous fp32 buffer, the gradient accumulator of those parameters,
* ``staging_host`` -- the compute-dtype copy of ``master_host`` that is sent to the device
  (absent when the compute dtype is fp32 on the CPU: the masters themselves are used),
* ``frozen_host``  -- one contiguous buffer (compute dtype) for frozen parameters (PEFT base
  weights): no master, no gradient, no optimizer state.

The registered ``nn.Parameter`` objects are kept (optimizers, PEFT, ``named_parameters`` keep
working) but their data is re-pointed into these buffers. Each parameter gets its *own* storage
object aliasing its slice of the buffer (through a NumPy view), because transformers'
``save_pretrained`` treats tensors that share a storage as tied weights and either drops or
clones them. Pinning uses ``cudaHostRegister`` on ordinary memory: the caching host allocator
would round every buffer up to a power of two.

Placement suffixes: ``_host`` lives in host RAM, ``_dev`` on the compute device.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_ALIGN_ELEMS = 16  # 64-byte alignment of every parameter inside a flat buffer (fp32)


def _aligned(n: int) -> int:
    return (n + _ALIGN_ELEMS - 1) // _ALIGN_ELEMS * _ALIGN_ELEMS


def _unregister(flats: list[torch.Tensor]) -> None:
    """cudaHostUnregister every flat of the list (and empty it)."""
    while flats:
        torch.cuda.cudart().cudaHostUnregister(flats.pop().data_ptr())


def alias(flat: torch.Tensor, offset: int, shape: torch.Size) -> torch.Tensor:
    """A tensor viewing ``flat[offset : offset + numel]`` through a storage of its own."""
    numel = 1
    for s in shape:
        numel *= s
    if flat.dtype == torch.bfloat16:
        raw = flat.view(torch.int16).numpy()[offset : offset + numel]
        return torch.from_numpy(raw).view(torch.bfloat16).view(shape)
    return torch.from_numpy(flat.numpy()[offset : offset + numel]).view(shape)


@dataclass(eq=False)
class Entry:
    """One tensor a unit needs at compute time."""

    name: str  # dotted name inside the unit's module ("self_attn.q_proj.weight")
    tensor: torch.Tensor  # the registered Parameter (or buffer) of the real module
    kind: str  # "trainable" | "frozen" | "buffer"
    owner: int  # index of the unit whose flat holds it (tied weights live in one place)
    wire: torch.dtype  # dtype in which it is sent to the device
    offset: int = 0  # element offset inside the owner's master (trainable) or frozen flat
    shape: torch.Size = field(default_factory=lambda: torch.Size())

    @property
    def numel(self) -> int:
        return self.tensor.numel()

    @property
    def source(self) -> tuple:
        """Which host flat of the owner it is sent from (see HostStore.source)."""
        if self.kind == "frozen":
            return ("frozen", self.wire)
        return ("trainable", self.wire)


@dataclass
class UnitBuffers:
    """The host buffers of one unit (see module docstring)."""

    master_host: torch.Tensor | None = None  # fp32: [low-precision-wire params | fp32-wire params]
    grad_host: torch.Tensor | None = None
    staging_host: torch.Tensor | None = None  # compute dtype copy of master_host[:n_lp]
    n_lp: int = 0
    frozen_host: dict = field(default_factory=dict)  # wire dtype -> flat
    staging_dirty: bool = True
    staged_versions: tuple[int, ...] = ()


def wire_dtype(param: torch.Tensor, compute_dtype: torch.dtype, is_embedding: bool, name: str = "") -> torch.dtype:
    """Matrices travel in the compute dtype; vectors (norms, biases), embedding tables and PEFT
    LoRA matrices (``lora_A``/``lora_B``: PEFT casts the adapter's input to their dtype, so a bf16
    copy would move LoRA dropout and its backward to bf16) in fp32.

    This is exactly what autocast does to an fp32 model: matmul weights are rounded to bf16,
    embeddings, norms and the residual stream stay fp32. Keeping that split makes bf16 runs match
    plain HF bf16 training closely instead of drifting with a bf16 residual stream.
    """
    if param.ndim >= 2 and not is_embedding and ".lora_" not in f".{name}":
        return compute_dtype
    return torch.float32 if param.is_floating_point() else param.dtype


class HostStore:
    """Allocates the per-unit buffers and re-points the model's tensors into them.

    ``units`` is a list of ``(unit_name, module)``; ``embedding_units`` the indices whose weights
    are lookup tables. The store does not know what a model is.
    """

    def __init__(
        self,
        units: list[tuple[str, torch.nn.Module]],
        compute_dtype: torch.dtype,
        device: torch.device,
        pin: bool,
        embedding_units: frozenset[int] = frozenset(),
        staging: bool = True,
    ) -> None:
        self.compute_dtype = compute_dtype
        # a host copy in the compute dtype (else the streamer rounds the fp32 masters after the
        # upload, on the device); never needed for fp32 compute
        self.staging = staging and compute_dtype != torch.float32
        self.device = device
        self.pin = pin
        self.names = [name for name, _ in units]
        self.entries: list[list[Entry]] = []
        self.buffers: list[UnitBuffers] = []
        self._registered: list[torch.Tensor] = []
        # Unpinned when the store goes away even without release(): the finalizer holds the flats,
        # so their memory cannot return to malloc (and be registered again) while still pinned.
        self._unpin = weakref.finalize(self, _unregister, self._registered)
        self._param_home: dict[int, tuple[int, Entry]] = {}
        self._plan(units, embedding_units)
        self._allocate()
        # Readiness of each unit's masters: cleared while a background update runs on them.
        self._ready = [threading.Event() for _ in self.entries]
        for event in self._ready:
            event.set()
        self._updaters: list[threading.Thread | None] = [None] * len(self.entries)  # who runs that update
        self.generation = [0] * len(self.entries)  # bumped whenever a unit's masters change
        self.error: BaseException | None = None  # first exception of a background update

    # ------------------------------------------------------------------ layout
    def _plan(self, units: list[tuple[str, torch.nn.Module]], embedding_units: frozenset[int]) -> None:
        self._sizes: list[dict] = []
        for u, (unit_name, module) in enumerate(units):
            entries: list[Entry] = []
            fresh: list[Entry] = []
            for name, param in module.named_parameters(remove_duplicate=False):
                home = self._param_home.get(id(param))
                if home is not None:  # tied: lives in an earlier unit's flat
                    owner, first = home
                    entries.append(Entry(name, param, first.kind, owner, first.wire, first.offset, param.shape))
                    continue
                if param.device.type != "cpu":
                    raise ValueError(
                        f"parameter {unit_name}.{name} is on {param.device}; megatrain needs the model "
                        "on the CPU (host RAM is its home). Load it without device_map / .to('cuda'), "
                        "e.g. AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)."
                    )
                kind = "trainable" if param.requires_grad else "frozen"
                wire = wire_dtype(param, self.compute_dtype, u in embedding_units, name)
                entry = Entry(name, param, kind, u, wire, 0, param.shape)
                self._param_home[id(param)] = (u, entry)
                entries.append(entry)
                fresh.append(entry)
            # Trainable: low-precision-wire entries first so that staging covers master[:n_lp].
            sizes: dict = {"n_lp": 0, "n_train": 0, "frozen": {}}
            lp = [e for e in fresh if e.kind == "trainable" and e.wire != torch.float32]
            fp = [e for e in fresh if e.kind == "trainable" and e.wire == torch.float32]
            for e in lp:
                e.offset = sizes["n_train"]
                sizes["n_train"] += _aligned(e.numel)
            sizes["n_lp"] = sizes["n_train"]
            for e in fp:
                e.offset = sizes["n_train"]
                sizes["n_train"] += _aligned(e.numel)
            for e in fresh:
                if e.kind == "frozen":
                    e.offset = sizes["frozen"].get(e.wire, 0)
                    sizes["frozen"][e.wire] = e.offset + _aligned(e.numel)
            for name, buf in module.named_buffers():
                entries.append(Entry(name, buf, "buffer", u, buf.dtype, 0, buf.shape))
            self.entries.append(entries)
            self._sizes.append(sizes)

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
        span = -(-nbytes // _PAGE) * _PAGE
        raw = torch.empty(span + _PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % _PAGE
        flat = raw[start : start + nbytes].view(dtype)  # shares raw's storage: raw stays alive
        err = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), span, 0)
        if int(err) != 0:
            raise RuntimeError(
                f"cudaHostRegister refused to pin {span / 2**30:.3f} GiB (error {int(err)}). "
                "The OS limits page-locked memory (ulimit -l) or RAM is short. Fix: raise the "
                "memlock limit, free host RAM, or set MegaTrainConfig(pin_memory=False) "
                "(correct but transfers run several times slower)."
            )
        self._registered.append(flat)
        return flat

    def _allocate(self) -> None:
        for u, entries in enumerate(self.entries):
            bufs = UnitBuffers()
            sizes = self._sizes[u]
            if sizes["n_train"]:
                bufs.master_host = self.allocate(sizes["n_train"], torch.float32)
                bufs.grad_host = self.allocate(sizes["n_train"], torch.float32)
                bufs.grad_host.zero_()
                bufs.n_lp = sizes["n_lp"]
                if self.staging and bufs.n_lp:
                    bufs.staging_host = self.allocate(bufs.n_lp, self.compute_dtype)
            for dtype, n in sizes["frozen"].items():
                bufs.frozen_host[dtype] = self.allocate(n, dtype)
            for e in entries:
                if e.owner != u or e.kind == "buffer":
                    continue
                flat = bufs.master_host if e.kind == "trainable" else bufs.frozen_host[e.wire]
                with torch.no_grad():
                    flat[e.offset : e.offset + e.numel].copy_(e.tensor.detach().reshape(-1))
                e.tensor.data = alias(flat, e.offset, e.shape)
            self.buffers.append(bufs)
        logger.info(
            "host store: %d units, %.3f GiB of fp32 masters, %.3f GiB host buffers in all, pinned=%s",
            len(self.entries),
            self.trainable_numel() * 4 / 2**30,
            self.host_bytes() / 2**30,
            self.pin,
        )

    # ------------------------------------------------------------------ queries
    def trainable_numel(self) -> int:
        return sum(b.master_host.numel() for b in self.buffers if b.master_host is not None)

    def host_bytes(self) -> int:
        total = 0
        for b in self.buffers:
            for t in (b.master_host, b.grad_host, b.staging_host, *b.frozen_host.values()):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total

    def home_of(self, param: torch.Tensor) -> tuple[int, Entry] | None:
        """(owner unit, entry) of a parameter the store manages, else None."""
        return self._param_home.get(id(param))

    def trainable_entries(self, u: int) -> list[Entry]:
        return [e for e in self.entries[u] if e.kind == "trainable"]

    # ------------------------------------------------------------------ staging
    def mark_dirty(self, u: int | None = None) -> None:
        """The masters of unit ``u`` (all units if None) changed: re-stage before the next fetch."""
        targets = range(len(self.buffers)) if u is None else (u,)
        for i in targets:
            self.buffers[i].staging_dirty = True
            self.generation[i] += 1

    # ------------------------------------------------------------------ readiness
    def begin_update(self, u: int, worker: threading.Thread | None = None) -> None:
        """A background update of unit ``u``'s masters starts (run by ``worker``): readers must wait."""
        self._updaters[u] = worker
        self._ready[u].clear()
        self.generation[u] += 1  # now, on the training thread: an upload issued before is stale

    def claim_update(self, u: int, worker: threading.Thread) -> None:
        """The update of unit ``u`` (begun by :meth:`begin_update`) is run by ``worker`` after all."""
        self._updaters[u] = worker

    def end_update(self, u: int, error: BaseException | None = None) -> None:
        if error is not None and self.error is None:
            self.error = error
        self._updaters[u] = None
        self._ready[u].set()

    def wait_ready(self, u: int) -> None:
        """Block until unit ``u``'s masters are not being updated; re-raise a background failure."""
        self._wait(u)
        self.raise_error()

    def synchronize(self) -> None:
        for u in range(len(self._ready)):
            self._wait(u)
        self.raise_error()

    def _wait(self, u: int) -> None:
        """Wait for unit ``u``; raise instead of hanging if the thread that was to update it is gone."""
        event = self._ready[u]
        while not event.wait(timeout=1.0):
            worker = self._updaters[u]
            if worker is not None and not worker.is_alive() and not event.is_set():
                # Release every unit that thread still held: the error is reported once, as for a
                # failed update, and later reads do not block forever.
                for v, w in enumerate(self._updaters):
                    if w is worker:
                        self._updaters[v] = None
                        self._ready[v].set()
                raise RuntimeError(
                    f"megatrain: the thread updating unit {u} ({self.names[u]}), {worker.name!r}, ended "
                    "before finishing its update; the optimizer was closed or garbage-collected while an "
                    "update was pending. Restart from the last checkpoint."
                )

    def raise_error(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"megatrain background update failed: {error!r}") from error

    def _versions(self, u: int) -> tuple[int, ...]:
        return tuple(e.tensor._version for e in self.entries[u] if e.owner == u and e.kind == "trainable")

    def stage(self, u: int) -> None:
        """Refresh the compute-dtype copy of unit ``u``'s masters if they changed.

        Changes are known from ``mark_dirty`` (optimizer steps) or from the parameters' version
        counters (``load_state_dict``, in-place edits).
        """
        bufs = self.buffers[u]
        if bufs.staging_host is None:
            return
        versions = self._versions(u)
        if bufs.staging_dirty or versions != bufs.staged_versions:
            bufs.staging_host.copy_(bufs.master_host[: bufs.n_lp])
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

    def source(self, u: int, key: tuple) -> tuple[torch.Tensor, int]:
        """(host flat, element offset of its first element in the entries' numbering) for ``key``."""
        bufs = self.buffers[u]
        kind, wire = key
        if kind == "frozen":
            return bufs.frozen_host[wire], 0
        if wire != torch.float32:
            if bufs.staging_host is not None:
                self.stage(u)
                return bufs.staging_host, 0
            return bufs.master_host[: bufs.n_lp], 0
        return bufs.master_host[bufs.n_lp :], bufs.n_lp

    # ------------------------------------------------------------------ gradients
    def accumulate_grad(self, entry: Entry, grad: torch.Tensor) -> None:
        """Add ``grad`` (any device/dtype) into the fp32 host accumulator of ``entry``.

        The parameter's ``.grad`` is a view of the accumulator; ``zero_grad(set_to_none=True)``
        drops that view, and the next accumulation starts the region afresh.
        """
        param = entry.tensor
        region = self.buffers[entry.owner].grad_host[entry.offset : entry.offset + entry.numel]
        grad_host = grad.detach().reshape(-1)
        if grad_host.device.type != "cpu":
            grad_host = grad_host.to("cpu")
        # copy_/add_ convert a bf16 gradient to fp32 on the fly (no temporary fp32 copy)
        if param.grad is None:
            region.copy_(grad_host)
            param.grad = region.view(entry.shape)
        elif param.grad.data_ptr() == region.data_ptr():
            region.add_(grad_host)
        else:  # the user replaced .grad with a tensor of their own
            param.grad.add_(grad.detach().to(param.grad.device, param.grad.dtype).view(entry.shape))

    # ------------------------------------------------------------------ teardown
    def free(self, flat: torch.Tensor) -> None:
        """Unpin a flat from :meth:`allocate` that nothing uses any more (its memory goes back to malloc)."""
        for i, registered in enumerate(self._registered):
            if registered is flat:
                del self._registered[i]
                torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())
                return

    def release(self) -> None:
        """Unpin the buffers. The parameters keep aliasing them (they stay valid host memory)."""
        _unregister(self._registered)
