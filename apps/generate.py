"""Greedy decoding over a `.om` compiled with `--max_seq_len`: the prefill program
fills the KV cache from position 0, then the decode program runs one token at a time.

A prompt shorter than the prefill length is padded on the right: attention is causal,
so the padding changes neither the logits at the prompt's last position nor the cache
rows before it, and decode overwrites the rows after it before any query can see them.
A prompt longer than the prefill length sends its remaining tokens through decode.
A prefill compiled with `--prefill_logits last` (the default) takes the row to compute
logits for as its `last_token` input and returns that row alone; one compiled with
`all` (or by an npuc before the option) returns every row, and the last is read.
Decoding stops after `max_new_tokens`, at an end-of-sequence token (unless ignored),
or when the cache is full.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from npuc.errors import EXIT_IO, EXIT_USAGE, NpucError

if TYPE_CHECKING:  # either executor: the C library's (native_session) or the torch interpreter's
    from npuc.runtime.native_session import NativeSession
    from npuc.runtime.session import Session

# The prefill input naming the row whose logits it computes (passes/last_token_logits.py).
LAST_TOKEN = "last_token"
SLOT = "slot"  # a slotted prefill's input: which slot it fills (passes/kv_cache.py)


@dataclass(frozen=True)
class GenerationInfo:
    max_seq_len: int
    prefill_len: int
    batch: int
    eos: frozenset[int]
    ids_name: str
    vocab: int
    last_token: bool = False  # prefill computes the logits of one row, the one its LAST_TOKEN input names
    # prefill takes the prompt's last row (LAST_TOKEN): for its logits, or for the row whose
    # recurrent state it keeps (a model with recurrent layers has the input with every row's logits)
    takes_last: bool = False
    # the model keeps recurrent state per slot (metadata recurrent_state): a slot's state is
    # reset by a prefill only, so a prompt never starts in a slot through the decode steps
    recurrent: bool = False
    # its verify program keeps the recurrent states after each row (metadata recurrent_rollback):
    # a rejected draft is undone by Session.rollback
    rollback: bool = False


def _vocab(s: Session | NativeSession, ids_name: str) -> int:
    """Token ids the model can embed: the rows of the table the ids index, else the logits' width."""
    rows = s.index_rows("prefill").get(ids_name) if hasattr(s, "index_rows") else None
    return rows or int(s.programs["prefill"].outputs[0].shape[-1])


def logits_f32(x: Any) -> Any:
    """Logits as numbers: the C executor hands bf16 out as its 16 bits (numpy has no bf16),
    which argmax and the samplers must not read as integers; anything else as it is."""
    if isinstance(x, np.ndarray) and x.dtype == np.uint16:
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x


def copy_row(x: Any) -> Any:
    """A row of logits that outlives the next run (numpy from the C executor, torch from the other)."""
    return x.copy() if isinstance(x, np.ndarray) else x.clone()


def generation_info(s: Session | NativeSession) -> GenerationInfo:
    if hasattr(s, "generation"):  # the C executor read it from the file at load
        try:
            g = s.generation()
        except NpucError as e:
            # libnpucrt's own decode loop reads f32 logits only; a 16-bit model's programs still run
            # on it, stepped from here (below), when the file has them
            if e.code != "NPUC-E0111" or s.metadata("max_seq_len") is None:
                raise
        else:
            ids = next(t for t in s.programs["prefill"].inputs if t.name not in (LAST_TOKEN, "slot"))
            takes, last = _last_row(s)
            return GenerationInfo(g.max_seq_len, g.prefill_len, ids.shape[0], g.eos, ids.name, g.vocab, last, takes,
                                  bool(s.metadata("recurrent_state")), bool(s.metadata("recurrent_rollback")))
        meta = {k: v for k in ("max_seq_len", "eos_token_id", "recurrent_state", "recurrent_rollback")
                if (v := s.metadata(k)) is not None}
    else:
        meta = {m.key: m.value for m in s.model.metadata}
    if "prefill" not in s.programs or "decode" not in s.programs or "max_seq_len" not in meta:
        raise NpucError("NPUC-E0111", "the model has no prefill and decode programs to generate with",
                        "compile it with --max_seq_len N", exit_code=EXIT_USAGE)
    ids = next(t for t in s.programs["prefill"].inputs if t.name not in (LAST_TOKEN, "slot"))
    eos = frozenset(int(t) for t in meta.get("eos_token_id", "").split(",") if t)
    takes, last = _last_row(s)
    return GenerationInfo(int(meta["max_seq_len"]), ids.shape[1], ids.shape[0], eos, ids.name, _vocab(s, ids.name),
                          last, takes, bool(meta.get("recurrent_state")), bool(meta.get("recurrent_rollback")))


