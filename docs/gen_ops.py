"""Generates docs/ops.md: `npuc ops` prints the same text (cli/ops_cmd.py renders it).

    python docs/gen_ops.py > docs/ops.md        (tests/test_docs.py checks it is current)
"""

from __future__ import annotations


def render() -> str:
    from npuc.cli.ops_cmd import render_ops

    return render_ops()


if __name__ == "__main__":
    print(render(), end="")
