"""The `.om` container: named, checksummed, aligned byte sections in one file.

This module only knows the container. What the sections hold (the serialized
model definition, the weights) is opaque bytes here.

Layout (all integers little-endian)::

    header   64 bytes   magic b"NPUCOM\\x00\\x01", version u32 (=1), flags u32 (=0),
                        section count u32, reserved u32 (=0),
                        SHA-256 of the section table (32 bytes), 8 zero bytes
    table    64 bytes per section: name (16 bytes ASCII, NUL padded),
                        offset u64, size u64, SHA-256 of the payload (32 bytes)
    payloads in table order, each at an offset aligned to its section's
                        alignment (64 by default, 4096 for "weights" so the
                        runtime can mmap it); padding is zero bytes and the
                        file ends exactly where the last payload ends.

The table precedes the payloads yet holds their hashes, so `OmWriter` lays the
file out first, streams the payloads (hashing as it goes) and then seeks back
to write the table and header. It writes to a temporary file and renames it
into place, so readers never see a half-written file. `OmFile` checks the
whole structure (and, by default, every checksum) before handing out any
section, and only ever hands out bytes: nothing is unpickled or executed.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import re
import stat
import struct
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import IO

from npuc.errors import EXIT_IO, InternalError, NpucError

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "SECTION_ALIGN_DEFAULT",
    "WEIGHTS_ALIGN",
    "OmFile",
    "OmWriter",
    "SectionInfo",
]

MAGIC = b"NPUCOM\x00\x01"
FORMAT_VERSION = 1
SECTION_ALIGN_DEFAULT = 64
WEIGHTS_ALIGN = 4096

_HEADER = struct.Struct("<8sIIII32s8s")
_ENTRY = struct.Struct("<16sQQ32s")
assert _HEADER.size == 64 and _ENTRY.size == 64
HEADER_SIZE = _HEADER.size
ENTRY_SIZE = _ENTRY.size

# Alignments the reader enforces by section name; the table does not record
# the alignment a writer asked for, so only these (and the default) are checked.
_REQUIRED_ALIGN = {"weights": WEIGHTS_ALIGN}
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,16}")

E_OPEN = "NPUC-E0401"
E_MAGIC = "NPUC-E0402"
E_VERSION = "NPUC-E0403"
E_BOUNDS = "NPUC-E0404"
E_CHECKSUM = "NPUC-E0405"
E_WRITE = "NPUC-E0406"

_HINT_RECOMPILE = "the file is damaged or incomplete; recompile the model with `npuc compile`"

Chunk = bytes | bytearray | memoryview


def _required_align(name: str) -> int:
    return _REQUIRED_ALIGN.get(name, SECTION_ALIGN_DEFAULT)


def _align_up(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class SectionInfo:
    """One table entry. `align` is the alignment the reader has checked for it."""

    name: str
    offset: int
    size: int
    align: int
    sha256: str


# --- writing ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Pending:
    name: str
    size: int
    align: int
    data: bytes | None
    chunks: Iterable[Chunk] | None


def _remove_orphans(directory: str, prefix: str) -> None:
    """Delete temp files that killed writers of this output left (`.<name>.<pid>.*.tmp`
    whose process is gone); a live writer's are left alone."""
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if not (name.startswith(prefix) and name.endswith(".tmp")):
                continue
            pid = name[len(prefix):].split(".", 1)[0]
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))
            except OSError:
                pass  # alive, but another user's


