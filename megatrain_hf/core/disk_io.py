"""The disk tier's I/O engine: positional reads and writes of whole buffers, on a thread pool.

Dependency-free: ``os.preadv`` / ``os.pwritev`` release the GIL, so a few threads keep several
requests in flight while the update computes. A request is cut into pieces of ``request_bytes``
(default 4 MiB), one task each. Files are opened with ``O_DIRECT`` (no page cache: the bytes
paged out do not come back as cached RAM) where the filesystem allows it -- checked with one
aligned read at open, since some filesystems accept the flag and then refuse the I/O, and tmpfs on older kernels
refuses the flag itself -- else without it (logged). ``O_DIRECT`` needs
buffers, offsets and lengths aligned to :data:`ALIGN`: :func:`aligned_empty` gives such buffers,
and callers lay their files out on :data:`ALIGN` boundaries.

Every failure reaches the caller: a request's :class:`Pending` re-raises the first error of its
pieces, as an ``OSError`` naming the file, the offset, the byte count and the OS's reason (its
errno kept: ``ENOSPC`` for a full disk). Nothing is retried and nothing is logged instead.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import os

import torch

from ..errors import DiskIOError, MegatrainConfigError

logger = logging.getLogger(__name__)

ALIGN = 4096
"""Alignment of O_DIRECT buffers, file offsets and lengths (the usual logical block size and page)."""

DEFAULT_REQUEST_BYTES = 4 * 2**20


def align_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` (rounded up to :data:`ALIGN`) starting on an :data:`ALIGN` boundary."""
    span = align_up(max(nbytes, 1))
    raw = torch.empty(span + ALIGN, dtype=torch.uint8)
    start = -raw.data_ptr() % ALIGN
    return raw[start : start + span]  # shares raw's storage: raw stays alive


class Pending:
    """The pieces of one read or write in flight; :meth:`wait` returns when all are done."""

    def __init__(self, futures: list[concurrent.futures.Future]) -> None:
        self._futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        """Block until every piece is done; raise the first piece's error (the others are waited for too)."""
        first = None
        for f in self._futures:
            exc = f.exception()
            if exc is not None and first is None:
                first = exc
        if first is not None:
            raise first


DONE = Pending([])


