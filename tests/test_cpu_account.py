"""``node.cpu_account``: a real node process with ``PATCHSWARM_CPU_ACCOUNT`` set writes
what each stage of its data path cost when it exits; without it nothing is wrapped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from node import cpu_account

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = """
import os, sys
from node import cpu_account
acc = cpu_account.install_from_env("n-test")
from node.frames import FrameReader, FrameWriter
w = FrameWriter(bytes(32))
for _ in range(3):
    w.seal(os.urandom(40_000))
print("accounting" if acc is not None else "off")
"""


def _run(tmp_path: Path, env_dir: Path | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != cpu_account.ENV}
    if env_dir is not None:
        env[cpu_account.ENV] = str(env_dir)
    out = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, check=True,
                         capture_output=True, text=True, timeout=120)
    return out.stdout.strip()


def test_a_node_that_accounts_writes_its_stages_at_exit(tmp_path: Path) -> None:
    where = tmp_path / "acct"
    assert _run(tmp_path, where) == "accounting"
    data = json.loads((where / "n-test.json").read_text())
    calls, cpu_s = data["stages"]["FrameWriter.seal"]
    assert calls == 3 and cpu_s > 0
    assert data["missing"] == []  # every stage named in STAGES is still there
    assert data["process_cpu_s"] >= cpu_s
    summed = cpu_account.summed([where / "n-test.json", where / "n-test.json"])
    assert summed["nodes"] == 2 and summed["stages"]["FrameWriter.seal"][0] == 6


def test_without_the_variable_nothing_is_wrapped(tmp_path: Path) -> None:
    assert _run(tmp_path, None) == "off"
    assert not (tmp_path / "acct").exists()


def test_a_stage_that_is_gone_is_named_not_fatal(tmp_path: Path) -> None:
    acc = cpu_account.install("x", tmp_path, stages=(("node.frames", "NoSuchThing.seal"),
                                                     ("node.no_such_module", "f")),
                              at_exit=False)
    assert acc.stages == {}
    assert acc.missing == ["node.frames:NoSuchThing.seal", "node.no_such_module:f"]