class OmWriter:
    """Collects sections, then writes the `.om` file atomically on `close()`.

    Nothing touches the disk until `close()` (or a clean exit from the `with`
    block); an exception inside the block discards everything.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = os.fspath(path)
        self._sections: list[_Pending] = []
        self._closed = False

    def __enter__(self) -> OmWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self._closed = True
            self._sections.clear()
            return
        self.close()

    def add_section(self, name: str, data: bytes | bytearray | memoryview, align: int = SECTION_ALIGN_DEFAULT) -> None:
        """Register a section whose payload is already in memory (copied now)."""
        self._register(_Pending(name, 0, align, bytes(data), None))

    def add_streamed_section(
        self, name: str, chunks: Iterable[Chunk], size: int, align: int = SECTION_ALIGN_DEFAULT
    ) -> None:
        """Register a section of exactly `size` bytes, pulled from `chunks` while writing.

        The iterable is consumed during `close()`, one chunk at a time, so the
        payload never has to exist as one bytes object.
        """
        if size < 0:
            raise InternalError(f"section '{name}': negative size {size}")
        self._register(_Pending(name, size, align, None, chunks))

    def _register(self, sec: _Pending) -> None:
        if self._closed:
            raise InternalError("OmWriter is closed")
        if not isinstance(sec.name, str) or not _NAME_RE.fullmatch(sec.name):
            raise InternalError(f"invalid section name {sec.name!r}: use 1-16 of [A-Za-z0-9_.-]")
        if any(s.name == sec.name for s in self._sections):
            raise InternalError(f"section '{sec.name}' added twice")
        a = sec.align
        if a < SECTION_ALIGN_DEFAULT or a & (a - 1):
            raise InternalError(f"section '{sec.name}': alignment {a} is not a power of two >= {SECTION_ALIGN_DEFAULT}")
        if a < _required_align(sec.name):
            raise InternalError(f"section '{sec.name}' needs alignment {_required_align(sec.name)}, got {a}")
        if sec.data is not None:
            sec = _Pending(sec.name, len(sec.data), a, sec.data, None)
        self._sections.append(sec)

    def close(self) -> None:
        """Write the file (once). Later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        sections, self._sections = self._sections, []
        self._write(sections)

    @contextlib.contextmanager
    def _io(self) -> Iterator[None]:
        # OS failures of our own file operations (disk full, no permission) are
        # the user's to fix; failures of a caller's chunk source pass through.
        try:
            yield
        except OSError as e:
            raise NpucError(
                E_WRITE,
                f"cannot write '{self._path}': {e.strerror or e}",
                hint="check free disk space and write permission for the output directory",
                exit_code=EXIT_IO,
            ) from e

    def _write(self, sections: list[_Pending]) -> None:
        table_end = HEADER_SIZE + ENTRY_SIZE * len(sections)
        offsets: list[int] = []
        cursor = table_end
        for sec in sections:
            offsets.append(_align_up(cursor, sec.align))
            cursor = offsets[-1] + sec.size

        directory = os.path.dirname(os.path.abspath(self._path))
        prefix = f".{os.path.basename(self._path)}."
        _remove_orphans(directory, prefix)
        with self._io():
            mode = stat.S_IMODE(os.stat(self._path).st_mode) if os.path.isfile(self._path) else 0o644
            tmp = tempfile.NamedTemporaryFile(dir=directory, delete=False, prefix=f"{prefix}{os.getpid()}.",
                                              suffix=".tmp")
        try:
            with tmp as f:
                with self._io():
                    f.write(bytes(table_end))  # placeholder for header and table
                pos = table_end
                entries = []
                for sec, off in zip(sections, offsets, strict=True):
                    with self._io():
                        f.write(bytes(off - pos))
                    digest = self._write_payload(f, sec)
                    pos = off + sec.size
                    entries.append(_ENTRY.pack(sec.name.encode("ascii"), off, sec.size, digest))
                table = b"".join(entries)
                header = _HEADER.pack(
                    MAGIC, FORMAT_VERSION, 0, len(sections), 0, hashlib.sha256(table).digest(), bytes(8)
                )
                with self._io():
                    f.seek(0)
                    f.write(header + table)
                    f.flush()
                    os.fsync(f.fileno())
            with self._io():
                os.chmod(tmp.name, mode)
                os.replace(tmp.name, self._path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp.name)
            raise
        # Make the rename itself durable; not every platform/filesystem allows it.
        with contextlib.suppress(OSError):
            dfd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def _write_payload(self, f: IO[bytes], sec: _Pending) -> bytes:
        h = hashlib.sha256()
        if sec.data is not None:
            h.update(sec.data)
            with self._io():
                f.write(sec.data)
            return h.digest()
        assert sec.chunks is not None
        written = 0
        for chunk in sec.chunks:
            try:
                view = memoryview(chunk).cast("B")
            except (TypeError, ValueError) as e:
                raise InternalError(f"section '{sec.name}': chunk {type(chunk).__name__} is not contiguous bytes") from e
            written += view.nbytes
            if written > sec.size:
                raise InternalError(f"section '{sec.name}' declared {sec.size} bytes but its chunks hold more")
            h.update(view)
            with self._io():
                f.write(view)
        if written != sec.size:
            raise InternalError(f"section '{sec.name}' declared {sec.size} bytes but its chunks hold {written}")
        return h.digest()


