"""onnxruntime's contrib operators, as its transformer optimizer and GenAI model builder
write them (com.microsoft, and SimplifiedLayerNormalization in the default domain), built by
hand from their documented schemas and compared with onnxruntime running the same file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import npuc

ort = pytest.importorskip("onnxruntime")
MS = "com.microsoft"


def _run_both(tmp_path: Path, nodes: list, inputs: dict[str, np.ndarray], outputs: list[str],
              inits: list | None = None, opset: int = 17) -> tuple[list[np.ndarray], list[np.ndarray], npuc.Session]:
    vis = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))
           for n, a in inputs.items()]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs]
    g = helper.make_graph(nodes, "g", vis, outs, initializer=inits or [])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])
    path = tmp_path / "m.onnx"
    onnx.save(m, str(path))
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(outputs, inputs)
    shape = ";".join(f"{n}:{','.join(map(str, a.shape))}" for n, a in inputs.items())
    sess = npuc.load(npuc.compile(str(path), input_shape=shape, output=str(tmp_path / "m")), executor="torch")
    got = sess.run(inputs)
    return [got[n].numpy() for n in outputs], want, sess


def _w(name: str, shape: tuple[int, ...], seed: int) -> onnx.TensorProto:
    return helper.make_tensor(name, TensorProto.FLOAT, list(shape),
                              np.random.default_rng(seed).standard_normal(shape).astype(np.float32).ravel())


@pytest.mark.parametrize("opset", [14, 17])
def test_skip_simplified_layer_norm_chain_is_rms_norm_with_its_residual(opset: int, tmp_path: Path) -> None:
    """A Llama layer as the optimizer writes it: the first norm plain, the next fused with the
    residual add, whose sum (output 3) is the next residual. At opset 14 (the optimizer keeps
    the export's) the model is upgraded with SimplifiedLayerNormalization, which ONNX has no
    schema for, in the default domain."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 5, 16)).astype(np.float32)
    nodes = [helper.make_node("SimplifiedLayerNormalization", ["x", "g1"], ["n1"], axis=-1, epsilon=1e-6),
             helper.make_node("MatMul", ["n1", "w"], ["h"]),
             helper.make_node("SkipSimplifiedLayerNormalization", ["h", "x", "g2"], ["n2", "", "", "sum"],
                              domain=MS, epsilon=1e-6),
             helper.make_node("Add", ["n2", "sum"], ["y"])]
    got, want, sess = _run_both(tmp_path, nodes, {"x": x}, ["y"], [_w("g1", (16,), 1), _w("g2", (16,), 2),
                                                                   _w("w", (16, 16), 3)], opset)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    ops = [st.opdef.name for st in sess.programs[next(iter(sess.programs))].steps]
    assert ops.count("rms_norm") == 2


@pytest.mark.parametrize("beta_bias", [(False, False), (True, True)])
def test_skip_layer_norm_with_beta_and_bias(beta_bias: tuple[bool, bool], tmp_path: Path) -> None:
    beta, bias = beta_bias
    rng = np.random.default_rng(1)
    x, s = (rng.standard_normal((2, 3, 8)).astype(np.float32) for _ in range(2))
    names = ["x", "s", "g"] + (["b"] if beta else [""]) + (["c"] if bias else [])
    inits = [_w("g", (8,), 4)] + ([_w("b", (8,), 5)] if beta else []) + ([_w("c", (8,), 6)] if bias else [])
    nodes = [helper.make_node("SkipLayerNormalization", names, ["y", "", "", "sum"], domain=MS, epsilon=1e-5),
             helper.make_node("Mul", ["y", "sum"], ["z"])]
    got, want, _ = _run_both(tmp_path, nodes, {"x": x, "s": s}, ["z"], inits)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["FastGelu", "BiasGelu"])
def test_bias_gelus(op: str, tmp_path: Path) -> None:
    x = np.linspace(-4, 4, 24, dtype=np.float32).reshape(2, 12)
    nodes = [helper.make_node(op, ["x", "b"], ["y"], domain=MS)]
    got, want, _ = _run_both(tmp_path, nodes, {"x": x}, ["y"], [_w("b", (12,), 7)])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("layout", ["3d", "4d"])
