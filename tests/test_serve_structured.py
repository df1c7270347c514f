"""Structured output and tool calls through `npuc serve` and the official `openai` client,
on a random-weight Llama with a byte-level BPE tokenizer trained in the test (every JSON
character is a token). The constraint is proven by random weights still producing
schema-valid JSON and calls that parse: an unconstrained random model writes neither."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_serve import Server

from npuc.apps.tools import check_choice, detect_format, grammar, parse_output
from npuc.compiler.driver import compile_model
from npuc.runtime.native_session import runtime_library

openai = pytest.importorskip("openai")
llguidance = pytest.importorskip("llguidance")
pytest.importorskip("starlette")
pytestmark = pytest.mark.skipif(runtime_library() is None, reason="sampling needs the native runtime")

VOCAB = 320
TEMPLATE = ("{% if tools %}<|system|>You may call: {{ tools | tojson }}. Reply with <tool_call>{...}</tool_call>."
            "{% endif %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}{% endfor %}<|assistant|>")
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["color", "count", "ok"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def _check(obj: Any) -> None:
    assert set(obj) == {"color", "count", "ok"}
    assert obj["color"] in ("red", "green", "blue") and type(obj["count"]) is int and 0 <= obj["count"] <= 99
    assert type(obj["ok"]) is bool


@pytest.fixture(scope="module")
def bpe_om(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("structured")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [json.dumps({"color": c, "count": i, "ok": i % 2 == 0}) for i, c in enumerate(["red", "green", "blue"] * 20)]
    corpus += ['<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'] * 20
    corpus += ["the cat sat on the mat and the dog ran in the park"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = TEMPLATE
    ckpt = root / "ckpt"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                   bos_token_id=0, eos_token_id=1, pad_token_id=1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(ckpt))
    fast.save_pretrained(str(ckpt))
    return Path(compile_model(str(ckpt), input_shape="input_ids:4,128", max_seq_len=768, output=str(root / "bpe")))


@pytest.fixture(scope="module")
def client(bpe_om: Path) -> Iterator[Any]:
    s = Server(bpe_om)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="none", max_retries=0)
    s.close()


def _complete(client: Any, chat: bool, stream: bool, **kw: Any) -> tuple[str, str]:
    """(text, finish_reason) of one choice, streamed or not."""
    if chat:
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "give me json"}],
                                           stream=stream, **kw)
    else:  # the SDK's completions take response_format in the body only
        if "response_format" in kw:
            kw["extra_body"] = {**kw.get("extra_body", {}), "response_format": kw.pop("response_format")}
        r = client.completions.create(model="m", prompt="the cat", stream=stream, **kw)
    if not stream:
        return (r.choices[0].message.content if chat else r.choices[0].text), r.choices[0].finish_reason
    chunks = [c for c in r if c.choices]
    text = "".join((c.choices[0].delta.content if chat else c.choices[0].text) or "" for c in chunks)
    return text, next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices[0].finish_reason)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_json_schema_holds_for_random_weights(client: Any, chat: bool, stream: bool) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    unconstrained, _ = _complete(client, chat, stream, max_tokens=60, temperature=1.0, seed=3)
    with pytest.raises(ValueError):
        json.loads(unconstrained)
    for seed in range(3):
        text, reason = _complete(client, chat, stream, max_tokens=120, temperature=1.0, seed=seed, response_format=fmt)
        _check(json.loads(text))
        assert reason == "stop"


def test_json_object_regex_choice_and_lark(client: Any) -> None:
    text, _ = _complete(client, False, False, max_tokens=200, temperature=0.7, seed=1,
                        response_format={"type": "json_object"},
                        extra_body={"min_p": 0.05})  # any object: random weights, so keep it short-ish
    assert isinstance(json.loads(text), dict)
    text, _ = _complete(client, True, False, max_tokens=40, temperature=1.0, seed=2,
                        extra_body={"structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}})
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", text)
    for seed in range(4):
        text, _ = _complete(client, False, True, max_tokens=10, temperature=1.0, seed=seed,
                            extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
        assert text in ("yes", "no", "maybe")
    text, _ = _complete(client, False, False, max_tokens=30, temperature=1.0, seed=5,
                        extra_body={"structured_outputs": {"grammar": 'start: "id:" /[0-9]{4}/'}})
    assert re.fullmatch("id:[0-9]{4}", text)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "[unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_constraints_get_a_400_naming_the_field(client: Any, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body=body)
    assert e.value.body["param"] == param, e.value.body


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_tool_choice_required_gives_a_call_that_matches_its_schema(client: Any, stream: bool) -> None:
    for seed in range(3):
        kw: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "weather in paris?"}],
                              "max_tokens": 120, "temperature": 1.0, "seed": seed, "tools": [WEATHER, TIME],
                              "tool_choice": "required", "parallel_tool_calls": False}
        if stream:
            chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
            calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
            reason = chunks[-1].choices[0].finish_reason
        else:
            r = client.chat.completions.create(**kw)
            calls, reason = r.choices[0].message.tool_calls, r.choices[0].finish_reason
        assert reason == "tool_calls" and len(calls) == 1
        fn = calls[0].function
        args = json.loads(fn.arguments)
        if fn.name == "get_weather":
            assert args["city"] in ("Paris", "Oslo") and args["unit"] in ("C", "F") and len(args) == 2
        else:
            assert fn.name == "get_time" and args == {"zone": args["zone"]} and args["zone"] in ("UTC", "CET")
        assert calls[0].id.startswith("call_") and calls[0].type == "function"


def test_a_named_tool_choice_calls_that_tool(client: Any) -> None:
    for seed in range(3):
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "time?"}], max_tokens=120,
                                           temperature=1.0, seed=seed, tools=[WEATHER, TIME],
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


def test_the_template_receives_the_tools(bpe_om: Path) -> None:
    from npuc.apps.generate import load_tokenizer_object
    from npuc.runtime.executor import open_session

    tok = load_tokenizer_object(open_session(str(bpe_om)))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[WEATHER], tokenize=False)
    assert "get_weather" in text and text.endswith("<|user|>hi<|assistant|>")
    assert "get_weather" not in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_formats_parse_and_their_grammars_accept_a_call(bpe_om: Path) -> None:
    """Each format's parser reads what its grammar allows (llguidance checks the text), and
    the template decides the format."""
    from npuc.apps.generate import load_tokenizer_object
    from npuc.apps.structured import GrammarTokenizer, grammar_for
    from npuc.runtime.executor import open_session

    gt = GrammarTokenizer(load_tokenizer_object(open_session(str(bpe_om))), VOCAB, {1})
    texts = {"hermes": '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
             "llama3_json": '{"name": "get_time", "parameters": {"zone": "UTC"}}',
             "mistral": '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]'}
    for fmt, text in texts.items():
        g = grammar_for("lark", grammar(fmt, [WEATHER, TIME], "required"))
        gt.check(g)
        m = llguidance.LLMatcher(gt.tok, g, log_level=0)
        assert m.consume_tokens(gt.tok.tokenize_str(text)) and m.is_accepting(), fmt
        content, calls = parse_output(fmt, text)
        assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
            == [("get_time", {"zone": "UTC"})], fmt
    assert parse_output("hermes", "just words") == ("just words", [])
    assert parse_output("hermes", 'hi <tool_call>{"name": "f", "arguments": {}}</tool_call>')[0] == "hi"
    assert detect_format("{{ '[TOOL_CALLS]' }}") == "mistral" and detect_format("<|python_tag|>") == "llama3_json"
    assert detect_format(TEMPLATE) == "hermes" and check_choice(None, [WEATHER]) == "auto"