# --- reading ---------------------------------------------------------------------


def _corrupt(message: str) -> NpucError:
    return NpucError(E_BOUNDS, f"file is truncated or corrupt: {message}", hint=_HINT_RECOMPILE, exit_code=EXIT_IO)


def _checksum(what: str) -> NpucError:
    return NpucError(E_CHECKSUM, f"{what} fails its checksum: the file is corrupt", hint=_HINT_RECOMPILE, exit_code=EXIT_IO)


class OmFile:
    """A validated, read-only, memory-mapped `.om` file. Use `OmFile.open`."""

    def __init__(self, path: str, mm: mmap.mmap, sections: list[SectionInfo]) -> None:
        self.path = path
        self._mm: mmap.mmap | None = mm
        self._view: memoryview | None = memoryview(mm)
        self._sections = sections
        self._by_name = {s.name: s for s in sections}

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, verify: bool = True) -> OmFile:
        """Map and check `path`; with `verify` also check every payload's SHA-256."""
        p = os.fspath(path)
        try:
            # O_NONBLOCK so that a FIFO fails the regular-file check instead of hanging.
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise _cannot_open(p, e.strerror or str(e)) from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _cannot_open(p, "not a regular file")
            if st.st_size < HEADER_SIZE:
                head = os.pread(fd, HEADER_SIZE, 0) if hasattr(os, "pread") else os.read(fd, HEADER_SIZE)
                _check_magic(p, head)
                raise _corrupt(f"it has {len(head)} bytes, less than the {HEADER_SIZE}-byte header")
            try:
                mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise _cannot_open(p, str(e)) from e
        except OSError as e:
            raise _cannot_open(p, e.strerror or str(e)) from e
        finally:
            os.close(fd)  # the mapping keeps its own reference to the file
        try:
            sections = _parse(p, mm, verify)
        except BaseException:
            mm.close()
            raise
        return cls(p, mm, sections)

    def section_names(self) -> list[str]:
        return [s.name for s in self._sections]

    def section_info(self) -> list[SectionInfo]:
        return list(self._sections)

    def section(self, name: str) -> memoryview:
        """Zero-copy read-only view of a payload; valid while the file is open."""
        if self._view is None:
            raise InternalError(f"OmFile '{self.path}' is closed")
        info = self._by_name.get(name)
        if info is None:
            have = ", ".join(self.section_names()) or "none"
            raise _corrupt(f"it has no section '{name}' (sections: {have})")
        return self._view[info.offset : info.offset + info.size]

    def close(self) -> None:
        """Unmap the file; if section views are still alive, it is unmapped when they go."""
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._mm is not None:
            # mmap refuses to close under live exports; dropping our reference
            # lets the last outstanding section view unmap it instead.
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None

    def __enter__(self) -> OmFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _cannot_open(path: str, why: str) -> NpucError:
    return NpucError(E_OPEN, f"cannot open '{path}': {why}", hint="check the path and its permissions", exit_code=EXIT_IO)


