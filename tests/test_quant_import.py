"""Importing models that are already quantized (GPTQ, AWQ, MatMulNBits, DequantizeLinear):
(a) npuc unpacks exactly the integers and scales that tests/quant_formats.py packed from
each format's spec, (b) the compiled model matches a dequantize-then-fp32 reference (HF
eager, or onnxruntime), (c) its products are `qlinear`s, (d) what npuc cannot read is
refused with a coded error."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper, numpy_helper
from quant_formats import (
    pack_awq,
    pack_gptq,
    pack_matmul_nbits,
    pack_matmul_nbits_zeros,
    quantized_llama,
    random_layer,
)

from npuc.compiler.driver import build_graph, compile_model
from npuc.compiler.quant_import import (
    awq_repack,
    awq_unpack,
    gptq_repack,
    gptq_sorted_order,
    unpack_int32,
)
from npuc.errors import NpucError
from npuc.ir.quant import dequantize_ref, unpack
from npuc.runtime import Session

ATOL = 1e-4


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hf_models import save_checkpoint

    path = tmp_path_factory.mktemp("float") / "llama"
    save_checkpoint("llama", str(path))
    return path


def _compile(model: Path | str, shape: str, out: Path, **kw: Any) -> tuple[Session, dict[str, int]]:
    report = out.with_suffix(".json")
    om = compile_model(str(model), input_shape=shape, output=str(out), soc_version="cpu", fusion_report=str(report),
                       **{"precision_mode": "force_fp32", **kw})
    return Session.load(om), json.loads(report.read_text())["op_counts"]


# -- (a) the conversions give back what was packed ------------------------------------------

def test_int32_words_unpack_least_significant_first() -> None:
    word = torch.tensor([[0x76543210, 0x0000_00FE]], dtype=torch.int64).to(torch.int32)
    assert unpack_int32(word, 4, 1).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 14, 15, 0, 0, 0, 0, 0, 0]]
    neg = torch.tensor([[-1]], dtype=torch.int32)  # the sign bit is a code bit like any other
    assert unpack_int32(neg, 8, 0).reshape(-1).tolist() == [255, 255, 255, 255]


@pytest.mark.parametrize("bits, version, group", [(4, 1, 32), (4, 2, 64), (8, 1, 32), (8, 2, 128)])
def test_gptq_repack_gives_back_the_packed_integers(bits: int, version: int, group: int) -> None:
    rng = np.random.default_rng(bits + version)
    k, n = 128, 96
    top = (1 << bits) - 1
    layer = random_layer(rng, k, n, bits, group, (1, top) if version == 1 else (0, top))
    qweight, qzeros = pack_gptq(layer.codes, layer.zeros, bits, version)
    assert qweight.shape == (k * bits // 32, n) and qzeros.shape == (k // group, n * bits // 32)
    q, scale, zero = gptq_repack(torch.from_numpy(qweight), torch.from_numpy(qzeros),
                                 torch.from_numpy(layer.scales), bits, version)
    offset = 0 if bits == 4 else -128  # npuc's 8-bit codes are signed
    assert unpack(q, bits).tolist() == (layer.codes.T + offset).tolist()
    assert zero.to(torch.int64).tolist() == (layer.zeros.T + offset).tolist()
    assert scale.dtype == torch.float16 and torch.equal(scale, torch.from_numpy(layer.scales.T.copy()))
    assert torch.equal(dequantize_ref(q, scale, zero, bits, group), layer.weight())


def test_gptq_v1_stored_zero_of_15_means_16() -> None:
    codes = np.full((32, 8), 3)
    zeros = np.full((1, 8), 16)  # stored as 15: v1's zero - 1
    qweight, qzeros = pack_gptq(codes, zeros, 4, 1)
    q, scale, zero = gptq_repack(torch.from_numpy(qweight), torch.from_numpy(qzeros), torch.ones(1, 8), 4, 1)
    assert zero.tolist() == [[16]] * 8
    assert dequantize_ref(q, scale, zero, 4, 32).unique().tolist() == [-13.0]
    q8, q8z = pack_gptq(np.zeros((32, 4), dtype=np.int64), np.full((1, 4), 256), 8, 1)  # stored 255
    with pytest.raises(NpucError, match="NPUC-E0314.*zero point"):
        gptq_repack(torch.from_numpy(q8), torch.from_numpy(q8z), torch.ones(1, 4), 8, 1)


def test_gptq_act_order_sorts_k_by_group() -> None:
    rng = np.random.default_rng(7)
    k, n, group = 128, 32, 32
    layer = random_layer(rng, k, n, 4, group, (0, 15), act_order=True)
    qweight, qzeros = pack_gptq(layer.codes, layer.zeros, 4, 2)
    perm = gptq_sorted_order(torch.from_numpy(layer.g_idx), group)
    assert perm is not None and (layer.g_idx[perm.numpy()] == np.arange(k) // group).all()
    q, scale, zero = gptq_repack(torch.from_numpy(qweight), torch.from_numpy(qzeros),
                                 torch.from_numpy(layer.scales), 4, 2, perm)
    assert unpack(q, 4).tolist() == layer.codes[perm.numpy()].T.tolist()
    w_sorted = dequantize_ref(q, scale, zero, 4, group)
    assert torch.equal(w_sorted, layer.weight()[:, perm])  # x @ W^T == x[:, perm] @ W_sorted^T
    assert gptq_sorted_order(torch.arange(k) // group, group) is None
    with pytest.raises(NpucError, match="NPUC-E0314"):
        gptq_sorted_order(torch.zeros(k, dtype=torch.int32), group)  # one group of 128 rows


def test_awq_repack_gives_back_the_packed_integers() -> None:
    rng = np.random.default_rng(3)
    k, n, group = 128, 64, 32
    layer = random_layer(rng, k, n, 4, group, (0, 15))
    qweight, qzeros = pack_awq(layer.codes), pack_awq(layer.zeros)
    assert qweight.shape == (k, n // 8) and qzeros.shape == (k // group, n // 8)
    assert awq_unpack(torch.from_numpy(qweight)).tolist() == layer.codes.tolist()
    q, scale, zero = awq_repack(torch.from_numpy(qweight), torch.from_numpy(qzeros), torch.from_numpy(layer.scales))
    assert unpack(q, 4).tolist() == layer.codes.T.tolist() and zero.tolist() == layer.zeros.T.tolist()
    assert torch.equal(dequantize_ref(q, scale, zero, 4, group), layer.weight())
    # The interleave matters: column 1 sits in nibble 4, not nibble 1.
    one = np.zeros((1, 8), dtype=np.int64)
    one[0, 1] = 5
    assert int(pack_awq(one)[0, 0]) == 5 << 16


def _graph_constants(path: Path, shape: str) -> dict[str, torch.Tensor]:
    g, _ = build_graph(str(path), shape)
    return {name: v.const.load() for name, v in g.constants.items() if v.const is not None}


def test_matmul_nbits_reads_back_the_codes(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for bits, k, block, with_zeros in [(4, 80, 32, True), (8, 64, 16, True), (4, 64, 32, False)]:
        n = 32
        blocks = -(-k // block)
        codes, zeros = rng.integers(0, 1 << bits, (n, k)), rng.integers(0, 1 << bits, (n, blocks))
        scales = (rng.random((n, blocks)) * 0.01 + 0.001).astype(np.float32)
        path = tmp_path / f"mnb{bits}.onnx"
        onnx.save(_matmul_nbits_model(codes, scales, zeros if with_zeros else None, bits, block), str(path))
        c = _graph_constants(path, f"A:1,3,{k}")
        offset = 0 if bits == 4 else -128
        got = unpack(c["B.q"], bits)
        assert got.shape == (n, blocks * block) and got[:, :k].tolist() == (codes + offset).tolist()
        want_zero = zeros if with_zeros else np.full((n, blocks), 1 << (bits - 1))
        assert c["B.zero"].to(torch.int64).tolist() == (want_zero + offset).tolist()
        assert torch.equal(c["B.scale"], torch.from_numpy(scales))


def test_int4_dequantize_linear_reads_back_the_codes(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    k, n, block = 64, 32, 16
    for etype, lo, hi in [(TP.INT4, -8, 7), (TP.UINT4, 0, 15)]:
        codes, zeros = rng.integers(lo, hi + 1, (k, n)), rng.integers(lo, hi + 1, (k // block, n))
        scales = (rng.random((k // block, n)) * 0.01 + 0.001).astype(np.float32)
        path = tmp_path / f"dq{etype}.onnx"
        onnx.save(_dql_model(codes, scales, zeros, etype, 0, block), str(path))
        c = _graph_constants(path, f"A:1,3,{k}")
        offset = 8 if etype == TP.INT4 else 0  # npuc's 4-bit codes are 0..15
        assert unpack(c["W.q"], 4).tolist() == (codes.T + offset).tolist()
        assert c["W.zero"].to(torch.int64).tolist() == (zeros.T + offset).tolist()
        assert torch.equal(c["W.scale"], torch.from_numpy(scales.T.copy()))


# -- (b, c) compiled models match their dequantized reference, over qlinear ---------------

HF_CASES = [  # method, bits, group, version, act_order
    ("gptq", 4, 32, 1, False),
    ("gptq", 4, -1, 2, False),
    ("gptq", 8, 32, 2, False),
    ("gptq", 4, 32, 2, True),
    ("awq", 4, 32, 2, False),
]


@pytest.mark.parametrize("method, bits, group, version, act_order", HF_CASES,
                         ids=["gptq-v1-4bit", "gptq-v2-4bit-per-row", "gptq-v2-8bit", "gptq-act-order", "awq"])
def test_hf_quantized_checkpoint_matches_dequantized_model(llama: Path, tmp_path: Path, method: str, bits: int,
                                                           group: int, version: int, act_order: bool) -> None:
    path = tmp_path / method
    ref, layers = quantized_llama(llama, path, method, bits, group, version, act_order)
    sess, ops = _compile(path, "input_ids:1,8", tmp_path / "m")
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids, use_cache=False).logits
    got = sess.run({"input_ids": ids})["logits"]
    assert float((got - want).abs().max()) < ATOL
    assert ops.get("qlinear") == len(layers) and "dequantize" not in ops and ops.get("linear") == 1  # the LM head
    assert ops.get("gather", 0) == 1 + (len(layers) if act_order else 0)  # embedding (+ each input's order)


def test_hf_gptq_with_a_kv_cache_and_bf16_activations(llama: Path, tmp_path: Path) -> None:
    """The default precision (qlinear over bf16 activations) and --max_seq_len: prefill and decode share the codes."""
    from hf_models import prefill_vs_hf

    path = tmp_path / "gptq"
    ref, layers = quantized_llama(llama, path, "gptq", 4, 32, 2)
    om = compile_model(str(path), input_shape="input_ids:1,8", output=str(tmp_path / "m"), soc_version="cpu",
                       max_seq_len=32)
    sess = Session.load(om)
    err = prefill_vs_hf(sess, ref, "prefill")
    assert err < 5e-2, err  # bf16 activations
    codes = [t for t in sess.tensors if t.name.endswith(".q")]
    assert len(codes) == len(layers) and {t.region for t in codes} == {"weights"}  # one copy for both programs
    g, _ = build_graph(str(path), "input_ids:1,8")  # what the programs share weights by: one name per tensor read
    described = [v.const.describe() for v in g.constants.values() if v.name.endswith((".q", ".scale", ".zero"))]
    assert len(described) == 3 * len(layers) == len(set(described))


def _ort(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """onnxruntime's result without its graph optimisations: those run int8 QDQ MatMuls over
    dynamically quantized activations, an approximation of the model's meaning."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _model(nodes: list[Any], inits: list[Any], k: int, n: int, opsets: dict[str, int] | None = None,
           dtype: int = TP.FLOAT) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("A", dtype, [1, 3, k])],
                          [helper.make_tensor_value_info("Y", dtype, [1, 3, n])], initializer=inits)
    ops = {"": 21, **(opsets or {})}
    return helper.make_model(g, opset_imports=[helper.make_opsetid(d, v) for d, v in ops.items()])