def test_ms_rotary_embedding(layout: str, interleaved: int, tmp_path: Path) -> None:
    b, s, h, d, max_pos = 1, 6, 2, 8, 16
    rng = np.random.default_rng(2)
    x = rng.standard_normal((b, s, h * d) if layout == "3d" else (b, h, s, d)).astype(np.float32)
    f = np.outer(np.arange(max_pos), 1.0 / 10000 ** (np.arange(0, d, 2) / d))
    pos = np.array([[2, 3, 4, 5, 6, 7]], dtype=np.int64)
    inits = [helper.make_tensor("cos", TensorProto.FLOAT, [max_pos, d // 2], np.cos(f).astype(np.float32).ravel()),
             helper.make_tensor("sin", TensorProto.FLOAT, [max_pos, d // 2], np.sin(f).astype(np.float32).ravel())]
    attrs = {"interleaved": interleaved, **({"num_heads": h} if layout == "3d" else {})}
    nodes = [helper.make_node("RotaryEmbedding", ["x", "pos", "cos", "sin"], ["y"], domain=MS, **attrs)]
    got, want, _ = _run_both(tmp_path, nodes, {"x": x, "pos": pos}, ["y"], inits)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["plain", "rotary", "padded", "softcap"])
def test_group_query_attention_over_a_prompt(variant: str, tmp_path: Path) -> None:
    """GroupQueryAttention as the GenAI builder writes it for a prompt: 4 query heads over 2 KV
    heads, causal, keys stopping at each sequence's seqlens_k (a right-padded batch of two:
    the rows of real tokens are compared); RoPE inside with do_rotary; soft-capped scores."""
    b, s, hq, hkv, d, max_pos = 2, 6, 4, 2, 16, 16  # onnxruntime wants head_size % 16 == 0
    rng = np.random.default_rng(3)
    feeds = {"q": rng.standard_normal((b, s, hq * d)).astype(np.float32),
             "k": rng.standard_normal((b, s, hkv * d)).astype(np.float32),
             "v": rng.standard_normal((b, s, hkv * d)).astype(np.float32)}
    lens = np.array([s - 1, 3] if variant == "padded" else [s - 1] * b, dtype=np.int32)
    inits = [helper.make_tensor("total", TensorProto.INT32, [], [s])]
    names = ["q", "k", "v", "", "", "seqlens", "total"]
    if variant == "padded":
        feeds["seqlens"] = lens  # run-time data: the mask is computed in the graph
    else:
        inits.append(helper.make_tensor("seqlens", TensorProto.INT32, [b], lens))
    attrs: dict = {"num_heads": hq, "kv_num_heads": hkv}
    if variant == "rotary":
        f = np.outer(np.arange(max_pos), 1.0 / 10000 ** (np.arange(0, d, 2) / d))
        inits += [helper.make_tensor("cos", TensorProto.FLOAT, [max_pos, d // 2], np.cos(f).astype(np.float32).ravel()),
                  helper.make_tensor("sin", TensorProto.FLOAT, [max_pos, d // 2], np.sin(f).astype(np.float32).ravel())]
        names += ["cos", "sin"]
        attrs["do_rotary"] = 1
    if variant == "softcap":
        attrs["softcap"] = 2.0
    nodes = [helper.make_node("GroupQueryAttention", names, ["y", "pk", "pv"], domain=MS, **attrs),
             helper.make_node("Identity", ["y"], ["out"])]
    got, want, _ = _run_both(tmp_path, nodes, feeds, ["out"], inits)
    for i in range(b):
        rows = int(lens[i]) + 1
        np.testing.assert_allclose(got[0][i, :rows], want[0][i, :rows], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", ["causal", "bias"])
def test_multi_head_attention(variant: str, tmp_path: Path) -> None:
    """MultiHeadAttention as onnxruntime's optimizer writes it: causal (unidirectional) self-
    attention, or with the packed q/k/v bias and an additive attention_bias."""
    b, s, h, d = 2, 5, 2, 8
    rng = np.random.default_rng(4)
    feeds = {n: rng.standard_normal((b, s, h * d)).astype(np.float32) for n in ("q", "k", "v")}
    names, inits, attrs = ["q", "k", "v"], [], {"num_heads": h}
    if variant == "causal":
        attrs["unidirectional"] = 1
    else:
        names += ["bias", "", "ab"]
        inits = [_w("bias", (3 * h * d,), 8), _w("ab", (1, h, s, s), 9)]
    nodes = [helper.make_node("MultiHeadAttention", names, ["y"], domain=MS, **attrs)]
    got, want, _ = _run_both(tmp_path, nodes, feeds, ["y"], inits)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