def _check_magic(path: str, head: bytes) -> None:
    # A short prefix of the magic is a truncated .om file, not a foreign one.
    if head[: len(MAGIC)] != MAGIC[: len(head)]:
        raise NpucError(
            E_MAGIC,
            f"'{path}' is not an npuc .om file (bad magic bytes)",
            hint="pass a model compiled with `npuc compile`",
            exit_code=EXIT_IO,
        )


def _parse(path: str, mm: mmap.mmap, verify: bool) -> list[SectionInfo]:
    """Check the whole structure of a mapped file; returns its sections in table order."""
    size = len(mm)
    magic, version, flags, count, reserved, table_sha, pad = _HEADER.unpack_from(mm, 0)
    _check_magic(path, magic)
    if version != FORMAT_VERSION:
        raise NpucError(
            E_VERSION,
            f"'{path}' has .om format version {version}; this npuc reads version {FORMAT_VERSION}",
            hint="recompile the model with `npuc compile` from this npuc release",
            exit_code=EXIT_IO,
        )
    if flags != 0:
        raise NpucError(
            E_VERSION,
            f"'{path}' uses .om format flags {flags:#x}, which this npuc does not support",
            hint="recompile the model with `npuc compile` from this npuc release",
            exit_code=EXIT_IO,
        )
    if reserved != 0 or pad != bytes(len(pad)):
        raise _corrupt("reserved header fields are not zero")

    table_end = HEADER_SIZE + ENTRY_SIZE * count
    if table_end > size:
        raise _corrupt(f"the section table spans bytes {HEADER_SIZE}..{table_end} but the file has {size} bytes")
    if hashlib.sha256(mm[HEADER_SIZE:table_end]).digest() != table_sha:
        raise _checksum("the section table")

    sections: list[SectionInfo] = []
    digests: list[bytes] = []
    seen: set[str] = set()
    prev_end = table_end
    for i in range(count):
        raw_name, offset, length, digest = _ENTRY.unpack_from(mm, HEADER_SIZE + ENTRY_SIZE * i)
        name_bytes = raw_name.rstrip(b"\0")
        name = name_bytes.decode("ascii", "replace")
        if not _NAME_RE.fullmatch(name):
            raise _corrupt(f"section {i} has an invalid name {name_bytes!r}")
        if name in seen:
            raise _corrupt(f"section '{name}' appears twice")
        seen.add(name)
        end = offset + length
        if end > size:
            raise _corrupt(f"section '{name}' spans bytes {offset}..{end} but the file has {size} bytes")
        if offset < prev_end:
            raise _corrupt(f"section '{name}' starts at byte {offset}, before the end of the previous data at {prev_end}")
        align = _required_align(name)
        if offset % align:
            raise _corrupt(f"section '{name}' starts at byte {offset}, not a multiple of {align}")
        # Padding is not covered by any hash; insist it is zero so no byte of
        # the file goes unchecked. At most one alignment's worth per section.
        if mm[prev_end:offset].count(0) != offset - prev_end:
            raise _checksum(f"the padding before section '{name}'")
        sections.append(SectionInfo(name, offset, length, align, digest.hex()))
        digests.append(digest)
        prev_end = end
    if prev_end != size:
        raise _corrupt(f"{size - prev_end} unexpected bytes after the last section")

    if verify:
        # Hash with plain reads, not through the mapping: touching mapped pages would make
        # every weight resident in this process before the first run.
        try:
            with open(path, "rb") as f:
                for info, digest in zip(sections, digests, strict=True):
                    h = hashlib.sha256()
                    f.seek(info.offset)
                    left = info.size
                    while left:
                        chunk = f.read(min(left, 8 << 20))
                        if not chunk:
                            raise _corrupt(f"section '{info.name}' ends early")
                        h.update(chunk)
                        left -= len(chunk)
                    if h.digest() != digest:
                        raise _checksum(f"section '{info.name}'")
        except OSError as e:
            raise _cannot_open(path, e.strerror or str(e)) from e
    return sections
