"""Copying byte ranges of files into an output file, hashing each byte on the way.

The `.om` writer (backend/om_format.py) streams the weights section from the files that
hold them (`FileRange`: a weight as safetensors or ONNX external data store it). Each
range is copied by the kernel (`copy_file_range`) in blocks; while the next block copies,
a second thread reads the block just written back from the output's pages (still in the
page cache, so a memory read, not a disk read), hashes it for the chunk digests and hands
it to the input model's hash (`FileSequenceHash`). Where the kernel cannot copy between
the two files, each block is read into a buffer, hashed there and written from it. Either
way the source's bytes are read from the disk once.

Docs: docs/om-format.md ("Writing"); the measurement: docs/performance.md ("Compile at
scale").
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import errno
import functools
import math
import os
import queue
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import xxhash

from npuc.errors import EXIT_IO, InternalError, NpucError

__all__ = ["Chunk", "Digester", "FileRange", "FileSequenceHash", "RangeCopy", "pwrite_all", "read_into",
           "write_behind"]

E_OPEN = "NPUC-E0401"
E_BOUNDS = "NPUC-E0404"

@dataclass(frozen=True)
class FileRange:
    """A payload chunk that is `length` bytes of the file `path` from `offset` (a weight as
    safetensors or ONNX external data store it). The writer reads it once, in blocks, and
    hashes and writes each block from that read; `what` names it in errors."""

    path: str
    offset: int
    length: int
    what: str = "data"

    def __len__(self) -> int:  # counted like the bytes it stands for
        return self.length

    def chunks(self) -> Iterator[bytes]:
        """The bytes themselves, read in blocks (for a reader that wants them in memory)."""
        try:
            if not stat.S_ISREG(os.stat(self.path).st_mode):  # a fifo's open() would block; a device never ends
                raise _cannot_read(self, OSError(0, "not a regular file"))
            with open(self.path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if self.offset + self.length > size:
                    raise _ended_early(self, size)
                f.seek(self.offset)
                left = self.length
                while left:
                    chunk = f.read(min(_BLOCK, left))
                    if not chunk:
                        raise _ended_early(self)
                    left -= len(chunk)
                    yield chunk
        except OSError as e:
            raise _cannot_read(self, e) from None


Chunk = bytes | bytearray | memoryview | FileRange

_BLOCK = 8 << 20  # bytes per read of a file range (os.preadv and xxhash let go of the GIL on each)
_BUFFERS = 8  # blocks the input model's hash may hold before the writer reads on without handing over


def _cannot_read(r: FileRange, e: OSError) -> NpucError:
    return NpucError(E_OPEN, f"cannot read {r.path!r} ({r.what}): {e.strerror or e}",
                     "keep the weights files beside the model", exit_code=EXIT_IO)


def _ended_early(r: FileRange, size: int | None = None) -> NpucError:
    have = "ended early" if size is None else f"has {size} bytes"
    return NpucError(E_BOUNDS, f"{r.what}: {r.path!r} {have}, it needs bytes {r.offset}..{r.offset + r.length}",
                     "the weights file is truncated", exit_code=EXIT_IO)


def read_into(fd: int, buf: memoryview, offset: int) -> int:
    """Fill `buf` from `offset`; fewer bytes only at the end of the file."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done) if hasattr(os, "preadv") else _pread_into(
            fd, buf[done:], offset + done)
        if n == 0:
            break
        done += n
    return done


def _pread_into(fd: int, buf: memoryview, offset: int) -> int:
    data = os.pread(fd, len(buf), offset)
    buf[: len(data)] = data
    return len(data)


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def write_behind(fd: int, offset: int, n: int) -> None:
    """Start putting these just-written bytes on disk now, so the closing fsync waits for
    the last of them only (Linux starts writeback of dirty pages on DONTNEED; pages
    still dirty stay cached)."""
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)


