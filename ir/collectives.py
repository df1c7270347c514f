"""Collective ops: how the ranks of a tensor-parallel program combine their parts.

    %y = all_reduce(%x) [world=N]           y = the sum of every rank's x (same shape)
    %y = all_gather(%x) [axis=a, world=N]   y = every rank's x, concatenated along a in rank order

They are ordinary registry ops: a shape rule, a reference kernel (on torch.distributed's
default process group; with world 1 there is no peer and the op is a copy), a cost, and
`wire_bytes` in `extra`: the bytes one rank sends for the op, counted as a ring
algorithm does (all-reduce 2(N-1)/N of the tensor, all-gather (N-1)/N of the result).
The runtime's process group is set up in runtime/parallel.py; a kernel run with a
different world size than its `world` attribute is refused, never run half-matched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from npuc.errors import EXIT_IO, EXIT_USAGE, NpucError
from npuc.ir.ops import ShapeError
from npuc.ir.out_kernels import out_kernel
from npuc.ir.registry import Attr, op
from npuc.ir.types import TensorType

T = Sequence[TensorType]
A = dict[str, Any]

_NO_FLOPS = {"unit": "dma", "flops": lambda i, o, a: 0}


def _group(world: int) -> bool:
    """Whether the op talks to peers: world > 1 needs torch.distributed's group of that size."""
    if world == 1:
        return False
    import torch.distributed as dist

    have = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if have != world:
        raise NpucError("NPUC-E0150", f"this program was compiled for {world} ranks and runs in a group of {have}",
                        f"launch it with `torchrun --nproc-per-node {world} -m npuc ...` or `npuc generate --tp "
                        f"{world}`", exit_code=EXIT_USAGE)
    return True


def peer_error(e: BaseException) -> NpucError:
    """A failed exchange between ranks (a peer died, or did not answer in time) as NPUC-E0153."""
    return NpucError("NPUC-E0153", f"the ranks lost each other: {type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''}"[:300],
                     "a rank died or stopped answering (NPUC_DIST_TIMEOUT seconds); check every rank's log",
                     exit_code=EXIT_IO)


def _peers(fn: Any, *args: Any) -> None:
    """A collective; a peer that died or stopped answering is a coded error, not a hang."""
    try:
        fn(*args)
    except (RuntimeError, ValueError, OSError) as e:
        raise peer_error(e) from None


def _gather_fn(dist: Any) -> Any:
    # all_gather_single is torch 2.13's name for all_gather_into_tensor (deprecated there).
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_reduce_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    out = xs[0].clone()
    if _group(a["world"]):
        import torch.distributed as dist

        _peers(dist.all_reduce, out)
    return out


def wire_bytes_all_reduce(ins: T, outs: T, a: A) -> int:
    n = a["world"]
    return 2 * (n - 1) * ins[0].nbytes // n


@op("all_reduce", ("x",), {"world": Attr("int")}, kernel=_all_reduce_kernel, **_NO_FLOPS,
    doc="the sum of x over the `world` ranks of a tensor-parallel program (every rank gets it); "
        "bytes on the wire per rank 2(N-1)/N of x")
def _all_reduce(ins: T, attrs: A) -> list[TensorType]:
    if attrs["world"] < 1 or not ins[0].dtype.is_float:
        raise ShapeError(f"all_reduce of {ins[0]} over {attrs['world']} ranks")
    return [ins[0]]


def _gathered(x: torch.Tensor, parts: torch.Tensor, axis: int) -> torch.Tensor:
    """[world, *x.shape] -> x's shape with axis `axis` world times longer (rank order)."""
    n = parts.shape[0]
    moved = parts.movedim(0, axis)  # [.., world, x.shape[axis], ..]
    return moved.reshape(*x.shape[:axis], n * x.shape[axis], *x.shape[axis + 1:])


def _all_gather_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x = xs[0].contiguous()
    parts = torch.empty((a["world"], *x.shape), dtype=x.dtype, device=x.device)
    if _group(a["world"]):
        import torch.distributed as dist

        _peers(_gather_fn(dist), parts.view(-1), x.reshape(-1))
    else:
        parts[0].copy_(x)
    return _gathered(x, parts, a["axis"] % x.dim()).clone()


def wire_bytes_all_gather(ins: T, outs: T, a: A) -> int:
    n = a["world"]
    return (n - 1) * outs[0].nbytes // n


@op("all_gather", ("x",), {"axis": Attr("int"), "world": Attr("int")}, kernel=_all_gather_kernel, **_NO_FLOPS,
    doc="every rank's x concatenated along `axis` in rank order (every rank gets it); bytes on the wire "
        "per rank (N-1)/N of the result")
def _all_gather(ins: T, attrs: A) -> list[TensorType]:
    x, n = ins[0], attrs["world"]
    if n < 1 or not x.rank or not -x.rank <= attrs["axis"] < x.rank:
        raise ShapeError(f"all_gather of {x} along axis {attrs['axis']} over {n} ranks")
    axis = attrs["axis"] % x.rank
    shape = list(x.shape)
    shape[axis] *= n
    return [TensorType(tuple(shape), x.dtype)]


def _attach_wire_bytes() -> None:
    import dataclasses

    from npuc.ir.registry import REGISTRY

    for name, fn in (("all_reduce", wire_bytes_all_reduce), ("all_gather", wire_bytes_all_gather)):
        REGISTRY[name] = dataclasses.replace(REGISTRY[name], extra={**REGISTRY[name].extra, "wire_bytes": fn})


_attach_wire_bytes()


def _gather_ws(ins: T, outs: T, a: A) -> int:
    return outs[0].nbytes


@out_kernel("all_reduce")
def _all_reduce_out(xs: list[torch.Tensor], a: A, outs: list[torch.Tensor], ws: torch.Tensor | None) -> bool:
    outs[0].copy_(xs[0])
    if _group(a["world"]):
        import torch.distributed as dist

        _peers(dist.all_reduce, outs[0])  # in place on the arena's slot: nothing allocated here
    return True


@out_kernel("all_gather", workspace=_gather_ws)
def _all_gather_out(xs: list[torch.Tensor], a: A, outs: list[torch.Tensor], ws: torch.Tensor | None) -> bool:
    x, n = xs[0], a["world"]
    if ws is None or not x.is_contiguous():
        return False
    parts = ws[:outs[0].numel() * x.element_size()].view(x.dtype).view(n, *x.shape)
    if _group(n):
        import torch.distributed as dist

        _peers(_gather_fn(dist), parts.view(-1), x.reshape(-1))
    else:
        parts[0].copy_(x)
    outs[0].copy_(_gathered(x, parts, a["axis"] % x.dim()))
    return True