def program_rows(s: Session | NativeSession, program: str, ids_name: str) -> int:
    """The tokens of each slot a step of `program` runs (its token ids' second dim), 0 where
    the model has no such program (verify: --speculative_tokens; mixed: --mixed_tokens)."""
    p = s.programs.get(program) if hasattr(s.programs, "get") else None
    return next(int(t.shape[1]) for t in p.inputs if t.name == ids_name) if p is not None else 0


def prefill_feeds(info: GenerationInfo, prompt: Sequence[int], bufs: tuple[Any, Any, Any],
                  slot: int | None) -> tuple[dict[str, Any], int]:
    """The prefill program's feeds for `prompt`'s first prefill_len tokens, in `bufs` (the
    ids [1, prefill_len], last token [1] and slot [1] arrays, filled in place), with the
    `slot` input where the model takes one (not None); and how many tokens they hold."""
    ids, last, slot_buf = bufs
    n = min(len(prompt), info.prefill_len)
    ids[:] = 0
    ids[0, :n] = np.asarray(prompt[:n], dtype=np.int64)
    feeds = {info.ids_name: ids}
    if info.takes_last:
        last[0] = n - 1
        feeds[LAST_TOKEN] = last
    if slot is not None:
        slot_buf[0] = slot
        feeds[SLOT] = slot_buf
    return feeds, n


def _last_row(s: Session | NativeSession) -> tuple[bool, bool]:
    """(prefill takes a LAST_TOKEN input, its logits are that row's alone)."""
    prefill = s.programs["prefill"]
    takes = any(t.name == LAST_TOKEN for t in prefill.inputs)
    return takes, takes and prefill.outputs[0].shape[1] == 1


def stream(s: Session, prompt: Sequence[int], max_new_tokens: int, ignore_eos: bool = False) -> Iterator[int]:
    """Yield greedily decoded token ids, one per step."""
    for token, _ in steps(s, prompt, max_new_tokens, ignore_eos, keep_logits=False):
        yield token


def check_prompt(info: GenerationInfo, prompt: Sequence[int]) -> None:
    """NPUC-E0125 for a prompt generation cannot take: empty, one the cache cannot hold with a
    token after it, or an id outside the vocabulary."""
    if not prompt:
        raise NpucError("NPUC-E0125", "the prompt is empty", "give at least one token id", exit_code=EXIT_USAGE)
    if len(prompt) >= info.max_seq_len:
        raise NpucError("NPUC-E0125", f"the prompt has {len(prompt)} tokens; the model caches {info.max_seq_len}",
                        "shorten the prompt or recompile with a larger --max_seq_len", exit_code=EXIT_USAGE)
    bad = next((t for t in prompt if not 0 <= t < info.vocab), None)
    if bad is not None:
        raise NpucError("NPUC-E0125", f"token id {bad} is outside the model's vocabulary of {info.vocab}",
                        f"prompt ids are 0..{info.vocab - 1}", exit_code=EXIT_USAGE)


def _slotted_steps(s: Session, prompt: Sequence[int], max_new_tokens: int, ignore_eos: bool,
                   keep_logits: bool) -> Iterator[tuple[int, Any]]:
    """One sequence through the scheduler (apps/scheduler.py), in slot 0."""
    from npuc.apps.scheduler import Scheduler

    sched = Scheduler(s, keep_logits=True)
    sched.submit(list(prompt), max_new_tokens, ignore_eos)
    while not sched.idle:
        for e in sched.step():
            assert e.token is not None and e.logits is not None
            yield e.token, e.logits


