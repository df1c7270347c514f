"""Running a tensor-parallel model: one process per rank, on torch.distributed.

    torchrun --nproc-per-node 2 -m npuc generate build/model.om --prompt-ids 1,2,3
    npuc generate build/model.om --tp 2 --prompt-ids 1,2,3      # the same, launched by npuc

Each process opens `build/model.om` (the manifest, backend/manifest.py), maps its own
rank's file and checks that the file was compiled for this rank of this world size.
The collectives in the programs (ir/collectives.py) run on the default process group:
gloo on CPU, NCCL on GPU, set up here from torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). Rank 0 owns the prompts and the output: it sends the
requests to the others (`share`), every rank runs the same steps, and only rank 0
prints. Every rank computes the same logits (the LM head's all_gather gives each the
whole row), so every rank picks the same tokens without another message.

A peer that dies makes the survivors' next collective fail (gloo sees the closed
connection) or time out after NPUC_DIST_TIMEOUT seconds (default 120); either is
NPUC-E0153 and a non-zero exit, never a hang.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from npuc.backend.manifest import Manifest, open_rank, read_manifest
from npuc.backend.om_format import OmFile
from npuc.errors import EXIT_USAGE, NpucError
from npuc.ir.collectives import peer_error

DEFAULT_TIMEOUT_S = 120.0


def timeout_s() -> float:
    try:
        t = float(os.environ.get("NPUC_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
    except ValueError:
        t = DEFAULT_TIMEOUT_S
    return t if t > 0 else DEFAULT_TIMEOUT_S


def current() -> tuple[int, int]:
    """(rank, world size) of this process: torch.distributed's, or (0, 1) outside a group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise NpucError("NPUC-E0150", f"{name}={v[:40]!r} is not a number", "launch with torchrun",
                        exit_code=EXIT_USAGE) from None


def init_from_env(device: str = "cpu") -> bool:
    """Join torchrun's process group when the environment names one (WORLD_SIZE > 1)."""
    import torch.distributed as dist

    world = _env_int("WORLD_SIZE")
    if world is None or world <= 1 or (dist.is_available() and dist.is_initialized()):
        return False
    rank = _env_int("RANK")
    if rank is None or not 0 <= rank < world:
        raise NpucError("NPUC-E0150", f"RANK={os.environ.get('RANK')!r} with WORLD_SIZE={world}",
                        "launch with torchrun, which sets both", exit_code=EXIT_USAGE)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":  # one GPU per rank of this host: torchrun's LOCAL_RANK
        import torch

        torch.cuda.set_device(_env_int("LOCAL_RANK") or 0)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s()))
    except (RuntimeError, ValueError, OSError) as e:
        raise peer_error(e) from None
    return True


def finish() -> None:
    """Leave the group together: a rank tearing its connections down while another is still
    finishing its last collective would fail that one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.barrier()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def open_for_rank(path: str, inspect_rank: int | None = None) -> tuple[OmFile, Manifest | None]:
    """The container to load in this process: `path` itself, or this rank's file of the
    manifest `path`. Refuses a world size or rank the file was not compiled for.
    `inspect_rank` opens that rank's file whatever the process group (tools that list a
    model, never run its collectives)."""
    om = OmFile.open(path)
    manifest = read_manifest(om)
    rank, world = current()
    if manifest is None:
        return om, None
    om.close()
    if inspect_rank is not None:
        if not 0 <= inspect_rank < manifest.world:
            raise NpucError("NPUC-E0150", f"{path} has ranks 0..{manifest.world - 1}, not {inspect_rank}",
                            f"--rank 0..{manifest.world - 1}", exit_code=EXIT_USAGE)
        return open_rank(path, manifest, inspect_rank), manifest
    if world != manifest.world:
        raise NpucError("NPUC-E0150", f"{path} is split over {manifest.world} ranks and this run has {world}",
                        f"run it with `torchrun --nproc-per-node {manifest.world} -m npuc ...` or `npuc generate "
                        f"--tp {manifest.world} ...`", exit_code=EXIT_USAGE)
    return open_rank(path, manifest, rank), manifest


def check_rank(path: str, meta: dict[str, str]) -> None:
    """A model's own rank and world size (its metadata) against this process's."""
    rank, world = current()
    want_world = int(meta.get("parallel.world", "1") or 1)
    want_rank = int(meta.get("parallel.rank", "0") or 0)
    if want_world != world:
        raise NpucError("NPUC-E0150", f"{path} is rank {want_rank} of {want_world} and this run has {world} "
                        f"rank{'s' if world != 1 else ''}", "load the manifest (<output>.om) with "
                        f"`torchrun --nproc-per-node {want_world} -m npuc ...`", exit_code=EXIT_USAGE)
    if want_rank != rank:
        raise NpucError("NPUC-E0150", f"{path} is the file of rank {want_rank}, loaded on rank {rank}",
                        "load the manifest (<output>.om): each rank then opens its own file", exit_code=EXIT_USAGE)


def share(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (the prompts and options it read)."""
    import torch.distributed as dist

    rank, world = current()
    if world == 1:
        return obj
    box = [obj if rank == 0 else None]
    try:
        dist.broadcast_object_list(box, src=0)
    except (RuntimeError, ValueError, OSError) as e:
        raise peer_error(e) from None
    return box[0]


def is_leader() -> bool:
    return current()[0] == 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(world: int, argv: Sequence[str]) -> int:
    """Run `python -m npuc <argv>` as `world` ranks on this host (what torchrun would do):
    rank 0's output is this command's; if a rank fails, the others are stopped and its
    exit code returned."""
    if not 2 <= world <= 1024:
        raise NpucError("NPUC-E0124", f"--tp {world} is not valid", "the number of ranks: 2 or more",
                        exit_code=EXIT_USAGE)
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        if sys.platform.startswith("linux"):  # all ranks on this host: gloo over loopback, whatever the hostname
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        procs.append(subprocess.Popen([sys.executable, "-m", "npuc", *argv], env=env,
                                      stdout=None if rank == 0 else subprocess.DEVNULL))
    code = 0
    try:
        while procs:
            for p in list(procs):
                rc = p.poll()
                if rc is None:
                    continue
                procs.remove(p)
                if rc != 0 and code == 0:
                    code = rc
                    for q in procs:  # one rank failed: the others would wait for it until their timeout
                        with contextlib.suppress(OSError):
                            q.send_signal(signal.SIGTERM)
            time.sleep(0.05)
    except KeyboardInterrupt:
        for q in procs:
            with contextlib.suppress(OSError):
                q.send_signal(signal.SIGTERM)
        raise
    return code
