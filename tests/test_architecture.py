"""The layering rules of docs/architecture.md, checked on every module's imports.

Each rule names a set of modules and the imports they must not make (a module
or any submodule of it). Imports are read with ``ast`` from the source, lazy
ones inside functions included, so a rule cannot be dodged by importing late.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CLOCKS = ("time", "datetime")
NETWORK = ("aiohttp", "asyncio", "socket", "ssl", "http", "urllib", "uvloop", "requests")

# (where, what it may not import, why)
RULES: list[tuple[str, tuple[str, ...], str]] = [
    ("swarm/protocol", (*NETWORK, *CLOCKS, "threading", "torch", "numpy", "node", "simulations",
                        "trainer", "lab", "swarm.codec"),
     "the protocol core is sans-I/O: no sockets, event loops, clocks, tensors or drivers"),
    ("swarm/codec", (*NETWORK, "node", "simulations", "trainer", "lab", "swarm.protocol"),
     "the codec turns checkpoints into patches and back; it knows nothing of the network"),
    ("swarm", ("node", "simulations", "trainer", "lab", "patchswarm"),
     "the library does not depend on the applications built on it"),
    ("simulations", ("node", "aiohttp", "asyncio", "uvloop", "trainer", "lab", "torch"),
     "the simulator drives the same core as the node, over a modelled network, not the node's"),
    ("node", ("simulations", "trainer", "lab"),
     "a rollout node runs without the simulator, the trainer or the demo harness"),
    ("trainer", ("lab", "simulations"),
     "trainer/ is what a trainer imports; the demo fleet and lab harness depend on it, not back"),
]


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def _hits(name: str, banned: tuple[str, ...]) -> bool:
    return any(name == b or name.startswith(b + ".") for b in banned)


@pytest.mark.parametrize(("where", "banned", "why"), RULES, ids=[r[0] for r in RULES])
def test_layer_imports(where: str, banned: tuple[str, ...], why: str) -> None:
    files = sorted((ROOT / where).rglob("*.py"))
    assert files, where
    bad = [f"{p.relative_to(ROOT)}:{line}: import {name}"
           for p in files for line, name in _imports(p) if _hits(name, banned)]
    assert not bad, f"{why}:\n" + "\n".join(bad)


# ``python -m swarm.cli`` still runs the command line for scripts written before it moved
# to ``patchswarm.cli``; the one string import left in the library, to be removed.
_SHIMS = {"swarm/cli.py"}


def test_no_import_by_string_in_the_library() -> None:
    """``importlib``/``runpy`` with a module name would hide a dependency from the rules above."""
    bad = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "swarm").rglob("*.py"))
           if str(p.relative_to(ROOT)) not in _SHIMS
           and any(name in ("importlib", "runpy") for _l, name in _imports(p))]
    assert not bad, bad


def test_trainer_is_only_what_a_trainer_imports() -> None:
    names = sorted(p.name for p in (ROOT / "trainer").glob("*.py"))
    assert names == ["__init__.py", "cli_publish.py", "fleet.py", "publisher.py", "served.py",
                     "view_file.py"], names
