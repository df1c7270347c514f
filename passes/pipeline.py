"""The pass pipeline, readable on one screen."""

from __future__ import annotations

from npuc.passes.constant_folding import ConstantFolding
from npuc.passes.dce import DeadCodeElimination
from npuc.passes.manager import Pass


def default_pipeline() -> list[Pass]:
    return [
        DeadCodeElimination(),
        ConstantFolding(),
        DeadCodeElimination(),
    ]
