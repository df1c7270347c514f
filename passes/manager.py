"""Pass infrastructure in the onnx-ir spirit: a pass is a small frozen dataclass
whose fields are its options; calling it runs `requires -> call -> ensures` and
returns `PassResult(graph, modified)`. The manager runs a flat list of passes and,
when asked (tests, `--debug`), the verifier after each one; a failure names the
pass and the passes that ran before it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from npuc.errors import InternalError
from npuc.ir import Graph, verify


@dataclass(frozen=True)
class PassResult:
    graph: Graph
    modified: bool
    details: dict[str, Any] = field(default_factory=dict)  # e.g. rule counts, for the fusion report


@dataclass(frozen=True)
class Pass:
    name = "pass"

    def requires(self, g: Graph) -> None:
        """Preconditions; raise InternalError if the graph is not fit for the pass."""

    def call(self, g: Graph) -> PassResult:
        raise NotImplementedError

    def ensures(self, g: Graph) -> None:
        """Postconditions beyond the verifier."""

    def __call__(self, g: Graph) -> PassResult:
        self.requires(g)
        res = self.call(g)
        self.ensures(res.graph)
        return res


@dataclass
class PassManager:
    passes: Sequence[Pass]
    verify_each: bool = False
    on_after: Callable[[int, Pass, Graph], None] | None = None
    timings: list[tuple[str, float]] = field(default_factory=list)
    details: dict[str, dict[str, Any]] = field(default_factory=dict)

    def run(self, g: Graph) -> Graph:
        if self.verify_each:
            verify(g)
        done: list[str] = []
        for i, p in enumerate(self.passes):
            t0 = time.perf_counter()
            try:
                res = p(g)
                g = res.graph
                if res.details:
                    self.details[p.name] = res.details
                if self.verify_each:
                    verify(g)
            except InternalError as e:
                raise InternalError(f"pass {p.name!r} failed (after {', '.join(done) or 'no passes'}): {e}") from e
            self.timings.append((p.name, time.perf_counter() - t0))
            done.append(p.name)
            if self.on_after is not None:
                self.on_after(i, p, g)
        return g
