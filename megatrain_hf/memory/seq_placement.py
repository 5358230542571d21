"""The placement the engine takes for ``max_seq_len``: the joint plan narrowed to exact choices.

``MegaTrainConfig(max_seq_len=N)`` asks the engine to place the optimizer state and the activation
checkpoints itself, before allocating (``plan.py``). :func:`place` runs the joint plan
(``long_context.py``) over the choices that change no number of the training:

* the checkpoints' home (the GPU; pinned host RAM, spilling to the disk tier when ``offload_dir`` is set;
  every one on the disk tier) and ``checkpoint_interval`` (1, 2, 4, 8): the same bytes come back;
* the host staging copy or not (the same bf16 bits, rounded on the host or on the GPU);
* with ``offload_dir``, the AdamW moments (and the fp32 masters) on disk instead of RAM.

The options that change the numbers -- ``checkpoint_dtype="bf16"``, ``optimizer_state`` other than fp32,
``grad_dtype="bf16"`` (a bf16 ``param.grad`` user code sees, and a refusal of accumulation) -- are never
chosen here: they are the user's (:class:`Fixed`), and when only they would fit the length, the refusal
names them with the length each one fits. An option the user set is held fixed the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import LongContextFitError
from .host import gib
from .long_context import INTERVALS, JointPlan, StateChoice, _best, candidates, longest
from .shapes import ModelShape

UNBOUNDED = 1 << 62


@dataclass(frozen=True)
class Fixed:
    """The options :func:`place` may not change; None: the placement chooses (the option was ``"auto"``)."""

    compute_dtype: str = "fp32"  # "bf16" or "fp32"
    optimizer_state: str = "fp32"
    grad_dtype: str = "fp32"
    checkpoint_dtype: str = "fp32"
    host_staging: bool | None = None
    offload_checkpoints: bool | str | None = None  # False, True, "disk"; None: chosen
    checkpoint_interval: int | None = None
    offload_state: str = "auto"  # with a disk tier: "auto" (chosen), "none", "moments", "all"
    grad_accum: int = 1

    def states(self, disk: bool) -> tuple[StateChoice, ...]:
        """The state choices these options allow (``disk``: a disk tier exists)."""
        bf16 = self.compute_dtype == "bf16"
        staging = (True, False) if self.host_staging is None and bf16 else (self.host_staging is not False and bf16,)
        on_disk = {"auto": ("none", "moments", "all"), "none": ("none",), "moments": ("moments",),
                   "all": ("all",)}[self.offload_state]
        out = []
        for where in on_disk if disk else ("none",):
            for keep in staging:
                if where == "all" and not (bf16 and keep):
                    continue  # the masters on disk need the staging copy the device streams instead (plan.py)
                out.append(StateChoice(self.optimizer_state, keep, self.grad_dtype, where))
        return tuple(out)

    def narrowed(self, disk: bool) -> dict:
        """``long_context.candidates``' keyword arguments for these options."""
        homes = {None: ("gpu", "host", "disk"), False: ("gpu",), True: ("host",), "disk": ("disk",)}
        return dict(states=self.states(disk), homes=homes[self.offload_checkpoints],
                    intervals=INTERVALS if self.checkpoint_interval is None else (self.checkpoint_interval,),
                    dtypes=(self.checkpoint_dtype,), grad_accum=self.grad_accum)


def place(shape: ModelShape, seq_len: int, gpu: int | None, host: int | None, disk: int | None, fixed: Fixed,
          **kw) -> JointPlan:
    """The exact placement at ``seq_len`` with ``fixed`` held (the shortest estimated step among those that
    fit); raises :class:`LongContextFitError` naming the longest length that fits and what would fit more.
    ``gpu`` / ``host`` None: not measured (not checked); ``disk`` None: no disk tier."""
    gpu, host = gpu if gpu is not None else UNBOUNDED, host if host is not None else UNBOUNDED
    kw = dict(kw, compute_dtype=fixed.compute_dtype)
    best = _best(candidates(shape, seq_len, gpu, host, disk, **kw, **fixed.narrowed(disk is not None)), gpu, host, disk)
    if best is not None:
        return best
    raise LongContextFitError(refusal(shape, seq_len, gpu, host, disk, fixed, **kw))


def holds(shape: ModelShape, seq_len: int, gpu: int | None, host: int | None, disk: int | None, fixed: Fixed,
          **kw) -> JointPlan | None:
    """The placement ``fixed`` pins (every choice made) at ``seq_len``, or None when it does not fit there."""
    gpu, host = gpu if gpu is not None else UNBOUNDED, host if host is not None else UNBOUNDED
    plans = candidates(shape, seq_len, gpu, host, disk, compute_dtype=fixed.compute_dtype, **kw,
                       **fixed.narrowed(disk is not None))
    return _best(plans, gpu, host, disk)