def _chain(spans: Sequence[tuple[int, int]]) -> list[int]:
    """Indices of the spans (start, end), in their order, whose starts do not go back and
    that do not overlap, with the most bytes in all (a weighted longest increasing run)."""
    best: list[tuple[int, int, int]] = []  # (end, bytes of the best chain ending there, its last span)
    prev: list[int] = []
    total: list[int] = []
    for i, (s, e) in enumerate(spans):
        j = bisect.bisect_right(best, (s, math.inf, math.inf)) - 1  # the best chain ending at or before s
        total.append(e - s + (best[j][1] if j >= 0 else 0))
        prev.append(best[j][2] if j >= 0 else -1)
        k = bisect.bisect_left(best, (e, -1, -1))
        if k > 0 and best[k - 1][1] >= total[i]:
            continue  # a chain ending earlier already holds as much
        while k < len(best) and best[k][1] <= total[i]:
            del best[k]  # ends no earlier, holds no more
        best.insert(k, (e, total[i], i))
    out, i = [], best[-1][2] if best else -1
    while i >= 0:
        out.append(i)
        i = prev[i]
    return out[::-1]


class FileSequenceHash:
    """XXH3-128 over whole files, each after its prefix, as if concatenated in order (the
    input model's hash), on a thread of its own.

    `ranges` are the file ranges a writer will read, in the writer's order. Those of them
    that come in this hash's order (the run of them with the most bytes) are hashed from
    the writer's reads, as it hands them over (`wants`, `give`, `skip`); the thread reads
    everything else itself, meanwhile. Once the writer is `done`, whatever it did not hand
    over is read here too, so a writer that reads otherwise only costs a second read."""

    def __init__(self, files: Sequence[tuple[str, bytes]], ranges: Sequence[FileRange] = ()) -> None:
        self._files = [p for p, _ in files]
        self._prefix = [b for _, b in files]
        self._sizes = [os.path.getsize(p) for p in self._files]
        self._index = {p: i for i, p in enumerate(self._files)}
        base = [sum(self._sizes[:i]) for i in range(len(self._files))]
        spans = [(self._index[r.path], r.offset, r.offset + r.length) for r in ranges
                 if r.path in self._index and r.length and r.offset + r.length <= self._sizes[self._index[r.path]]]
        # (file, start, end) of the ranges taken from the writer, in its order and in this one
        self._taken = [spans[i] for i in _chain([(base[f] + s, base[f] + e) for f, s, e in spans])]
        self._next = 0  # the taken range handed over next, and where in it
        self._expect = self._taken[0][1] if self._taken else 0
        self._at = (0, -1)  # hashed up to (file, offset); -1: before the file's prefix
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._h = xxhash.xxh3_128()
        self._buf = memoryview(bytearray(_BLOCK))
        self._fd: tuple[int, int] | None = None
        self._error: BaseException | None = None
        self._digest: str | None = None
        self.cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, name="npuc-source-hash", daemon=True)

    def start(self) -> None:
        if self._thread.ident is None:
            self._thread.start()

    # -- the writer's side (one thread) -------------------------------------------------

    def wants(self, r: FileRange, offset: int) -> bool:
        """Whether the block the writer reads next, at `offset` of `r`, is to be handed over."""
        if self._next >= len(self._taken) or self._error is not None or self.cancelled.is_set():
            return False
        return self._taken[self._next] == (self._index.get(r.path), r.offset, r.offset + r.length) \
            and offset == self._expect

    def give(self, block: memoryview, release: Callable[[], None]) -> None:
        """Hand over the wanted block; `release` is called once it is hashed."""
        self._jobs.put((block, release))
        self._advance(len(block))

    def skip(self, n: int) -> None:
        """The wanted block, `n` bytes, is not handed over: the thread reads it itself."""
        self._jobs.put((None, n))
        self._advance(n)

    def _advance(self, n: int) -> None:
        self._expect += n
        if self._expect >= self._taken[self._next][2]:
            self._next += 1
            self._expect = self._taken[self._next][1] if self._next < len(self._taken) else 0

    def done(self) -> None:
        """The writer hands over nothing more."""
        self._jobs.put(None)

    # -- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        handing = True  # the writer may still hand blocks over
        try:
            for f, s, e in [*self._taken, (len(self._files), -1, -1)]:
                self._read_to((f, s))
                at = s
                while at < e and not self.cancelled.is_set():
                    job = self._jobs.get() if handing else None
                    if job is None:  # the writer is done: read the rest of the range here
                        handing = False
                        self._read_to((f, e))
                        break
                    block, more = job
                    if block is None:
                        self._read_to((f, at + more))
                        at += more
                    else:
                        try:
                            self._h.update(block)
                        finally:
                            more()
                        at += len(block)
                        self._at = (f, at)
        except BaseException as e:  # raised again in hexdigest
            self._error = e
        finally:
            self._close()
            with contextlib.suppress(queue.Empty):
                while True:  # release what the writer handed over after an error or a cancel
                    job = self._jobs.get_nowait()
                    if job is not None and job[0] is not None:
                        job[1]()

    def _read_to(self, to: tuple[int, int]) -> None:
        """Hash from the cursor up to `to` (a file index and offset), reading the files."""
        while self._at < to:
            if self.cancelled.is_set():
                raise InternalError("the hash was cancelled")
            i, off = self._at
            if off < 0:
                self._h.update(self._prefix[i])
                self._at = (i, 0)
                continue
            end = to[1] if to[0] == i else self._sizes[i]
            if off >= end:
                self._at = (i + 1, -1)
                continue
            if self._fd is None or self._fd[0] != i:
                self._close()
                try:
                    self._fd = (i, os.open(self._files[i], os.O_RDONLY))
                except OSError as e:
                    raise _cannot_read(FileRange(self._files[i], 0, self._sizes[i], "the model's hash"), e) from None
            n = read_into(self._fd[1], self._buf[: min(_BLOCK, end - off)], off)
            if n == 0:
                raise _ended_early(FileRange(self._files[i], off, end - off, "the model's hash"))
            self._h.update(self._buf[:n])
            self._at = (i, off + n)

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd[1])
            self._fd = None

    def hexdigest(self) -> str:
        """The hash, once every file is read to its end (waits for the thread)."""
        if self._digest is None:
            self.done()
            self.start()
            self._thread.join()
            if self._error is not None:
                raise self._error
            if self.cancelled.is_set():
                raise InternalError("the hash was cancelled")
            self._digest = self._h.hexdigest()
        return self._digest

    def cancel(self) -> None:
        self.cancelled.set()
        self._jobs.put(None)
        if self._thread.ident is not None:
            self._thread.join(timeout=10)


