"""libnpucrt's DeepSeek kernels (npucrt/src/ops_deepseek.c): mla_attention, fused_moe and
qmoe against the registry's reference kernels, at two levels.

- The binders and kernels alone, built with kernels.c and a small stand-in for the
  executor (`_HARNESS` below: attributes, the pool, a scratch poisoned with NaN, the dry
  bind first). Every form: MLA decode over a cache (shared and per-sequence positions,
  i64 and i32), chunks, causal and non-causal prefill in the absorbed and the expanded
  form (the GEMM path and the generic one), bf16; MoE with DeepSeek-V3's and V2's routings,
  ties (the lower expert wins, as torch's stable topk), expert parallel, experts with many
  rows (the GEMM path), bf16, quantized experts; positions outside the cache (NPUC-E0412)
  and the combinations refused (NPUC-E0413) or invalid (NPUC-E0410).
- Whole `.om` files through the C executor (NativeSession) against the torch interpreter
  (Session, use_native=False): one-op graphs and a tiny DeepSeek-V3 (MLA and routed
  experts) compiled with --max_seq_len, prefill and decode logits. Skipped where the
  library is not built.

f32 results agree within 1e-5; bf16 within bf16's rounding.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import npuc
from npuc.ir import DType, Graph, TensorSource, TensorType, get_op
from npuc.ir.quant import quantize_rtn

ROOT = Path(npuc.__file__).parent
SRC = ROOT / "npucrt" / "src"

E_INVALID, E_KERNEL, E_NO_KERNEL = 410, 412, 413

# A stand-in for exec.c: what a binder and its run function see, built from plain arrays.
_HARNESS = r"""
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "exec.h"

struct npuc_session { float *scratch; int threads; };
float *rt_session_scratch(struct npuc_session *s) { return s->scratch; }
int rt_session_threads(const struct npuc_session *s) { return s->threads; }

struct rt_pool_block { struct rt_pool_block *next; };
void *pool_alloc(rt_pool *p, size_t n) {
    struct rt_pool_block *b = calloc(1, 64 + n);
    if (!b) return NULL;
    b->next = p->head; p->head = b; p->bytes += n;
    return (char *)b + 64;
}
void pool_free(rt_pool *p) {
    while (p->head) { struct rt_pool_block *n = p->head->next; free(p->head); p->head = n; }
}
int rt_fail(npuc_error *err, int code, const char *hint, const char *fmt, ...) {
    if (err) {
        va_list ap; va_start(ap, fmt); vsnprintf(err->message, sizeof err->message, fmt, ap); va_end(ap);
        err->code = code; snprintf(err->hint, sizeof err->hint, "%s", hint ? hint : "");
    }
    return code;
}
const rt_attr *rt_find_attr(const rt_op *op, const char *name) {
    for (int i = 0; i < op->n_attrs; i++) if (!strcmp(op->attrs[i].name, name)) return &op->attrs[i];
    return NULL;
}
const char *npuc_dtype_name(int d) {
    static const char *n[] = {"f64", "f32", "f16", "bf16", "i64", "i32", "i16", "i8", "u8", "bool"};
    return d >= 0 && d < 10 ? n[d] : "?";
}
float rt_load_f(const void *p, int dtype, int64_t i) {
    if (dtype == NPUC_F32) return ((const float *)p)[i];
    if (dtype == NPUC_BF16) return npuc_bf16_to_f32(((const uint16_t *)p)[i]);
    if (dtype == NPUC_F64) return (float)((const double *)p)[i];
    return 0.0f;
}
/* kernels.c's f16 KV store needs it; no MLA or MoE op here writes f16, so reaching it is a harness bug. */
uint16_t rt_f32_to_f16(float f) { (void)f; abort(); }
static int dsize(int d) { static const int z[] = {8, 4, 2, 2, 8, 4, 2, 1, 1, 1}; return z[d]; }

static void view(rt_view *v, int dtype, int rank, const int64_t *shape) {
    v->dtype = dtype; v->rank = rank; v->numel = 1;
    for (int d = 0; d < rank; d++) { v->shape[d] = shape[d]; v->numel *= shape[d]; }
    v->nbytes = (uint64_t)v->numel * dsize(dtype);
}