def steps(s: Session, prompt: Sequence[int], max_new_tokens: int, ignore_eos: bool = False,
          keep_logits: bool = True) -> Iterator[tuple[int, Any]]:
    """Yield (token, the logits it was chosen from) for each new token. Without
    `keep_logits` the logits are a view of the arena, valid until the next step: the
    decode loop then allocates no tensor in the runtime."""
    info = generation_info(s)
    check_prompt(info, prompt)
    decode_ids = next(t for t in s.programs["decode"].inputs if t.name == info.ids_name)
    if any(t.name == "slot" for t in s.programs["prefill"].inputs) or decode_ids.shape[1] > 1:
        # a model of several slots, or of several tokens a decode step
        yield from _slotted_steps(s, prompt, max_new_tokens, ignore_eos, keep_logits)
        return
    if info.batch != 1:
        raise NpucError("NPUC-E0125", f"the model was compiled for batch {info.batch} by an npuc without slots: its "
                        "prefill fills every sequence at once", "recompile it", exit_code=EXIT_USAGE)
    s.reset_state()
    n = min(len(prompt), info.prefill_len)
    first = np.zeros((1, info.prefill_len), dtype=np.int64)
    first[0, :n] = np.asarray(list(prompt[:n]), dtype=np.int64)
    feeds = {info.ids_name: first}
    if info.takes_last:
        feeds[LAST_TOKEN] = np.array([n - 1], dtype=np.int64)
    logits = logits_f32(s.run(feeds, "prefill", copy_outputs=keep_logits)["logits"][0, 0 if info.last_token
                                                                                     else n - 1])
    decode = s.programs["decode"]
    pos_name = next(t.name for t in decode.inputs if t.name != info.ids_name)

    def step(token: int, pos: int) -> Any:
        out = s.run({info.ids_name: np.array([[token]], dtype=np.int64), pos_name: np.array([pos], dtype=np.int64)},
                    "decode",
                    copy_outputs=keep_logits)
        return logits_f32(out["logits"][0, -1])

    for pos in range(n, len(prompt)):  # the rest of a long prompt
        logits = step(prompt[pos], pos)
    pos = len(prompt)
    for i in range(max_new_tokens):
        token = int(logits.argmax())
        yield token, logits
        if (token in info.eos and not ignore_eos) or i + 1 == max_new_tokens or pos >= info.max_seq_len:
            return
        logits = step(token, pos)
        pos += 1


def generate(s: Session, prompt: Sequence[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    return list(stream(s, prompt, max_new_tokens, ignore_eos))


def load_tokenizer(s: Session) -> tuple[Callable[[str], list[int]], Callable[[list[int]], str]]:
    """encode/decode from the tokenizer files the compiler stored (needs transformers)."""
    return tokenizer_functions(load_tokenizer_object(s))


def tokenizer_functions(tok: Any) -> tuple[Callable[[str], list[int]], Callable[[list[int]], str]]:
    """encode (with the special tokens) and decode (without them) of a stored tokenizer
    (apps/tokenizer.py) or a transformers one."""
    from npuc.apps.tokenizer import StoredTokenizer

    if isinstance(tok, StoredTokenizer):
        return tok.encode, tok.decode

    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=True)["input_ids"])

    def decode(ids: list[int]) -> str:
        return str(tok.decode(ids, skip_special_tokens=True))

    return encode, decode


def tokenizer_section(s: Session | NativeSession) -> bytes | None:
    if hasattr(s, "section"):
        return s.section("tokenizer")
    return bytes(s.om.section("tokenizer")) if "tokenizer" in s.om.section_names() else None


def load_tokenizer_object(s: Session | NativeSession) -> Any:
    """The tokenizer from the files the compiler stored (its chat template too): run by the
    tokenizers library and jinja2 (apps/tokenizer.py), or by transformers for a stored
    tokenizer without tokenizer.json."""
    from npuc.apps import tokenizer
    from npuc.runtime.om_validate import check_tokenizer

    data = tokenizer_section(s)
    if data is None:
        raise NpucError("NPUC-E0126", "the model has no tokenizer", "pass --prompt-ids, or compile from a Hugging "
                        "Face folder that has tokenizer files", exit_code=EXIT_USAGE)
    files = check_tokenizer(str(getattr(s, "path", None) or s.om.path), data)  # checked at load, too
    try:
        stored = tokenizer.load(files)
    except Exception as e:  # noqa: BLE001 - the tokenizers library's own errors, whatever their type
        raise NpucError("NPUC-E0411", f"the stored tokenizer does not load: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}"[:300], "the file is damaged; recompile it",
                        exit_code=EXIT_IO) from None
    if stored is not None:
        return stored
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise NpucError("NPUC-E0104", "--prompt needs transformers to run this stored tokenizer (it has no "
                        "tokenizer.json for the tokenizers library)",
                        "pip install 'npuc[hf]', or pass --prompt-ids", exit_code=EXIT_USAGE) from None
    with tempfile.TemporaryDirectory() as d:
        for name, data in files.items():
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
        try:
            tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - well-formed files that transformers still cannot read
            raise NpucError("NPUC-E0411", f"the stored tokenizer does not load: {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}"[:300],
                            "the file is damaged; recompile it", exit_code=EXIT_IO) from None
    return tok
