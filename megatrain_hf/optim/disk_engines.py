"""The disk tier's I/O engines: the thread pool (default) or DeepSpeed's async I/O op (libaio), optional.

``disk_io="threads"``: :class:`~megatrain_hf.core.disk_io.DiskIO`, dependency-free.
``disk_io="deepspeed"``: :class:`DeepSpeedIO`, each request one call of DeepSpeed's ``aio_handle``
(libaio, ``O_DIRECT``, 1 MiB blocks, 32 in flight: the fastest configuration of
``scripts/disk_io_bench.py`` on the development machine) on a pool thread that owns its handle;
the GIL is released for the call. Needs ``pip install 'megatrain_hf[aio]'`` and libaio (its op is
compiled on first use, then cached by torch), a directory that takes ``O_DIRECT`` and
``posix_fallocate``, and page-locked buffers (``mlock``) for the RAM window. Refused with the reason
when one of these is missing. ``disk_io="auto"``: DeepSpeed's where all of that holds, else the thread pool (logged).

What DeepSpeed's op does not report, and what is checked here instead: it ignores each libaio
completion's result, so a write that runs out of space completes short without an error (measured:
8 MiB into a 4 MiB tmpfs reported done, 4 MiB in the file) -- the tier's files are fully
reserved with ``posix_fallocate`` before any write, which is why a directory without it is
refused; a read past the end of a file aborts the process on an ``assert`` -- bounds are checked
before the call and raised as an ``OSError`` naming the file and the bytes; a file it cannot open
returns -1 -- raised the same way. An I/O error the device reports inside a request (EIO) is not
seen by DeepSpeed's op: that is the thread pool's advantage, and why it stays the default.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import threading

import torch

from ..errors import DependencyError, MegatrainConfigError, PinnedMemoryError
from ..core.disk_io import ALIGN, DiskIO, Pending, align_up, io_error

logger = logging.getLogger(__name__)

CHOICES = ("threads", "auto", "deepspeed")
BLOCK_BYTES = 2**20
QUEUE_DEPTH = 32
HANDLES = 4
"""Requests in flight at once, each on its own handle: the window's two reads ahead, one write-back, one spare."""

_op = None
_op_error: str | None = None
_op_lock = threading.Lock()


def load_op():
    """DeepSpeed's ``async_io`` extension module (built on first use), or a ``RuntimeError`` saying why not."""
    global _op, _op_error
    with _op_lock:
        if _op is None and _op_error is None:
            try:
                from deepspeed.ops.op_builder import AsyncIOBuilder
            except Exception as exc:  # not installed, or its import failed here
                _op_error = (f"deepspeed is not importable ({type(exc).__name__}: {exc}); install it with "
                             "pip install 'megatrain_hf[aio]'")
            else:
                try:
                    _op = AsyncIOBuilder().load(verbose=False)
                except Exception as exc:  # no libaio headers, no compiler, a failed build
                    _op_error = (f"DeepSpeed's async_io op did not load ({type(exc).__name__}: {exc}); it needs "
                                 "libaio (apt-get install libaio-dev, or dnf install libaio-devel) and a C++ compiler")
        if _op is None:
            raise DependencyError(_op_error)
        return _op


def _lock_limit_reason(nbytes: int) -> str | None:
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    if int(status.get("CapEff", "0").strip(), 16) >> 14 & 1:  # CAP_IPC_LOCK: no limit applies
        return None
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    locked = int(status.get("VmLck", "0 kB").split()[0]) * 1024
    if soft == resource.RLIM_INFINITY or soft - locked >= nbytes:
        return None
    return (f"its buffers are page-locked (mlock) and RLIMIT_MEMLOCK allows {soft - locked} more bytes, fewer than "
            f"the RAM window's {nbytes}; raise the limit (ulimit -l unlimited; a container: --ulimit memlock=-1)")


def _directory_reason(directory: str) -> str | None:
    probe = os.path.join(directory, f".megatrain-aio-probe-{os.getpid()}")
    fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    io = DiskIO()
    try:
        try:
            os.posix_fallocate(fd, 0, ALIGN)
        except OSError as exc:
            return (f"{directory} does not reserve files (posix_fallocate: {exc.strerror}), and DeepSpeed's op does "
                    "not report a write that runs out of space")
        if not io.direct[io.open(probe)]:
            return f"{directory} does not take O_DIRECT, with which DeepSpeed's op opens every file"
        return None
    finally:
        os.close(fd)
        io.shutdown()
        os.unlink(probe)