class Digester(Protocol):
    """What a section's bytes are hashed with, in order (the chunk digests, or a SHA-256)."""

    def update(self, data: memoryview) -> None: ...


# copy_file_range's errors that mean "not between these two files": copy in user space.
_NO_KERNEL_COPY = frozenset({errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP,
                             errno.EBADF, errno.EPERM})


class RangeCopy:
    """Writes a streamed section's chunks at their place in the output `dst` (open for
    reading and writing), and feeds every byte, in order, to `digests` and, where it
    wants them, to `also` (the input model's hash, on its own thread).

    A file range is copied by the kernel, a block at a time; each block is then read back
    from the output's page cache, on a second thread while the next block copies, and
    hashed from that read. Where the kernel cannot copy (another filesystem, an old
    kernel, a platform without copy_file_range), a block is read into a buffer, hashed
    there and written from it. The source is read once either way."""

    def __init__(self, dst: int, digests: Digester, also: FileSequenceHash | None) -> None:
        self._dst = dst
        self._digests = digests
        self._also = also
        self._kernel = hasattr(os, "copy_file_range")
        self._fds: dict[str, tuple[int, int]] = {}  # path -> (descriptor, size)
        self._own = memoryview(bytearray(_BLOCK))
        # Buffers the model's hash holds until it has hashed them (then it puts them back).
        self._free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        for _ in range(_BUFFERS):
            self._free.put(memoryview(bytearray(_BLOCK)))
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def write(self, data: memoryview, dst_off: int) -> None:
        self._digests.update(data)
        pwrite_all(self._dst, data, dst_off)
        write_behind(self._dst, dst_off, data.nbytes)

    def copy(self, r: FileRange, dst_off: int) -> None:
        src, size = self._open(r)
        if r.offset + r.length > size:
            raise _ended_early(r, size)
        off, end = r.offset, r.offset + r.length
        pending: concurrent.futures.Future[None] | None = None  # the hashing of the block copied last
        try:
            while off < end:
                at = dst_off + off - r.offset
                n = self._kernel_copy(src, off, min(_BLOCK, end - off), at) if self._kernel else 0
                if n:
                    if pending is not None:
                        pending.result()
                    if self._pool is None:
                        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="npuc-weights-hash")
                    pending = self._pool.submit(self._hash_back, r, off, n, at)
                else:
                    if pending is not None:
                        last: concurrent.futures.Future[None] = pending
                        pending = None
                        last.result()
                    n = self._buffered(r, src, off, min(_BLOCK, end - off), at)
                off += n
        except BaseException:
            if pending is not None:  # let the thread finish; the first error is the one raised
                concurrent.futures.wait([pending])
            raise
        if pending is not None:
            pending.result()

    def _open(self, r: FileRange) -> tuple[int, int]:
        if r.path not in self._fds:
            try:
                if not stat.S_ISREG(os.stat(r.path).st_mode):  # a fifo's open() would block
                    raise OSError(0, "not a regular file")
                fd = os.open(r.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError as e:
                raise _cannot_read(r, e) from None
            self._fds[r.path] = (fd, os.fstat(fd).st_size)
            if hasattr(os, "posix_fadvise"):
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger readahead
        return self._fds[r.path]

    def _kernel_copy(self, src: int, off: int, n: int, at: int) -> int:
        """Copy up to `n` bytes in the kernel; 0 (and no kernel copies from now on) where
        it cannot copy between these files."""
        try:
            got = os.copy_file_range(src, self._dst, n, off, at)
        except OSError as e:
            if e.errno not in _NO_KERNEL_COPY:
                raise
            got = 0
        if got == 0:  # refused, or a filesystem that reports nothing copied: the buffered read tells which
            self._kernel = False
        return got

    def _hash_back(self, r: FileRange, off: int, n: int, at: int) -> None:
        """Hash the `n` bytes just copied to `at`, read back from the output's pages."""
        hand = self._also is not None and self._also.wants(r, off)
        buf = self._spare() if hand else None  # none spare: the model's hash reads the block itself
        view = (self._own if buf is None else buf)[:n]
        try:
            got = read_into(self._dst, view, at)
            if got != n:
                raise InternalError(f"the output holds {got} of the {n} bytes copied at {at}")
        except BaseException:
            if buf is not None:
                self._free.put(buf)
            raise
        self._feed(view, hand, buf)
        write_behind(self._dst, at, n)  # hashed: its writeback may start

    def _buffered(self, r: FileRange, src: int, off: int, n: int, at: int) -> int:
        """Read up to `n` bytes into a buffer, hash them there and write them from it."""
        hand = self._also is not None and self._also.wants(r, off)
        buf = self._spare() if hand else None
        view = (self._own if buf is None else buf)[:n]
        try:
            got = read_into(src, view, off)
        except OSError as e:
            if buf is not None:
                self._free.put(buf)
            raise _cannot_read(r, e) from None
        if got == 0:
            if buf is not None:
                self._free.put(buf)
            raise _ended_early(r)
        block = view[:got]
        self._feed(block, hand, buf)
        pwrite_all(self._dst, block, at)
        write_behind(self._dst, at, got)
        return got

    def _feed(self, block: memoryview, hand: bool, buf: memoryview | None) -> None:
        self._digests.update(block)
        if hand:
            assert self._also is not None
            if buf is None:
                self._also.skip(len(block))
            else:  # it only reads the buffer, and gives it back once hashed
                self._also.give(block, functools.partial(self._free.put, buf))

    def _spare(self) -> memoryview | None:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()
