"""Tool calls: OpenAI's `tools` and `tool_choice`, rendered through the stored chat template
(which receives `tools` as transformers' apply_chat_template passes them), and the model's
output parsed back into `message.tool_calls`.

Formats (the tool-call syntax a family's template teaches its model):

    hermes       <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>   (Hermes, Qwen 2.5/3)
    llama3_json  {"name": ..., "parameters": {...}}, after an optional <|python_tag|>  (Llama 3.1+)
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]              (Mistral)

The format is read from the template (the marker it mentions), or set with
`npuc serve --tool-call-parser`. `tool_choice: "required"` or a named function is enforced:
the output is decoded under a grammar of that format whose JSON is each allowed tool's
name and parameter schema (apps/structured.py), so even a weak model emits a call that
parses and matches the schema. `auto` decodes freely and parses what comes; `none` never
parses.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

FORMATS = ("hermes", "llama3_json", "mistral")


class ToolError(ValueError):
    """A bad `tools` or `tool_choice`: the message names what is wrong; .param the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_tools(value: Any) -> list[dict[str, Any]]:
    """OpenAI's `tools`: a list of {"type": "function", "function": {"name", "parameters"?}}."""
    if not isinstance(value, list) or not value:
        raise ToolError("'tools' must be a non-empty list of {\"type\": \"function\", \"function\": {...}}", "tools")
    names: set[str] = set()
    for i, t in enumerate(value):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tools")
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", fn["name"]):
            raise ToolError(f"tools[{i}]: the name {fn['name']!r} is not 1-64 letters, digits, _ . or -", "tools")
        if fn["name"] in names:
            raise ToolError(f"tools[{i}]: the name {fn['name']!r} is given twice", "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ToolError(f"tools[{i}]: 'parameters' must be a JSON schema object", "tools")
        names.add(fn["name"])
    return value


def check_choice(value: Any, tools: list[dict[str, Any]] | None) -> str | None:
    """tool_choice as "auto", "none", "required" or a function's name; None without tools."""
    if value is None:
        return "auto" if tools else None
    if tools is None:
        raise ToolError("'tool_choice' needs 'tools'", "tool_choice")
    if value in ("auto", "none", "required"):
        return str(value)
    name = value.get("function", {}).get("name") if isinstance(value, dict) and value.get("type") == "function" \
        and isinstance(value.get("function"), dict) else None
    if not isinstance(name, str):
        raise ToolError("'tool_choice' must be auto, none, required or {\"type\": \"function\", \"function\": "
                        "{\"name\": ...}}", "tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise ToolError(f"'tool_choice' names the function {name!r}, which 'tools' does not have", "tool_choice")
    return name


def detect_format(template: str | None) -> str:
    """The tool-call format a chat template teaches (hermes where it names none)."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json"
    return "hermes"


def _call_schema(fmt: str, tools: list[dict[str, Any]], only: str | None) -> dict[str, Any]:
    args = "parameters" if fmt == "llama3_json" else "arguments"
    options = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                 args: t["function"].get("parameters") or {"type": "object"}},
                "required": ["name", args], "additionalProperties": False}
               for t in tools if only is None or t["function"]["name"] == only]
    return options[0] if len(options) == 1 else {"anyOf": options}


def grammar(fmt: str, tools: list[dict[str, Any]], choice: str, parallel: bool = True) -> str | None:
    """The Lark grammar that makes the output a call of an allowed tool (None for auto/none)."""
    if choice in ("auto", "none"):
        return None
    only = None if choice == "required" else choice
    schema = json.dumps(_call_schema(fmt, tools, only))
    more = parallel and only is None
    if fmt == "hermes":
        repeat = ' ("\\n" call)*' if more else ""
        rules = 'start: call' + repeat + '\ncall: "<tool_call>\\n" %json ' + schema + ' "\\n</tool_call>"'
    elif fmt == "llama3_json":
        rules = f"start: %json {schema}"
    else:
        array = {"type": "array", "items": json.loads(schema), "minItems": 1}
        if not more:
            array["maxItems"] = 1
        rules = f'start: "[TOOL_CALLS]" %json {json.dumps(array)}'
    return rules


def _call(name: Any, arguments: Any) -> dict[str, Any] | None:
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse_output(fmt: str, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(the content left, the tool calls) of an output; no calls where nothing parses."""
    calls: list[dict[str, Any]] = []
    if fmt == "hermes":
        rest = text
        for m in re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S):
            try:
                obj = json.loads(m.group(1))
            except ValueError:
                continue
            c = _call(obj.get("name"), obj.get("arguments", {})) if isinstance(obj, dict) else None
            if c is not None:
                calls.append(c)
                rest = rest.replace(m.group(0), "", 1)
        content = rest.strip() or None
        return (content if calls else text), calls
    if fmt == "llama3_json":
        body = text.split("<|python_tag|>", 1)[-1].strip()
        for part in (p.strip() for p in body.split(";")):
            try:
                obj = json.loads(part)
            except ValueError:
                return text, []
            c = _call(obj.get("name"), obj.get("parameters", obj.get("arguments", {}))) \
                if isinstance(obj, dict) else None
            if c is None:
                return text, []
            calls.append(c)
        return None, calls
    head, sep, tail = text.partition("[TOOL_CALLS]")
    if not sep:
        return text, []
    try:
        items = json.loads(tail.strip())
    except ValueError:
        return text, []
    for obj in items if isinstance(items, list) else []:
        c = _call(obj.get("name"), obj.get("arguments", {})) if isinstance(obj, dict) else None
        if c is not None:
            calls.append(c)
    return (head.strip() or None) if calls else text, calls