def deepspeed_unavailable(directory: str, window_bytes: int) -> str | None:
    """Why the DeepSpeed engine cannot serve ``directory`` with a RAM window of ``window_bytes``; None: it can."""
    try:
        load_op()
    except RuntimeError as exc:
        return str(exc)
    return _lock_limit_reason(window_bytes) or _directory_reason(directory)


def open_disk_io(disk_io: str, directory: str, window_bytes: int) -> DiskIO:
    """The engine ``disk_io`` names (one of :data:`CHOICES`) for files in ``directory``."""
    if disk_io not in CHOICES:
        raise MegatrainConfigError(f"disk_io={disk_io!r}; allowed: {', '.join(map(repr, CHOICES))}")
    if disk_io == "threads":
        return DiskIO()
    reason = deepspeed_unavailable(directory, window_bytes)
    if reason is None:
        logger.info("megatrain disk tier: DeepSpeed's async I/O op (libaio) moves the optimizer state")
        return DeepSpeedIO(load_op())
    if disk_io == "deepspeed":
        raise DependencyError(f"megatrain: disk_io='deepspeed' cannot be used: {reason}. Fix that, or set "
                              "disk_io='threads' (the default) or 'auto' (DeepSpeed's op where it works).")
    logger.info("megatrain disk tier: disk_io='auto' uses the thread pool: %s", reason)
    return DiskIO()


class DeepSpeedIO(DiskIO):
    """:class:`DiskIO`'s files and interface; each read or write is one ``aio_handle`` call on a pool thread."""

    def __init__(self, op, handles: int = HANDLES, block_bytes: int = BLOCK_BYTES, queue_depth: int = QUEUE_DEPTH):
        super().__init__(threads=handles)
        self._op, self._config = op, (block_bytes, queue_depth, False, True, 1)
        self._local = threading.local()  # each pool thread's own handle
        self._allocator = op.aio_handle(*self._config)

    def empty(self, nbytes: int) -> torch.Tensor:
        """A page-locked, page-aligned buffer from DeepSpeed's locked-tensor manager (no bounce copy per request).
        Its memory is released at process exit: torch cannot tie it to the tensor's lifetime here."""
        out = self._allocator.new_cpu_locked_tensor(align_up(max(nbytes, 1)), torch.empty(0, dtype=torch.uint8))
        if out.data_ptr() == 0:
            raise PinnedMemoryError(f"megatrain disk tier: DeepSpeed could not page-lock {nbytes} bytes (mlock)")
        return out

    def _handle(self):
        handle = getattr(self._local, "handle", None)
        if handle is None:
            handle = self._local.handle = self._op.aio_handle(*self._config)
        return handle

    def read(self, fd: int, buffer: torch.Tensor, offset: int) -> Pending:
        return Pending([self._pool.submit(self._run, "reading", fd, self._paths[fd], buffer, offset)])

    def write(self, fd: int, buffer: torch.Tensor, offset: int) -> Pending:
        return Pending([self._pool.submit(self._run, "writing", fd, self._paths[fd], buffer, offset)])

    def _run(self, what: str, fd: int, path: str, buffer: torch.Tensor, offset: int) -> None:
        """One request, on a pool thread; every failure is raised from the request's ``Pending``."""
        view = buffer.reshape(-1).view(torch.uint8)
        if view.data_ptr() % ALIGN or view.numel() % ALIGN or offset % ALIGN:
            raise ValueError(f"DeepSpeedIO: {path}: buffer address, length ({view.numel()}) and offset ({offset}) "
                             f"must be multiples of {ALIGN} (O_DIRECT)")
        handle = self._handle()
        if what == "reading":
            size = os.fstat(fd).st_size
            if offset + view.numel() > size:  # DeepSpeed's op would abort the process on an assert
                raise io_error(what, path, view.numel(), offset, OSError(errno.EIO, f"the file holds {size} bytes"))
            done = handle.sync_pread(view, path, offset)
        else:
            done = handle.sync_pwrite(view, path, offset)
        if done != 1:  # -1: the op could not open or size the file (its reason went to stdout)
            raise io_error(what, path, view.numel(), offset,
                           OSError(errno.EIO, f"DeepSpeed's aio_handle returned {done}"))