def _matmul_nbits_model(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, bits: int, block: int,
                        bias: np.ndarray | None = None, **extra: Any) -> onnx.ModelProto:
    n, k = codes.shape
    inits = [numpy_helper.from_array(pack_matmul_nbits(codes, block, bits), "B"),
             numpy_helper.from_array(scales.reshape(-1), "scales")]
    ins = ["A", "B", "scales", "", "", ""]
    if zeros is not None:
        inits.append(numpy_helper.from_array(pack_matmul_nbits_zeros(zeros, bits), "zero_points"))
        ins[3] = "zero_points"
    if bias is not None:
        inits.append(numpy_helper.from_array(bias, "bias"))
        ins[5] = "bias"
    while not ins[-1]:
        ins.pop()
    attrs = {"K": k, "N": n, "bits": bits, "block_size": block, **extra}
    node = helper.make_node("MatMulNBits", ins, ["Y"], domain="com.microsoft", **attrs)
    return _model([node], inits, k, n, {"com.microsoft": 1})


def _int_tensor(name: str, values: np.ndarray, etype: int) -> Any:
    if etype in (TP.INT4, TP.UINT4):  # onnx packs these two per byte, low nibble first
        return helper.make_tensor(name, etype, list(values.shape), values.reshape(-1).tolist())
    return numpy_helper.from_array(values.astype(np.int8 if etype == TP.INT8 else np.uint8), name)


