"""The manifest of a tensor-parallel model: `<output>.om` naming one `.om` per rank.

    build/model.om          an .om container with one section, `manifest` (JSON):
                            {"format": "npuc-ranks", "world": N, "tp": N, "ep": 1|N,
                             "ranks": [{"file": "model.rank0.om", "fingerprint": "<sha256>",
                                        "weights_bytes": ...}, ...]}
    build/model.rank0.om    a complete .om of rank 0's programs and weights only
    build/model.rank1.om    ...

Each rank maps its own file and reads nothing of the others'. A rank file's
fingerprint is the SHA-256 of its section table (each section's name and digest: a
header section's SHA-256, the weights' XXH3-128 of their chunk digests; the container
checks them on every load), so a file from another compile, or
another rank's, is refused without reading its weights. Rank files are plain names
beside the manifest: a manifest naming anything else (a path, `..`) is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass

from npuc.backend.om_format import OmFile, OmWriter
from npuc.errors import EXIT_IO, NpucError

MANIFEST = "manifest"
FORMAT = "npuc-ranks"
MAX_WORLD = 4096
_FILE_RE = re.compile(r"^[A-Za-z0-9_.+-]{1,200}\.rank[0-9]{1,4}\.om$")


@dataclass(frozen=True)
class RankFile:
    file: str
    fingerprint: str
    weights_bytes: int


@dataclass(frozen=True)
class Manifest:
    world: int
    tp: int
    ep: int
    ranks: tuple[RankFile, ...]

    def rank_path(self, manifest_path: str, rank: int) -> str:
        return os.path.join(os.path.dirname(os.path.abspath(manifest_path)), self.ranks[rank].file)

    def to_json(self) -> bytes:
        return json.dumps({"format": FORMAT, "world": self.world, "tp": self.tp, "ep": self.ep,
                           "ranks": [{"file": r.file, "fingerprint": r.fingerprint, "weights_bytes": r.weights_bytes}
                                     for r in self.ranks]}, indent=1, sort_keys=True).encode()


def rank_file_name(manifest_path: str, rank: int) -> str:
    """model.om -> model.rank<r>.om, beside it."""
    return os.path.join(os.path.dirname(manifest_path),
                        os.path.basename(manifest_path).removesuffix(".om") + f".rank{rank}.om")


def fingerprint(om: OmFile) -> str:
    h = hashlib.sha256()
    for s in om.section_info():
        h.update(f"{s.name}:{s.digest}\n".encode())
    return h.hexdigest()


def write_manifest(path: str, manifest: Manifest) -> None:
    with OmWriter(path) as w:
        w.add_section(MANIFEST, manifest.to_json())


def read_manifest(om: OmFile) -> Manifest | None:
    """The manifest `om` holds, or None when it is a model (a single-device or rank file)."""
    if MANIFEST not in om.section_names():
        return None

    def bad(why: str) -> NpucError:
        return NpucError("NPUC-E0405", f"{om.path}: its rank manifest {why}",
                         "the file is damaged or was edited after compiling; recompile with `npuc compile --tp`",
                         exit_code=EXIT_IO)

    try:
        d = json.loads(bytes(om.section(MANIFEST)))
    except (ValueError, UnicodeDecodeError):
        raise bad("is not JSON") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise bad("is not an npuc rank manifest")
    world, tp, ep, ranks = d.get("world"), d.get("tp"), d.get("ep"), d.get("ranks")
    if not (isinstance(world, int) and isinstance(tp, int) and isinstance(ep, int)) \
            or any(isinstance(x, bool) for x in (world, tp, ep)) \
            or not 2 <= world <= MAX_WORLD or tp != world or ep not in (1, world):
        raise bad(f"has world={world!r}, tp={tp!r}, ep={ep!r}")
    if not isinstance(ranks, list) or len(ranks) != world:
        raise bad(f"names {len(ranks) if isinstance(ranks, list) else 'no'} rank files for {world} ranks")
    out = []
    for r in ranks:
        if not isinstance(r, dict) or not isinstance(r.get("file"), str) or not _FILE_RE.match(r["file"]) \
                or not isinstance(r.get("fingerprint"), str) or not re.fullmatch(r"[0-9a-f]{64}", r["fingerprint"]) \
                or not isinstance(r.get("weights_bytes"), int) or r["weights_bytes"] < 0:
            raise bad(f"has a bad rank entry {str(r)[:120]!r} (a plain file name beside it, a SHA-256, a size)")
        out.append(RankFile(r["file"], r["fingerprint"], r["weights_bytes"]))
    if len({r.file for r in out}) != world:
        raise bad("names one file for two ranks")
    return Manifest(world, tp, ep, tuple(out))


def open_rank(manifest_path: str, manifest: Manifest, rank: int, *, verify: bool = True) -> OmFile:
    """Rank `rank`'s file, checked against the manifest's fingerprint."""
    path = manifest.rank_path(manifest_path, rank)
    om = OmFile.open(path, verify=verify)
    if fingerprint(om) != manifest.ranks[rank].fingerprint:
        om.close()
        raise NpucError("NPUC-E0152", f"{path} is not the rank-{rank} file {manifest_path} was compiled with",
                        "the rank files and the manifest come from different compiles; recompile with "
                        "`npuc compile --tp`", exit_code=EXIT_IO)
    return om
