"""Canonicalize's rules, FileCheck style: a scatter whose indices are a whole-axis top-k
writes every position, so a constant update uniform along that axis is the result
(DeepSeek-V3.2's sparse-attention mask at a length its top-k covers); a softmax of a
max-shift is the softmax; a sigmoid(logsumexp - sink) gate is a sink column (Granite-SWA)."""

from __future__ import annotations

import torch
from test_fusion_passes import check, refuses

from npuc.passes.canonicalize import Canonicalize

SRC = """
    graph main(%x : f32[1,4,{n}]) {{
      const @ones : bool[1,4,{n}]
      const @upd : bool[1,4,{k}]
      %v : f32[1,4,{k}], %i : i64[1,4,{k}] = topk[axis=2, k={k}, largest=true](%x)
      %i32 : i32[1,4,{k}] = cast[dtype=i32](%i)
      %i64 : i64[1,4,{k}] = cast[dtype=i64](%i32)
      %s : bool[1,4,{n}] = scatter_elements[axis=2](@ones, %i64, @upd)
      %y : bool[1,4,{n}] = logical_not(%s)
      return %y
    }}
    """


def test_scatter_over_a_whole_axis_top_k_is_its_update() -> None:
    # -- canonicalize: every position written, each with the same value: the update (the top-k
    #    it no longer reads is dead code's to remove) --
    check(Canonicalize(), SRC.format(n=4, k=4), """
        graph main(%x : f32[1,4,4]) {
          const @ones : bool[1,4,4]
          const @upd : bool[1,4,4]
          %v : f32[1,4,4], %i : i64[1,4,4] = topk[axis=2, k=4, largest=true](%x)
          %i32 : i32[1,4,4] = cast[dtype=i32](%i)
          %i64 : i64[1,4,4] = cast[dtype=i64](%i32)
          %y : bool[1,4,4] = logical_not(@upd)
          return %y
        }
        """, {"ones": torch.ones(1, 4, 4, dtype=torch.bool), "upd": torch.zeros(1, 4, 4, dtype=torch.bool)},
          numerics=True)


def test_refuses_a_top_k_of_fewer_than_the_axis() -> None:
    # a sparse selection: the positions it skips keep the data
    refuses(Canonicalize(), SRC.format(n=4, k=2), "scatter-every-position", "not a plain scatter over every index of the data",
            {"ones": torch.ones(1, 4, 4, dtype=torch.bool), "upd": torch.zeros(1, 4, 2, dtype=torch.bool)})


def test_refuses_updates_that_differ_along_the_axis() -> None:
    upd = torch.zeros(1, 4, 4, dtype=torch.bool)
    upd[..., 1] = True
    refuses(Canonicalize(), SRC.format(n=4, k=4), "scatter-every-position", "the updates differ along the axis",
            {"ones": torch.ones(1, 4, 4, dtype=torch.bool), "upd": upd})


def test_softmax_of_a_max_shift_is_the_softmax() -> None:
    # -- canonicalize: softmax subtracts the maximum itself (MiMo-V2-Flash writes it out) --
    check(Canonicalize(), """
        graph main(%x : f32[2,3,5]) {
          %m : f32[2,3,1] = reduce_max[axes=[2], keepdim=true](%x)
          %d : f32[2,3,5] = sub(%x, %m)
          %y : f32[2,3,5] = softmax[axis=2](%d)
          return %y
        }
        """, """
        graph main(%x : f32[2,3,5]) {
          %y : f32[2,3,5] = softmax[axis=2](%x)
          return %y
        }
        """, numerics=True)


def test_a_max_over_another_axis_is_no_shift() -> None:
    refuses(Canonicalize(), """
        graph main(%x : f32[2,3,5]) {
          %m : f32[2,1,5] = reduce_max[axes=[1], keepdim=true](%x)
          %d : f32[2,3,5] = sub(%x, %m)
          %y : f32[2,3,5] = softmax[axis=2](%d)
          return %y
        }
        """, "softmax-of-max-shift", "the maximum is not over the softmax's axis")


SINK_GATE = """
    graph main(%s : f32[1,2,3,4], %v : f32[1,2,4,8]) {
      const @sink : f32[1,2,1]
      %mx : f32[1,2,3,1] = reduce_max[axes=[3], keepdim=true](%s)
      %sh : f32[1,2,3,4] = sub(%s, %mx)
      %e : f32[1,2,3,4] = exp(%sh)
      %sum : f32[1,2,3,1] = reduce_sum[axes=[3], keepdim=true](%e)
      %lg : f32[1,2,3,1] = log(%sum)
      %lse4 : f32[1,2,3,1] = add(%lg, %mx)
      %lse : f32[1,2,3] = reshape[shape=[1,2,3]](%lse4)
      %d : f32[1,2,3] = sub(%lse, @sink)
      %g : f32[1,2,3] = sigmoid(%d)
      %p : f32[1,2,3,4] = softmax[axis=3](%s)
      %pv : f32[1,2,3,8] = matmul(%p, %v)
      %g4 : f32[1,2,3,1] = reshape[shape=[1,2,3,1]](%g)
      %y : f32[1,2,3,8] = mul(%pv, %g4)
      return %y
    }
    """


def test_a_sink_gate_is_a_sink_column() -> None:
    # -- canonicalize: Granite-SWA scales attention by sigmoid(logsumexp(s) - sink): the same as
    #    gpt-oss' sink logit as one more softmax column, which attention fusion takes as `sinks` --
    check(Canonicalize(), SINK_GATE, """
        graph main(%s : f32[1,2,3,4], %v : f32[1,2,4,8]) {
          const @sink : f32[1,2,1]
          const @sink_column : f32[1,2,3,1]
          %y_concat : f32[1,2,3,5] = concat[axis=3](%s, @sink_column)
          %y_softmax : f32[1,2,3,5] = softmax[axis=3](%y_concat)
          %y_slice : f32[1,2,3,4] = slice[axis=3, end=4, start=0, step=1](%y_softmax)
          %y : f32[1,2,3,8] = matmul(%y_slice, %v)
          return %y
        }
        """, {"sink": torch.tensor([[[0.5], [-1.0]]])}, numerics=True)


def test_refuses_a_sink_gate_that_varies_along_the_queries() -> None:
    src = SINK_GATE.replace("const @sink : f32[1,2,1]", "const @sink : f32[1,1,3]")
    refuses(Canonicalize(), src, "sink-gate-to-sink-column", "the sink logits vary along batch or queries",
            {"sink": torch.tensor([[[0.5, 0.1, -1.0]]])})