/* attrs "name=i:4;name=f:0.5;name=s:text;name=b:1". The dry bind (no data) first, then the
 * real one, then `reps` runs over a scratch filled with NaN. */
int h_run(const char *opname, int n_in, void **data, const int *dtypes, const int *ranks, const int64_t *shapes,
          void *out, int out_dtype, int out_rank, const int64_t *out_shape, const char *attrs, int threads,
          int reps, char *msg) {
    rt_attr at[32]; char names[32][64], strs[32][64], spec[2048]; int na = 0;
    snprintf(spec, sizeof spec, "%s", attrs);
    for (char *tok = strtok(spec, ";"); tok && na < 32; tok = strtok(NULL, ";")) {
        char *eq = strchr(tok, '=');
        if (!eq) continue;
        *eq = 0;
        snprintf(names[na], 64, "%s", tok);
        memset(&at[na], 0, sizeof at[na]);
        at[na].name = names[na];
        const char *v = eq + 3;
        switch (eq[1]) {
        case 'i': at[na].kind = ATTR_I; at[na].i = atoll(v); break;
        case 'b': at[na].kind = ATTR_B; at[na].i = atoll(v); break;
        case 'f': at[na].kind = ATTR_F; at[na].f = strtod(v, NULL); break;
        default: at[na].kind = ATTR_S; snprintf(strs[na], 64, "%s", v); at[na].s = strs[na];
        }
        na++;
    }
    rt_op op; memset(&op, 0, sizeof op);
    op.op = opname; op.name = "step"; op.attrs = at; op.n_attrs = na;
    rt_step st; memset(&st, 0, sizeof st);
    st.op = &op; st.n_in = n_in; st.n_out = 1;
    for (int i = 0; i < n_in; i++) view(&st.in[i], dtypes[i], ranks[i], shapes + 8 * i);
    view(&st.out[0], out_dtype, out_rank, out_shape);
    npuc_error err; memset(&err, 0, sizeof err);
    rt_bind_fn fn = rt_deepseek_binder(opname);
    if (!fn) { snprintf(msg, 512, "no binder"); return -1; }
    rt_binder b; memset(&b, 0, sizeof b);
    b.dry = 1; b.threads = threads; b.err = &err;
    int rc = fn(&b, &st);
    if (rc) { snprintf(msg, 1024, "%s", err.message); return rc; }
    if (b.extra_bytes) { snprintf(msg, 512, "the dry bind allocated"); return -2; }
    uint64_t dry_scratch = b.scratch_floats;
    rt_pool pool = {0};
    memset(&b, 0, sizeof b);
    b.threads = threads; b.err = &err; b.pool = &pool; b.prepack = 1;
    for (int i = 0; i < n_in; i++) st.in[i].data = data[i];
    st.out[0].data = out;
    rc = fn(&b, &st);
    if (rc) { snprintf(msg, 1024, "%s", err.message); pool_free(&pool); return rc; }
    if (b.scratch_floats != dry_scratch) { snprintf(msg, 512, "the dry and real binds ask different scratch"); return -3; }
    size_t nf = b.scratch_floats + 1;
    float *scr = malloc(nf * sizeof(float));
    memset(scr, 0xff, nf * sizeof(float));
    struct npuc_session s = {scr, threads};
    for (int r = 0; r < (reps < 1 ? 1 : reps) && !rc; r++) rc = st.run(&st, &s);
    if (rc) snprintf(msg, 512, "the run returned %d", rc);
    free(scr);
    pool_free(&pool);
    return rc;
}
"""

_DT = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.int64: 4, torch.int32: 5, torch.int8: 7,
       torch.uint8: 8}


def _compiler() -> str | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return cc.split()[0] if cc else None


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("npucrt_deepseek")
    (d / "harness.c").write_text(_HARNESS)
    lib = d / "libharness.so"
    base = [cc, "-O2", "-std=c11", "-shared", "-fPIC", "-fno-math-errno", f"-I{ROOT / 'include'}", f"-I{SRC}",
            str(d / "harness.c"), str(SRC / "ops_deepseek.c"), str(SRC / "kernels.c"), "-o", str(lib), "-lm",
            "-lpthread"]
    for extra in (["-march=native"], []):  # the host's ISA, else the plain C paths
        if subprocess.run(base[:1] + extra + base[1:], capture_output=True).returncode == 0:
            break
    else:
        pytest.skip("the kernels do not compile here")
    h = ctypes.CDLL(str(lib))
    h.h_run.restype = ctypes.c_int
    return h


def _encode(attrs: dict[str, Any]) -> str:
    parts = []
    for k, v in attrs.items():
        kind = "b" if isinstance(v, bool) else "i" if isinstance(v, int) else "f" if isinstance(v, float) else "s"
        parts.append(f"{k}={kind}:{int(v) if kind == 'b' else repr(v) if kind == 'f' else v}")
    return ";".join(parts)


def native(h: ctypes.CDLL, op: str, ins: list[torch.Tensor], attrs: dict[str, Any], threads: int = 2,
           out_type: TensorType | None = None) -> tuple[int, str, torch.Tensor]:
    """(status, message, output) of `op` through the harness: the output starts as NaN."""
    ins = [x.contiguous() for x in ins]
    if out_type is None:
        od = get_op(op)
        out_type = od.infer_types([TensorType(tuple(x.shape), DType.from_torch(x.dtype)) for x in ins],
                                  od.full_attrs(attrs))[0]
    out = torch.full(out_type.shape, float("nan"), dtype=out_type.dtype.torch)
    n = len(ins)
    shapes = (ctypes.c_int64 * (8 * n))()
    for i, x in enumerate(ins):
        for d, s in enumerate(x.shape):
            shapes[8 * i + d] = s
    msg = ctypes.create_string_buffer(1024)
    rc = h.h_run(op.encode(), n, (ctypes.c_void_p * n)(*[x.data_ptr() for x in ins]),
                 (ctypes.c_int * n)(*[_DT[x.dtype] for x in ins]), (ctypes.c_int * n)(*[x.dim() for x in ins]),
                 shapes, ctypes.c_void_p(out.data_ptr()), _DT[out.dtype], out.dim(),
                 (ctypes.c_int64 * 8)(*out.shape), _encode(attrs).encode(), threads, 1, msg)
    return rc, msg.value.decode(), out


def reference(op: str, ins: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    od = get_op(op)
    return od.run(ins, od.full_attrs(attrs))[0]


def check(h: ctypes.CDLL, op: str, ins: list[torch.Tensor], attrs: dict[str, Any], threads: int = 2,
          tol: float = 1e-5) -> None:
    rc, msg, got = native(h, op, ins, attrs, threads)
    assert rc == 0, msg
    want = reference(op, ins, attrs)
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    else:  # within bf16's rounding of what the reference rounds
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1.6e-2)


# =========================================================================================
# mla_attention
# =========================================================================================

def mla_operands(b: int, h: int, s: int, n: int, dn: int, dr: int, r: int, dv: int, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ops = [torch.randn(b, h, s, dn, generator=gen), torch.randn(b, h, s, dr, generator=gen),
           torch.randn(b, 1, n, r + dr, generator=gen), torch.randn(h, dn, r, generator=gen) / r ** 0.5,
           torch.randn(h, r, dv, generator=gen) / r ** 0.5]
    return [t.to(dtype) for t in ops]


#        (b, h, s,  n,  dn, dr, r,  dv, position,        causal)
MLA_CASES = {
    "decode": (1, 4, 1, 20, 16, 8, 16, 16, [13], False),
    "decode-slots": (2, 4, 1, 20, 16, 8, 16, 16, [[3], [19]], False),
    "chunk-i32": (2, 4, 3, 20, 16, 8, 16, 16, np.array([[4, 9, 19], [0, 1, 2]], dtype=np.int32), False),
    "prefill-absorbed": (1, 4, 6, 6, 16, 8, 16, 16, None, True),
    "prefill-noncausal": (2, 4, 5, 9, 16, 8, 16, 16, None, False),
    "prefill-expanded": (2, 4, 40, 40, 16, 8, 64, 16, None, True),       # head dims not multiples of 16
    "prefill-expanded-gemm": (1, 4, 32, 32, 32, 16, 64, 32, None, True),  # npuc_attention_gemm
    "v3-decode": (1, 16, 1, 70, 64, 32, 256, 64, [69], False),
}


def _mla_case(name: str, dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], dict[str, Any]]:
    b, h, s, n, dn, dr, r, dv, pos, causal = MLA_CASES[name]
    ins = mla_operands(b, h, s, n, dn, dr, r, dv, dtype=dtype)
    if pos is not None:
        ins.append(torch.from_numpy(np.asarray(pos)) if isinstance(pos, np.ndarray) else torch.tensor(pos))
    return ins, {"scale": 0.17, "causal": causal}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", list(MLA_CASES))
def test_mla_matches_the_reference(harness: ctypes.CDLL, case: str, threads: int) -> None:
    ins, attrs = _mla_case(case)
    check(harness, "mla_attention", ins, attrs, threads)


@pytest.mark.parametrize("case", ["decode", "prefill-absorbed", "prefill-expanded", "prefill-expanded-gemm"])
def test_mla_bf16(harness: ctypes.CDLL, case: str) -> None:
    ins, attrs = _mla_case(case, torch.bfloat16)
    check(harness, "mla_attention", ins, attrs)


@pytest.mark.parametrize("bad", [20, -1, 1 << 40])
def test_mla_position_outside_the_cache_is_a_kernel_error(harness: ctypes.CDLL, bad: int) -> None:
    ins, attrs = _mla_case("decode-slots")
    ins[5] = torch.tensor([[3], [bad]])
    rc, _, _ = native(harness, "mla_attention", ins, attrs)
    assert rc == E_KERNEL


def test_mla_refusals(harness: ctypes.CDLL) -> None:
    ins, attrs = _mla_case("decode")
    rc, msg, _ = native(harness, "mla_attention", [t.half() if t.is_floating_point() else t for t in ins], attrs)
    assert rc == E_NO_KERNEL and "f16" in msg
    # the shape rule's own refusals: a latent of the wrong width, causal over other rows, no scale
    bad = list(ins)
    bad[2] = torch.zeros(1, 1, 20, 23)
    assert native(harness, "mla_attention", bad, attrs, out_type=TensorType((1, 4, 1, 16), DType.f32))[0] == E_INVALID
    pre, _ = _mla_case("prefill-noncausal")
    assert native(harness, "mla_attention", pre, {"scale": 0.1, "causal": True},
                  out_type=TensorType((2, 4, 5, 16), DType.f32))[0] == E_INVALID
    assert native(harness, "mla_attention", ins, {"causal": False},
                  out_type=TensorType((1, 4, 1, 16), DType.f32))[0] == E_INVALID
    wrong_out = TensorType((1, 4, 1, 8), DType.f32)
    assert native(harness, "mla_attention", ins, attrs, out_type=wrong_out)[0] == E_INVALID


# =========================================================================================
# fused_moe and qmoe
# =========================================================================================

V3 = dict(top_k=2, n_group=4, topk_group=2, scoring="sigmoid", group_score="top2_sum", norm_topk=True,
          routed_scale=2.5)
V2_GROUPED = dict(top_k=3, n_group=4, topk_group=2, scoring="softmax", group_score="max", routed_scale=1.5)
V2_GREEDY = dict(top_k=2, scoring="softmax", routed_scale=0.5)
FORMS = {"v3": V3, "v2-grouped": V2_GROUPED, "v2-greedy": V2_GREEDY}


def moe_operands(t: int, e: int, h: int, i: int, seed: int, ties: bool = False, here: int | None = None,
                 bias: bool = False) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if ties:  # small integers: many tokens score several experts (and groups) exactly alike
        x = torch.randint(-1, 2, (t, h), generator=gen).float()
        router = torch.randint(-1, 2, (e, h), generator=gen).float()
    else:
        x, router = torch.randn(t, h, generator=gen), torch.randn(e, h, generator=gen)
    here = e if here is None else here
    ops = [x, router, torch.randn(here, 2 * i, h, generator=gen) / h ** 0.5,
           torch.randn(here, h, i, generator=gen) / i ** 0.5]
    if bias:
        ops.append(torch.randint(-2, 3, (e,), generator=gen).float() / 8)
    return ops


@pytest.mark.parametrize("t", [1, 24, 160], ids=["decode", "prefill", "gemm-rows"])
@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("form", list(FORMS))
def test_fused_moe_matches_the_reference(harness: ctypes.CDLL, form: str, ties: bool, t: int) -> None:
    ins = moe_operands(t, 8, 32, 24, seed=t, ties=ties, bias=form == "v3")
    if ties:
        assert any(len(set(row)) < len(row) for row in (ins[0] @ ins[1].T).tolist()), "no ties"
    for threads in (1, 2):
        check(harness, "fused_moe", ins, FORMS[form], threads)


def test_fused_moe_decode_v3_shape(harness: ctypes.CDLL) -> None:
    """16 routed experts, top 4 of 2 groups of 4 (the speed benchmark's shape, smaller)."""
    ins = moe_operands(1, 16, 256, 128, seed=7, bias=True)
    check(harness, "fused_moe", ins, dict(V3, top_k=4))


def test_fused_moe_expert_parallel(harness: ctypes.CDLL) -> None:
    ins = moe_operands(10, 8, 32, 16, seed=3, here=3, bias=True)  # experts 4, 5, 6 here; the others add zero
    check(harness, "fused_moe", ins, dict(V3, expert_offset=4))


@pytest.mark.parametrize("t", [5, 160])
def test_fused_moe_bf16(harness: ctypes.CDLL, t: int) -> None:
    x, router, gu, dn, bias = moe_operands(t, 8, 64, 32, seed=4, bias=True)
    check(harness, "fused_moe", [x.bfloat16(), router, gu.bfloat16(), dn.bfloat16(), bias], V3)
    check(harness, "fused_moe", [x.bfloat16(), router.bfloat16(), gu.bfloat16(), dn.bfloat16()], V2_GREEDY)


def test_fused_moe_refusals(harness: ctypes.CDLL) -> None:
    ins = moe_operands(2, 8, 32, 16, seed=1)
    rc, msg, _ = native(harness, "fused_moe", [t.half() for t in ins], V2_GREEDY)
    assert rc == E_NO_KERNEL and "f16" in msg
    out = TensorType((2, 32), DType.f32)
    assert native(harness, "fused_moe", ins, dict(V2_GREEDY, top_k=9), out_type=out)[0] == E_INVALID
    assert native(harness, "fused_moe", ins, dict(V3, n_group=3), out_type=out)[0] == E_INVALID
    assert native(harness, "fused_moe", ins, dict(V2_GREEDY, scoring="relu"), out_type=out)[0] == E_INVALID
    assert native(harness, "fused_moe", ins, {"n_group": 2}, out_type=out)[0] == E_INVALID  # no top_k
    assert native(harness, "fused_moe", ins[:1] + [ins[1][:, :16]] + ins[2:], V2_GREEDY, out_type=out)[0] == E_INVALID


def qmoe_operands(t: int, bits: int, g: int, dg: int, symmetric: bool, seed: int = 5) -> list[torch.Tensor]:
    x, router, gu, dn, bias = moe_operands(t, 8, 64, 32, seed=seed, bias=True)
    return [x, router, *quantize_rtn(gu, bits, g, symmetric), *quantize_rtn(dn, bits, dg, symmetric), bias]


@pytest.mark.parametrize("t", [1, 160], ids=["decode", "gemm-rows"])
@pytest.mark.parametrize("bits, g, dg, symmetric", [(8, 32, 16, True), (8, 64, 32, False), (4, 32, 16, False),
                                                    (4, 16, 16, True)])
def test_qmoe_matches_the_reference(harness: ctypes.CDLL, bits: int, g: int, dg: int, symmetric: bool, t: int) -> None:
    ins = qmoe_operands(t, bits, g, dg, symmetric)
    for threads in (1, 2):
        check(harness, "qmoe", ins, dict(V3, bits=bits, group_size=g, down_group_size=dg), threads)


def test_qmoe_refuses_small_4bit_groups(harness: ctypes.CDLL) -> None:
    rc, msg, _ = native(harness, "qmoe", qmoe_operands(1, 4, 8, 8, True), dict(V3, bits=4, group_size=8,
                                                                               down_group_size=8))
    assert rc == E_NO_KERNEL and "multiples of 16" in msg


# =========================================================================================
# whole files: the C executor against the torch interpreter
# =========================================================================================

@pytest.fixture(scope="module")
def native_session() -> Any:
    try:
        from npuc.runtime.native_session import NativeSession, runtime_library
    except ImportError:
        pytest.skip("npuc.runtime.native_session is not there")
    if runtime_library() is None:
        pytest.skip("libnpucrt is not built here")
    return NativeSession


def one_op_om(path: Path, op: str, ins: list[torch.Tensor], attrs: dict[str, Any], consts: tuple[int, ...]) -> str:
    from npuc.backend.lower import lower
    from npuc.backend.targets import get_target
    from npuc.backend.writer import write_om

    g = Graph("main")
    vals = []
    for i, a in enumerate(ins):
        t = TensorType(tuple(a.shape), DType.from_torch(a.dtype))
        vals.append(g.add_constant(f"w{i}", t, TensorSource(a.clone())) if i in consts else g.add_input(f"x{i}", t))
    outs = get_op(op).infer_types([v.type for v in vals], attrs)
    g.set_outputs(g.add_node(op, vals, outs, attrs, names=op).outputs)
    write_om(lower(g, get_target("cpu")), str(path))
    return str(path)


def _both(native_cls: Any, path: str, feeds: dict[str, np.ndarray], program: str | None = None
          ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    from npuc.runtime.session import Session

    got = native_cls.load(path, threads=2).run(feeds, program)
    want = Session.load(path, use_native=False).run(feeds, program)
    return got, want


@pytest.mark.parametrize("case", ["decode", "chunk-i32", "prefill-absorbed", "prefill-expanded", "moe", "qmoe"])
def test_native_session_runs_one_op(native_session: Any, tmp_path: Path, case: str) -> None:
    consts: tuple[int, ...]
    if case == "moe":
        op, ins, attrs, consts = "fused_moe", moe_operands(3, 8, 32, 24, seed=2, bias=True), V3, (1, 2, 3, 4)
    elif case == "qmoe":
        op, ins = "qmoe", qmoe_operands(3, 8, 32, 16, True)
        attrs, consts = dict(V3, bits=8, group_size=32, down_group_size=16), tuple(range(1, 9))
    else:
        op, consts = "mla_attention", (3, 4)
        ins, attrs = _mla_case(case)
    path = one_op_om(tmp_path / f"{case}.om", op, ins, attrs, consts)
    feeds = {f"x{i}": a.numpy() for i, a in enumerate(ins) if i not in consts}
    got, want = _both(native_session, path, feeds)
    for name, w in want.items():
        np.testing.assert_allclose(got[name], w.numpy(), atol=1e-5, rtol=1e-5)


def test_native_session_tiny_deepseek_v3(native_session: Any, moe_checkpoint: Path, tmp_path: Path) -> None:
    """MLA over the latent cache and routed experts: prefill and decode logits of both executors."""
    from npuc.compiler.driver import compile_model
    from npuc.runtime.session import Session

    om = compile_model(str(moe_checkpoint), input_shape="input_ids:1,8", output=str(tmp_path / "v3"), max_seq_len=24)
    ours, ref = native_session.load(om, threads=2), Session.load(om, use_native=False)
    steps = {st.opdef.name for p in ref.programs.values() for st in p.steps}
    assert {"mla_attention", "fused_moe"} <= steps
    prefill = ref.programs["prefill"]
    ids = np.array([[5, 17, 3, 99, 42, 7, 11, 2]], dtype=np.int64)
    feeds: dict[str, Any] = {prefill.inputs[0].name: ids}
    if any(t.name == "last_token" for t in prefill.inputs):
        feeds["last_token"] = np.array([7], dtype=np.int64)
    ours.reset_state()
    ref.reset_state()
    got, want = ours.run(feeds, "prefill")["logits"], ref.run(feeds, "prefill")["logits"].numpy()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    decode = ref.programs["decode"]
    ids_name = decode.inputs[0].name
    pos_name = next(t.name for t in decode.inputs if t.name != ids_name)
    token = int(want.reshape(-1, want.shape[-1])[-1].argmax())
    for pos in range(8, 14):
        feeds = {ids_name: np.array([[token]], dtype=np.int64), pos_name: np.array([pos], dtype=np.int64)}
        got, want = ours.run(feeds, "decode")["logits"], ref.run(feeds, "decode")["logits"].numpy()
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        token = int(want.reshape(-1, want.shape[-1])[-1].argmax())
