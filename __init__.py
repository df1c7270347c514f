"""npuc: an ahead-of-time graph compiler for transformer LLMs.

    import npuc
    npuc.compile("ckpt_dir", input_shape="input_ids:1,16", output="build/model")
    outputs = npuc.load("build/model.om").run({"input_ids": ids})

Heavy frontends (transformers, onnx) are imported only when a compile needs them,
so `npuc.load` works with numpy and protobuf alone: it runs the C executor (libnpucrt),
and the torch interpreter only for a model the C executor refuses.
"""

from __future__ import annotations

from typing import Any

from npuc.errors import InternalError, NpucError

__version__ = "0.1.0"
__all__ = ["__version__", "compile", "load", "NpucError", "InternalError"]


def compile(model: Any, *, input_shape: Any = None, output: str, **options: Any) -> str:  # noqa: A001
    """Compile `model` (nn.Module, .pt2 path or HF checkpoint dir) to `<output>.om`; returns the path."""
    from npuc.compiler.driver import compile_model

    return compile_model(model, input_shape=input_shape, output=output, **options)


def load(path: str, device: str = "cpu", executor: str | None = None) -> Any:
    """Load a compiled `.om` for execution: on the C executor (a `NativeSession`) unless it
    refuses the model or `executor="torch"` (NPUC_EXECUTOR) asks for the torch interpreter
    (a `Session`). Both run `run({name: array}, program=None)`."""
    from npuc.runtime.executor import open_session

    return open_session(path, device=device, executor=executor)