def _dql_model(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, etype: int, axis: int,
               block: int = 0) -> onnx.ModelProto:
    k, n = codes.shape
    inits = [_int_tensor("W", codes, etype), numpy_helper.from_array(scales, "S")]
    ins = ["W", "S"]
    if zeros is not None:
        inits.append(_int_tensor("Z", zeros, etype))
        ins.append("Z")
    attrs = {"axis": axis, **({"block_size": block} if block else {})}
    nodes = [helper.make_node("DequantizeLinear", ins, ["Wd"], **attrs), helper.make_node("MatMul", ["A", "Wd"], ["Y"])]
    m = _model(nodes, inits, k, n)
    onnx.checker.check_model(m)
    return m


def _check_onnx(model: onnx.ModelProto, tmp_path: Path, name: str, k: int, qlinears: int) -> None:
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    x = np.random.default_rng(5).standard_normal((1, 3, k)).astype(np.float32)
    want = _ort(path, {"A": x})
    sess, ops = _compile(path, f"A:1,3,{k}", tmp_path / name)
    got = sess.run({"A": torch.from_numpy(x)})["Y"].numpy()
    assert np.abs(got - want).max() < ATOL, (name, np.abs(got - want).max())
    assert ops.get("qlinear") == qlinears and "matmul" not in ops and "dequantize" not in ops, ops


