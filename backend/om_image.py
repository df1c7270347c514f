"""The weights section's opening bytes, copied from the source while the compile still runs.

A `.om` whose weights section begins with a byte-for-byte image of one of the input's files
(the ONNX external data file of a model whose weights the compile keeps as they are:
backend/lower.py pins each such weight at its offset in that file) has bytes that are
known before the model is even imported. `WeightImage` copies them into the output's
temporary file at once, on a thread of its own (backend/om_copy.py's `RangeCopy`: the
kernel copies, a second thread hashes each block from the output's page cache), while the
main thread imports, optimises and plans. The writer (`OmWriter`, given the image with the
weights section) then adopts that file, writes the rest of the weights and the header
sections around the image and renames it into place.

The image only saves time; it never changes a byte of the output: the weights section of
such a model begins at WEIGHTS_ALIGN (it comes first in the file) with that file's bytes
whether or not the copy ran ahead, and a writer given no image, or an image whose copy
failed, writes the same bytes itself. Docs: docs/om-format.md ("Writing").
"""

from __future__ import annotations

import contextlib
import os
import threading

from npuc.backend.om_copy import FileRange, FileSequenceHash, RangeCopy
from npuc.backend.om_format import IMAGE_OFFSET, ChunkDigests, open_temp
from npuc.errors import InternalError

__all__ = ["IMAGE_OFFSET", "WeightImage"]

_PIECE = 64 << 20  # bytes copied between looks at the cancel flag


class WeightImage:
    """Copies `source` (one whole file, as a FileRange from offset 0) to IMAGE_OFFSET of a
    new temporary file beside `out_path`, on a thread started at once. `hashed_files` (the
    input model's files with their prefixes, compiler/weight_image.py) starts the input
    model's hash, handed every block of the copy; the writer takes that hash only if the
    compile's own list of files is the same.

    `take()` (the writer) waits for the copy and hands over the file, the weights' chunk
    digests so far and the hash; `discard()` stops the copy and deletes the file. One of
    the two must be called; both may be, in either order."""

    def __init__(self, source: FileRange, out_path: str, hashed_files: list[tuple[str, bytes]]) -> None:
        if source.offset != 0:
            raise InternalError("a weight image is a whole file, from its offset 0")
        self.source = source
        self.out_path = os.path.abspath(out_path)
        self.hashed_files = hashed_files
        self.digests = ChunkDigests()
        self._pieces = [FileRange(source.path, off, min(_PIECE, source.length - off), source.what)
                        for off in range(0, source.length, _PIECE)]
        self.model_hash: FileSequenceHash | None = FileSequenceHash(hashed_files, self._pieces)
        self._cancel = threading.Event()
        self._error: BaseException | None = None
        self._fd, self._tmp = open_temp(self.out_path)
        self._taken = False
        self._thread = threading.Thread(target=self._run, name="npuc-weights-image", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            assert self.model_hash is not None
            self.model_hash.start()
            copy = RangeCopy(self._fd, self.digests, self.model_hash)
            try:
                for piece in self._pieces:
                    if self._cancel.is_set():
                        return
                    copy.copy(piece, IMAGE_OFFSET + piece.offset)
            finally:
                copy.close()
            self.model_hash.done()
        except BaseException as e:  # raised again by take()
            self._error = e

    def take(self) -> tuple[int, str, ChunkDigests, FileSequenceHash | None]:
        """Wait for the copy: the temporary file's descriptor (the writer closes it) and
        path, the chunk digests of the image's bytes (to be fed the rest of the section) and
        the input model's hash. Raises the copy's error (the file is deleted then)."""
        if self._taken or self._fd < 0:
            raise InternalError("the weight image was already taken or discarded")
        self._thread.join()
        if self._error is not None or self._cancel.is_set():
            error = self._error
            self.discard()
            if error is not None:
                raise error
            raise InternalError("the weight image was cancelled")
        self._taken = True
        fd, self._fd = self._fd, -1
        hashed, self.model_hash = self.model_hash, None
        return fd, self._tmp, self.digests, hashed

    def discard(self) -> None:
        """Stop the copy, delete the temporary file (unless the writer took it)."""
        self._cancel.set()
        if self._thread.ident is not None:
            self._thread.join()
        if self.model_hash is not None:
            self.model_hash.cancel()
            self.model_hash = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            if not self._taken:
                with contextlib.suppress(OSError):
                    os.unlink(self._tmp)