class DiskIO:
    """A pool of ``threads`` threads running ``preadv`` / ``pwritev`` pieces of ``request_bytes``."""

    def __init__(self, threads: int = 4, request_bytes: int = DEFAULT_REQUEST_BYTES, direct: bool = True) -> None:
        if request_bytes < ALIGN or request_bytes % ALIGN:
            raise MegatrainConfigError(f"DiskIO request_bytes={request_bytes}: must be a positive multiple of {ALIGN}")
        self.request_bytes = request_bytes
        self.want_direct = direct
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="megatrain-disk")
        self._paths: dict[int, str] = {}
        self.direct: dict[int, bool] = {}

    # ------------------------------------------------------------------ files
    def create(self, path: str, nbytes: int) -> int:
        """Create ``path`` (it must not exist) holding ``nbytes`` zero bytes, its blocks reserved
        (``posix_fallocate`` where the filesystem has it, so a full disk shows now, not mid-run); return the fd."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if nbytes:
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                        raise io_error("reserving", path, nbytes, 0, exc) from None
                    os.ftruncate(fd, nbytes)  # no preallocation here: a sparse file of zeros
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        return self.open(path)

    def open(self, path: str) -> int:
        """Open an existing file for reading and writing, with ``O_DIRECT`` where it works."""
        if self.want_direct and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(path, os.O_RDWR | os.O_DIRECT)
            except OSError:
                fd = None
            if fd is not None:
                if self._direct_works(fd):
                    return self._register(fd, path, True)
                os.close(fd)
        return self._register(os.open(path, os.O_RDWR), path, False)

    def _direct_works(self, fd: int) -> bool:
        if os.fstat(fd).st_size < ALIGN:
            return True  # nothing to probe; aligned requests are all we issue
        probe = aligned_empty(ALIGN)
        try:
            return os.preadv(fd, [probe.numpy()], 0) == ALIGN
        except OSError:
            return False

    def _register(self, fd: int, path: str, direct: bool) -> int:
        if self.want_direct and not direct:
            logger.info("megatrain disk tier: %s does not take O_DIRECT; using buffered I/O", os.path.dirname(path))
        self._paths[fd], self.direct[fd] = path, direct
        return fd

    def empty(self, nbytes: int) -> torch.Tensor:
        """A buffer of ``nbytes`` this engine reads into and writes from at full speed (:func:`aligned_empty`)."""
        return aligned_empty(nbytes)

    def close(self, fd: int) -> None:
        self._paths.pop(fd, None)
        self.direct.pop(fd, None)
        os.close(fd)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        for fd in list(self._paths):
            self.close(fd)

    # ------------------------------------------------------------------ requests
    def read(self, fd: int, buffer: torch.Tensor, offset: int) -> Pending:
        """Fill ``buffer`` (a contiguous CPU tensor) from ``offset`` of ``fd``, in the background."""
        return self._submit(_read_piece, fd, buffer, offset)

    def write(self, fd: int, buffer: torch.Tensor, offset: int) -> Pending:
        """Write ``buffer`` at ``offset`` of ``fd``, in the background."""
        return self._submit(_write_piece, fd, buffer, offset)

    def sync(self, fd: int) -> None:
        try:
            os.fsync(fd)
        except OSError as exc:
            raise io_error("syncing", self._paths[fd], 0, 0, exc) from None

    def _submit(self, piece, fd: int, buffer: torch.Tensor, offset: int) -> Pending:
        view = buffer.reshape(-1).view(torch.uint8).numpy()
        path = self._paths[fd]
        step = self.request_bytes
        return Pending([self._pool.submit(piece, fd, path, view[i : i + step], offset + i)
                        for i in range(0, len(view), step)])


def io_error(what: str, path: str, nbytes: int, offset: int, exc: OSError) -> DiskIOError:
    return DiskIOError(exc.errno, f"megatrain disk tier: {what} {nbytes} bytes at offset {offset} of {path} failed: "
                       f"{exc.strerror or exc}" + (" (the disk is full: free space on it or choose "
                                                   "another offload_dir)" if exc.errno == errno.ENOSPC else ""))


def _read_piece(fd: int, path: str, view, offset: int) -> None:
    done = 0
    try:
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(errno.EIO, "unexpected end of file")
            done += n
    except OSError as exc:
        raise io_error("reading", path, len(view), offset, exc) from None


def _write_piece(fd: int, path: str, view, offset: int) -> None:
    done = 0
    try:
        while done < len(view):
            done += os.pwritev(fd, [view[done:]], offset + done)
    except OSError as exc:
        raise io_error("writing", path, len(view), offset, exc) from None


# ---------------------------------------------------------------------------------- the run's directory
RUN_DIR_PREFIX = "megatrain-state-"


def check_offload_dir(offload_dir) -> str:
    """``offload_dir`` as an absolute path, or a ``ValueError`` naming the problem and the fix."""
    if not isinstance(offload_dir, (str, os.PathLike)) or not str(offload_dir):
        raise MegatrainConfigError(f"offload_dir={offload_dir!r}: must be the path of an existing, writable directory "
                                   "(e.g. offload_dir='/nvme/megatrain'), or None to keep the optimizer state in RAM.")
    path = os.path.abspath(os.fspath(offload_dir))
    if not os.path.exists(path):
        raise MegatrainConfigError(
            f"offload_dir={str(offload_dir)!r} does not exist. Fix: create it (mkdir -p {path}) on a "
            "local disk with room for the optimizer state, or point offload_dir at one.")
    if not os.path.isdir(path):
        raise MegatrainConfigError(
            f"offload_dir={str(offload_dir)!r} is a file, not a directory. Fix: point offload_dir at "
            "a directory (megatrain creates its own sub-directory inside it).")
    reason = None if os.access(path, os.W_OK | os.X_OK) else "no write permission"
    if reason is None:
        try:  # a read-only filesystem (or root on one) passes os.access: try it
            os.close(os.open(os.path.join(path, f".megatrain-probe-{os.getpid()}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY,
                             0o600))
            os.unlink(os.path.join(path, f".megatrain-probe-{os.getpid()}"))
        except OSError as exc:
            reason = exc.strerror or str(exc)
    if reason is not None:
        raise MegatrainConfigError(
            f"offload_dir={str(offload_dir)!r} is not writable by this process ({reason}). Fix: choose "
            f"a directory on a writable local disk, or change its permissions (chmod u+wx {path}).")
    return path


def create_run_dir(offload_dir) -> str:
    """A new directory of this run inside ``offload_dir``: mode 0700, a unique name, never one that existed."""
    import tempfile

    path = check_offload_dir(offload_dir)
    remove_stale_run_dirs(path)
    return tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-", dir=path)


def remove_stale_run_dirs(offload_dir: str) -> list[str]:
    """Remove the run directories that processes no longer alive left (SIGKILL, power loss): those named
    ``megatrain-state-<pid>-*`` whose pid is gone and that hold only the tier's ``unit-*.state`` files."""
    removed = []
    for name in os.listdir(offload_dir):
        parts = name[len(RUN_DIR_PREFIX):].split("-", 1)
        if not name.startswith(RUN_DIR_PREFIX) or not parts[0].isdigit() or _alive(int(parts[0])):
            continue
        run_dir = os.path.join(offload_dir, name)
        try:
            files = os.listdir(run_dir)
        except OSError:
            continue
        if all(f.startswith("unit-") and f.endswith(".state") for f in files):
            remove_run_dir(run_dir, files)
            logger.info("megatrain disk tier: removed %s, left by process %s that no longer runs", run_dir, parts[0])
            removed.append(run_dir)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_run_dir(run_dir: str, names: list[str]) -> None:
    """Remove the files ``names`` this run created in ``run_dir``, then the directory if that emptied it."""
    for name in names:
        try:
            os.unlink(os.path.join(run_dir, name))
        except FileNotFoundError:
            pass
    try:
        os.rmdir(run_dir)
    except OSError as exc:  # something else was put there: leave it
        logger.warning("megatrain disk tier: could not remove %s: %s", run_dir, exc)