def _fits_with(shape, seq_len, gpu, host, disk, fixed: Fixed, **kw) -> tuple[bool, int]:
    """(whether ``fixed`` fits ``seq_len``, the longest length it fits)."""
    narrowed = fixed.narrowed(disk is not None)
    if not narrowed["states"]:
        return False, 0
    if _best(candidates(shape, seq_len, gpu, host, disk, **kw, **narrowed), gpu, host, disk) is not None:
        return True, seq_len
    return False, longest(shape, gpu, host, disk, **kw, **narrowed)[0]


def refusal(shape: ModelShape, seq_len: int, gpu: int, host: int, disk: int | None, fixed: Fixed, **kw) -> str:
    """What, why and the fix of a ``max_seq_len`` no exact placement fits: the longest that fits, and each
    option that would fit more (the length it fits, or that it fits ``max_seq_len``)."""
    narrowed = fixed.narrowed(disk is not None)
    seq, plan = longest(shape, gpu, host, disk, **kw, **narrowed)
    machine = ", ".join(s for s in (f"a {gib(gpu)} GiB GPU" if gpu < UNBOUNDED else "",
                                    f"{gib(host)} GiB of host RAM" if host < UNBOUNDED else "",
                                    f"{gib(disk)} GiB free under offload_dir" if disk is not None else
                                    "no disk tier (offload_dir unset)") if s)
    fixes = []

    reached = [seq]

    def relaxed(label: str, **change) -> None:
        fits, n = _fits_with(shape, seq_len, gpu, host, disk, Fixed(**(vars(fixed) | change)), **kw)
        if n > reached[-1]:  # more than exact, and than the option named before it (4-bit after 8-bit)
            fixes.append(f"{label} fits {'max_seq_len=' + str(seq_len) if fits else str(n) + ' tokens'}")
        reached.append(max(n, reached[-1]) if "optimizer_state" in change else seq)

    bf16 = fixed.compute_dtype == "bf16"
    chosen = dict(host_staging=None, offload_checkpoints=None, checkpoint_interval=None, offload_state="auto")
    if any(getattr(fixed, k) != v for k, v in chosen.items()):
        relaxed("leaving " + ", ".join(f"{k}" for k, v in chosen.items() if getattr(fixed, k) != v)
                + " at 'auto' (exact)", **chosen)
    if bf16 and fixed.checkpoint_dtype == "fp32":
        relaxed("checkpoint_dtype='bf16' (not exact)", checkpoint_dtype="bf16")
    if bf16 and fixed.grad_dtype == "fp32" and fixed.grad_accum == 1:
        relaxed("grad_dtype='bf16' (param.grad in bf16)", grad_dtype="bf16")
    for state in ("8bit", "4bit"):
        if fixed.optimizer_state in ("fp32", "bf16") or (state == "4bit" and fixed.optimizer_state == "8bit"):
            relaxed(f"optimizer_state={state!r} (not exact)", optimizer_state=state)
    if disk is None:
        with_disk = [p for p in candidates(shape, seq_len, gpu, host, UNBOUNDED, **kw, **fixed.narrowed(True))
                     if p.fits(gpu, host, UNBOUNDED)]
        need = min((sum(p.disk.values()) for p in with_disk), default=None)
        if need is not None:
            fixes.append(f"offload_dir on a local disk with {gib(need)} GiB free (exact)")
    plans = candidates(shape, seq_len, gpu, host, disk, **kw, **narrowed)
    need_gpu = min((sum(p.gpu.values()) for p in plans if p.fits(UNBOUNDED, host, disk)), default=None)
    if need_gpu is not None and gpu < UNBOUNDED:
        fixes.append(f"a GPU (or max_gpu_memory) of {gib(need_gpu)} GiB (exact)")
    need_host = min((sum(p.host.values()) for p in plans if p.fits(gpu, UNBOUNDED, disk)), default=None)
    if need_host is not None and host < UNBOUNDED:
        fixes.append(f"{gib(need_host)} GiB of host RAM available (exact)")
    longest_txt = (f"with exact options the longest that fits is {seq} tokens ({plan.placement()})" if plan is not None
                   else "with exact options not even 1024 tokens fit")
    fixes.append(f"max_seq_len={seq}" if seq else "a smaller model or fewer tokens per micro-batch")
    return (f"megatrain: MegaTrainConfig(max_seq_len={seq_len}): {shape.name or 'the model'} does not fit {machine} "
            f"at {seq_len} tokens per micro-batch: no exact placement of the optimizer state and the activation "
            f"checkpoints fits all of them; {longest_txt}. Fix: " + "; or ".join(fixes) + ".")