@pytest.mark.parametrize("bits, k, block, zeros, bias", [
    (4, 64, 32, True, False), (4, 96, 64, False, True), (4, 80, 32, True, True),  # K=80: padded to 96
    (8, 128, 32, True, False), (8, 64, 16, False, True)])
def test_matmul_nbits_matches_onnxruntime(tmp_path: Path, bits: int, k: int, block: int, zeros: bool,
                                          bias: bool) -> None:
    rng = np.random.default_rng(bits * k)
    n = 48
    blocks = -(-k // block)
    codes, zp = rng.integers(0, 1 << bits, (n, k)), rng.integers(0, 1 << bits, (n, blocks))
    scales = (rng.random((n, blocks)) * (0.002 if bits == 8 else 0.02) + 0.001).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    _check_onnx(_matmul_nbits_model(codes, scales, zp if zeros else None, bits, block, b), tmp_path, "mnb", k, 1)


def _float_mlp(k: int = 128, n: int = 64) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((n, 32)) * 0.1).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["A", "W1"], ["H"]), helper.make_node("Relu", ["H"], ["R"]),
             helper.make_node("MatMul", ["R", "W2"], ["Y"])]
    return _model(nodes, [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")], k, 32)


@pytest.mark.parametrize("bits, symmetric, qdq", [(4, False, False), (4, True, False), (8, False, False),
                                                  (4, True, True), (4, False, True)],
                         ids=["nbits4-asym", "nbits4-sym", "nbits8", "qdq-int4", "qdq-uint4"])
def test_onnxruntime_quantizer_output_matches_onnxruntime(tmp_path: Path, bits: int, symmetric: bool,
                                                          qdq: bool) -> None:
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    q = MatMulNBitsQuantizer(copy.deepcopy(_float_mlp()), bits=bits, block_size=32, is_symmetric=symmetric,
                             quant_format=QuantFormat.QDQ if qdq else QuantFormat.QOperator)
    q.process()
    model = q.model.model
    kinds = {(n.domain or "ai.onnx", n.op_type) for n in model.graph.node}
    assert (("ai.onnx", "DequantizeLinear") if qdq else ("com.microsoft", "MatMulNBits")) in kinds
    _check_onnx(model, tmp_path, "ortq", 128, 2)


@pytest.mark.parametrize("etype, axis, block, zeros", [
    (TP.INT4, 0, 32, True), (TP.UINT4, 0, 16, False), (TP.INT8, 1, 0, True), (TP.UINT8, 1, 0, True),
    (TP.INT8, 0, 16, False), (TP.UINT8, 0, 0, None)],
    ids=["int4-block", "uint4-block", "int8-per-channel", "uint8-per-channel", "int8-block", "uint8-per-tensor"])
def test_dequantize_linear_weights_match_onnxruntime(tmp_path: Path, etype: int, axis: int, block: int,
                                                     zeros: bool | None) -> None:
    rng = np.random.default_rng(etype + axis + block)
    k, n = 64, 32
    lo, hi = {TP.INT4: (-8, 7), TP.UINT4: (0, 15), TP.INT8: (-128, 127), TP.UINT8: (0, 255)}[etype]
    codes = rng.integers(lo, hi + 1, (k, n))
    shape: tuple[int, ...] = (k // block, n) if block else (n,)
    if zeros is None:  # per tensor
        shape = ()
    scales = (rng.random(shape) * (0.002 if hi > 15 else 0.02) + 0.001).astype(np.float32)
    zp = rng.integers(lo, hi + 1, shape) if zeros is not False else None
    _check_onnx(_dql_model(codes, scales, zp, etype, axis, block), tmp_path, "dql", k, 1)


def test_dequantize_linear_outside_the_layout_stays_element_wise(tmp_path: Path) -> None:
    """Blocks along N (not K) cannot be npuc's groups: correct, as a dequantize the matmul reads."""
    rng = np.random.default_rng(2)
    codes, scales = rng.integers(-8, 8, (64, 32)), (rng.random((64, 2)) * 0.02).astype(np.float32)
    path = tmp_path / "n_blocks.onnx"
    onnx.save(_dql_model(codes, scales, None, TP.INT4, 1, 16), str(path))
    x = np.random.default_rng(5).standard_normal((1, 3, 64)).astype(np.float32)
    sess, ops = _compile(path, "A:1,3,64", tmp_path / "n_blocks")
    assert np.abs(sess.run({"A": torch.from_numpy(x)})["Y"].numpy() - _ort(path, {"A": x})).max() < ATOL
    assert "qlinear" not in ops


def test_external_data_stays_lazy_and_is_copied_as_stored(tmp_path: Path) -> None:
    """MatMulNBits' 4-bit B is npuc's q byte for byte: copied from the external data file;
    an int4 initializer in external data is read when the .om is written."""
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    for fmt in (QuantFormat.QOperator, QuantFormat.QDQ):
        q = MatMulNBitsQuantizer(copy.deepcopy(_float_mlp()), bits=4, block_size=32, quant_format=fmt)
        q.process()
        path = tmp_path / f"ext{fmt.value}.onnx"
        onnx.save(q.model.model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=path.name + ".data", size_threshold=0)
        g, _ = build_graph(str(path), "A:1,3,128")
        weights = [v for v in g.constants.values() if v.name.endswith(".q")]
        assert len(weights) == 2 and not any(getattr(v.const, "in_memory", True) for v in weights)
        if fmt == QuantFormat.QOperator:
            assert all(v.const.file_range(v.type) is not None for v in weights)  # type: ignore[union-attr]
        _check_onnx(q.model.model, tmp_path, f"ext{fmt.value}", 128, 2)


# -- (d) refusals ----------------------------------------------------------------------------

@pytest.mark.parametrize("edit, code, match", [
    ({"quant_method": "bitsandbytes"}, "NPUC-E0313", "'bitsandbytes'"),
    ({"bits": 3}, "NPUC-E0313", "GPTQ with 3 bits"),
    ({"bits": 2}, "NPUC-E0313", "GPTQ with 2 bits"),
    ({"checkpoint_format": "marlin"}, "NPUC-E0313", "checkpoint_format 'marlin'"),
    ({"group_size": 0}, "NPUC-E0313", "group_size 0"),
    ({"group_size": 64}, "NPUC-E0314", "model.layers.0.self_attn.q_proj.qzeros is i32\\[2, 8\\]"),
])
def test_unsupported_gptq_checkpoints_are_refused(llama: Path, tmp_path: Path, edit: dict[str, Any], code: str,
                                                  match: str) -> None:
    path = tmp_path / "gptq"
    quantized_llama(llama, path, "gptq", 4, 32, 2, config_extra=edit)
    with pytest.raises(NpucError, match=f"{code}: .*{match}"):
        build_graph(str(path), "input_ids:1,8")


@pytest.mark.parametrize("edit, match", [({"version": "gemv"}, "AWQ version 'gemv'"), ({"bits": 8}, "AWQ with 8 bits"),
                                         ({"zero_point": False}, "AWQ without zero points")])
def test_unsupported_awq_checkpoints_are_refused(llama: Path, tmp_path: Path, edit: dict[str, Any],
                                                 match: str) -> None:
    path = tmp_path / "awq"
    quantized_llama(llama, path, "awq", 4, 32, config_extra=edit)
    with pytest.raises(NpucError, match=f"NPUC-E0313: {match}"):
        build_graph(str(path), "input_ids:1,8")


def test_inconsistent_gptq_tensors_are_refused(llama: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = tmp_path / "gptq"
    quantized_llama(llama, path, "gptq", 4, 32, 2, act_order=True)
    state = load_file(str(path / "model.safetensors"))
    key = "model.layers.1.mlp.down_proj"
    state[f"{key}.g_idx"] = torch.zeros_like(state[f"{key}.g_idx"])  # every row in group 0
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(NpucError, match="NPUC-E0314: g_idx does not put 32 rows"):
        build_graph(str(path), "input_ids:1,8")
    qweight = state[f"{key}.qweight"]
    state[f"{key}.qweight"] = qweight[:-1]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(NpucError, match=f"NPUC-E0314: {key}.qweight is i32\\[15, 64\\]; this layer needs i32\\[16, 64\\]"):
        build_graph(str(path), "input_ids:1,8")
    state[f"{key}.qweight"] = qweight
    del state[f"{key}.qzeros"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(NpucError, match=f"NPUC-E0305: {key} has a qweight but no qzeros"):
        build_graph(str(path), "input_ids:1,8")


def test_cli_refuses_in_one_line(llama: Path, tmp_path: Path) -> None:
    path = tmp_path / "gptq3"
    quantized_llama(llama, path, "gptq", 4, 32, 2, config_extra={"bits": 3})
    r = subprocess.run([sys.executable, "-m", "npuc", "compile", str(path), "--input_shape", "input_ids:1,8",
                        "--output", str(tmp_path / "m")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 3 and "NPUC-E0313" in r.stderr and "Traceback" not in r.stderr, r.stderr


def _refused(tmp_path: Path, model: onnx.ModelProto, code: str, match: str, k: int = 64) -> None:
    path = tmp_path / "bad.onnx"
    onnx.save(model, str(path))
    with pytest.raises(NpucError, match=f"{code}: .*{match}"):
        build_graph(str(path), f"A:1,3,{k}")


def test_unsupported_matmul_nbits_variants_are_refused(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n, k, block = 32, 64, 32
    codes, scales = rng.integers(0, 4, (n, k)), np.ones((n, k // block), np.float32)
    m = _matmul_nbits_model(codes, scales, None, 4, block)
    m.graph.node[0].attribute[2].i = 2  # bits=2: a 2-bit B has these shapes too
    m.graph.initializer[0].CopyFrom(numpy_helper.from_array(pack_matmul_nbits(codes, block, 4)[:, :, :8], "B"))
    _refused(tmp_path, m, "NPUC-E0304", "MatMulNBits with bits=2")
    m = _matmul_nbits_model(codes, scales, None, 4, block)
    m.graph.initializer.append(numpy_helper.from_array(np.full(n * 2, 8.0, np.float32), "zf"))
    m.graph.node[0].input.append("zf")
    _refused(tmp_path, m, "NPUC-E0304", "float zero points")
    m = _matmul_nbits_model(codes, scales, None, 4, block)
    m.graph.initializer.append(numpy_helper.from_array(rng.permutation(k).astype(np.int32) // block, "g_idx"))
    m.graph.node[0].input.extend(["", "g_idx"])
    _refused(tmp_path, m, "NPUC-E0304", "act-order g_idx")
    m = _matmul_nbits_model(codes, scales, None, 4, block)
    m.graph.node[0].attribute[1].i = 48  # N=48, B holds 32 rows
    _refused(tmp_path, m, "NPUC-E0314", "B is u8\\[32,2,16\\]")
    m = _matmul_nbits_model(codes, scales, None, 4, block)
    m.graph.node[0].attribute[3].i = 24  # block_size
    _refused(tmp_path, m, "NPUC-E0314", "block_size 24")
    m = _matmul_nbits_model(codes, scales, None, 4, block)
    m.graph.node[0].op_type = "MatMulBnb4"
    _refused(tmp_path, m, "NPUC-E0301", "com.microsoft::MatMulBnb4")


@pytest.mark.parametrize("etype, shape, axis, block, scale_shape", [
    (TP.UINT8, (3, 10), 1, 4, (3, 3)),      # blocks along the last axis, the last one partial
    (TP.INT8, (4, 6), 0, 0, (4,)),          # per axis
    (TP.INT8, (2, 3, 5), 1, 2, (2, 2, 5)),  # rank 3, blocks of 2 over 3
    (TP.UINT8, (5, 4), 1, 0, ()),           # per tensor
])
def test_dequantize_linear_of_activations_is_element_wise(tmp_path: Path, etype: int, shape: tuple[int, ...],
                                                          axis: int, block: int, scale_shape: tuple[int, ...]) -> None:
    """DequantizeLinear of a value computed at run time: (x - zero) * scale, broadcast along the axis."""
    rng = np.random.default_rng(len(shape) + block)
    npt = np.int8 if etype == TP.INT8 else np.uint8
    x = rng.integers(np.iinfo(npt).min, np.iinfo(npt).max + 1, shape).astype(npt)
    scale = (rng.random(scale_shape) + 0.1).astype(np.float32)
    zero = rng.integers(0, 100, scale_shape).astype(npt)
    attrs = {"axis": axis, **({"block_size": block} if block else {})}
    node = helper.make_node("DequantizeLinear", ["X", "S", "Z"], ["Y"], **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", etype, list(shape))],
                          [helper.make_tensor_value_info("Y", TP.FLOAT, list(shape))],
                          initializer=[numpy_helper.from_array(scale, "S"), numpy_helper.from_array(zero, "Z")])
    path = tmp_path / "act.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), str(path))

    def spread(t: np.ndarray) -> np.ndarray:
        if block:
            return np.take(np.repeat(t, block, axis=axis), np.arange(shape[axis]), axis=axis)
        return t.reshape([-1 if i == axis else 1 for i in range(len(shape))]) if t.ndim else t

    want = (x.astype(np.float32) - spread(zero).astype(np.float32)) * spread(scale)
    sess, _ = _compile(path, "X:" + ",".join(map(str, shape)), tmp_path / "act")
    got = sess.run({"X": torch.from_numpy(x)})["Y"].numpy()
    assert np.abs(got - want).max() < ATOL
