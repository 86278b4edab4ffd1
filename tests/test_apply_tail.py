"""Digests ahead of the commit (``swarm.codec.apply``: DENSE/FULL records' target digests
taken at decode) and the driver's low-priority prestage thread.

The committed state and its digest are bitwise the one-shot apply's, whatever the
split and the record kinds; a wrong staged value or target still rolls back
bitwise; a base that moved after the digest was taken is hashed again at commit."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import swarm.codec.apply as apply_mod
import swarm.codec.digest as digest_mod
from node.engines.inprocess import InProcessWeights
from swarm.codec import apply_patch, encode_patch, tensor_digest
from swarm.codec.apply import PatchApplier
from swarm.codec.format import decode_header, encode_header
from swarm.codec.planes import Planes
from swarm.errors import PatchApplyError

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
KINDS = ("dense", "sparse", "same", "reshape", "add", "delete")


def _finite(shape: tuple[int, ...], g: torch.Generator, dt: torch.dtype) -> torch.Tensor:
    scale = 1.0 if dt == torch.float8_e4m3fn else 0.05
    return (torch.randn(shape, generator=g) * scale).to(dt)


def _states(seed: int, kinds: list[str], dtype: str, n: int = 1536
            ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One tensor per kind: ``dense`` redrawn (DENSE), ``sparse`` ~1% changed (SPARSE,
    SPARSE_CTX for fp8), ``same`` unchanged, ``reshape`` (FULL), ``add`` (FULL of a new
    tensor), ``delete`` (DELETE)."""
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    old: dict[str, torch.Tensor] = {}
    new: dict[str, torch.Tensor] = {}
    for k, kind in enumerate(kinds):
        name = f"t{k}.{kind}"
        base = _finite((n // 32, 32), g, dt)
        if kind != "add":
            old[name] = base
        if kind == "dense":
            new[name] = _finite(base.shape, g, dt)
        elif kind == "sparse":
            t = base.float().clone().reshape(-1)
            idx = torch.randperm(t.numel(), generator=g)[: max(1, t.numel() // 100)]
            t[idx] = t[idx] * 1.5 + 0.25
            new[name] = t.reshape(base.shape).to(dt)
        elif kind == "same":
            new[name] = base.clone()
        elif kind == "reshape":
            new[name] = _finite((n // 16, 16), g, dt)
        elif kind == "add":
            new[name] = base
    if not old:
        old["keep"] = _finite((64,), g, dt)
        new["keep"] = old["keep"].clone()
    return old, new


def _bits(w: dict[str, torch.Tensor]) -> dict[str, tuple]:
    return {k: (v.dtype, tuple(v.shape), v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            for k, v in w.items()}


def _holder(old: dict[str, torch.Tensor]) -> InProcessWeights:
    return InProcessWeights({k: v.clone() for k, v in old.items()}, 1, "cpu")


def _prestaged(w: InProcessWeights, patch: bytes, base: bytes, chunk: int, fraction: float
               ) -> None:
    """Prefeed the first ``fraction`` of the chunks, stage the rest (as the driver)."""
    chunks = [patch[o:o + chunk] for o in range(0, len(patch), chunk)]
    k = int(len(chunks) * fraction)
    fed = 0
    for c in chunks[:k]:
        fed = w.prefeed(2, base, fed, c)
    assert fed == sum(len(c) for c in chunks[:k])
    w.stage(2, "patch", b"".join(chunks[k:]), base, offset=fed)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2 ** 16), dtype=st.sampled_from(sorted(DTYPES)),
       kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=5),
       chunk=st.integers(1, 8192), fraction=st.floats(0, 1), ahead=st.booleans())
def test_prestaged_commit_is_bitwise_the_one_shot_apply(seed: int, dtype: str, kinds: list[str],
                                                        chunk: int, fraction: float,
                                                        ahead: bool) -> None:
    old, new = _states(seed, kinds, dtype)
    res = encode_patch(old, new, threads=1)
    ref = {k: v.clone() for k, v in old.items()}
    report = apply_patch(ref, res.patch)  # one shot, not staged: nothing ahead
    w = _holder(old)
    w.digests_ahead = ahead
    _prestaged(w, res.patch, res.base_digest, chunk, fraction)
    digest = w.commit(2, res.target_digest)
    assert digest == report.target_digest == res.target_digest == w.digest
    assert _bits(w.weights) == _bits(ref) == _bits(new)
    # the holder's digest cache (taken ahead where it could be) is the tensors' own
    assert w.tensor_digests == {k: tensor_digest(v) for k, v in w.weights.items()}


def _dense_case(seed: int = 3, tensors: int = 4) -> tuple[dict, dict]:
    return _states(seed, ["dense"] * tensors, "bf16", n=4096)


def test_dense_commit_hashes_nothing_and_the_staged_xor_is_read_only(monkeypatch) -> None:
    """With every record decoded ahead, the commit XORs and combines digests: no tensor
    is hashed inside ``commit``; the staged XORs cannot be written."""
    old, new = _dense_case()
    res = encode_patch(old, new, threads=1)
    w = _holder(old)
    _prestaged(w, res.patch, res.base_digest, 1000, 1.0)
    applier = w._staged[2]  # type: ignore[index]
    kinds = {e.kind for e in applier.staged}
    assert kinds == {"xorflat"}
    for e in applier.staged:
        assert not e.data.flags.writeable
        with pytest.raises(ValueError):
            e.data[0] ^= 1

    def no_hash(t):  # pragma: no cover - failing is the point
        raise AssertionError("a tensor was hashed at commit")

    monkeypatch.setattr(apply_mod, "tensor_digest", no_hash)
    monkeypatch.setattr(digest_mod, "tensor_digest", no_hash)
    assert w.commit(2, res.target_digest) == res.target_digest
    assert _bits(w.weights) == _bits(new)


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("bad_record", [0, 2])
def test_a_corrupt_staged_value_rolls_back_bitwise(monkeypatch, fraction: float,
                                                   bad_record: int) -> None:
    """A DENSE record decoded into a wrong value (one flipped bit in its planes): the
    digest taken ahead is of the wrong bytes, so the commit fails and every record,
    including those committed before it, is undone bit for bit."""
    old, new = _dense_case()
    res = encode_patch(old, new, threads=1)
    real = apply_mod.read_planes
    calls = {"n": 0}

    def corrupt(body, count, itemsize, what):
        planes = real(body, count, itemsize, what)
        if calls["n"] == bad_record:
            arr = planes.array().copy()
            arr[itemsize - 1, count // 2] ^= 0x01
            planes = Planes(itemsize, count, [arr.reshape(-1)], owned=True)
        calls["n"] += 1
        return planes

    monkeypatch.setattr(apply_mod, "read_planes", corrupt)
    w = _holder(old)
    digests, state = dict(w.tensor_digests), w.digest
    _prestaged(w, res.patch, res.base_digest, 1500, fraction)
    with pytest.raises(PatchApplyError):
        w.commit(2, res.target_digest)
    assert _bits(w.weights) == _bits(old)
    assert (w.version, w.digest, w.tensor_digests) == (1, state, digests)


def _with_target(patch: bytes, target: bytes) -> bytes:
    header = decode_header(patch)
    return encode_header(header.base_digest, target, header.entries) + patch[header.header_bytes:]


@pytest.mark.parametrize("fraction", [0.0, 0.7, 1.0])
def test_a_wrong_target_digest_rolls_back_bitwise(fraction: float) -> None:
    old, new = _states(5, ["dense", "sparse", "reshape", "dense"], "bf16")
    res = encode_patch(old, new, threads=1)
    wrong = bytes(32 - len(b"x")) + b"x"
    patch = _with_target(res.patch, wrong)
    w = _holder(old)
    digests, state = dict(w.tensor_digests), w.digest
    _prestaged(w, patch, res.base_digest, 700, fraction)
    with pytest.raises(PatchApplyError, match="target"):
        w.commit(2, wrong)
    assert _bits(w.weights) == _bits(old)
    assert (w.version, w.digest, w.tensor_digests) == (1, state, digests)


def _staged_dense():
    """Two dense tensors' patch staged (digests taken ahead) on a copy of the base:
    (the new state, the encode result, the weights, the applier)."""
    old, new = _dense_case(tensors=2)
    res = encode_patch(old, new, threads=1)
    weights = {k: v.clone() for k, v in old.items()}
    applier = PatchApplier(weights, stage=True)
    applier.feed(res.patch)
    return new, res, weights, applier


def test_a_base_changed_after_the_digest_was_taken_is_hashed_at_commit() -> None:
    """The ahead digest holds only for the very base it was taken from: a base written
    in place (torch bumps its version counter) is hashed again at commit, so the
    record's digest check fails and the apply rolls back to that (changed) base."""
    _, _, weights, applier = _staged_dense()
    name = sorted(weights)[1]
    weights[name].view(torch.int16)[7] ^= 1  # in place, through torch
    moved = _bits(weights)
    with pytest.raises(PatchApplyError, match="digest"):
        applier.finish()
    assert _bits(weights) == moved


def test_a_replaced_base_tensor_is_hashed_at_commit(monkeypatch) -> None:
    """Same bits in another tensor object: not the tensor the digest was taken from, so
    it is hashed at commit (and the apply succeeds)."""
    new, res, weights, applier = _staged_dense()
    name = sorted(weights)[0]
    weights[name] = weights[name].clone()
    hashed: list[int] = []
    real = apply_mod.tensor_digest
    monkeypatch.setattr(apply_mod, "tensor_digest", lambda t: hashed.append(1) or real(t))
    assert applier.finish().target_digest == res.target_digest
    assert hashed == [1]
    assert _bits(weights) == _bits(new)


def test_ahead_and_at_commit_give_the_same_digests_for_full_records() -> None:
    old, new = _states(9, ["add", "reshape", "same"], "fp32")
    res = encode_patch(old, new, threads=1)
    out = []
    for ahead in (True, False):
        weights = {k: v.clone() for k, v in old.items()}
        digests = {k: tensor_digest(v) for k, v in weights.items()}
        applier = PatchApplier(weights, stage=True, digests=digests, ahead=ahead)
        applier.feed(res.patch)
        assert all((e.ahead is not None) == ahead for e in applier.staged if e.kind == "put")
        out.append((applier.finish().target_digest, digests, _bits(weights)))
    assert out[0] == out[1]
    assert out[0][0] == res.target_digest


# ------------------------------------------------------------ the prestage thread


def _prestage_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("prestage")]


def test_prestage_runs_in_its_own_low_priority_thread_shut_down_by_stop() -> None:
    from node.driver import PRESTAGE_NICE, Driver

    old, _ = _dense_case(tensors=1)
    w = _holder(old)

    async def main() -> None:
        drv = Driver(None, None, None, weights=w, host="127.0.0.1", port=0)  # type: ignore[arg-type]
        pool = drv._prestage_pool()
        assert drv._prestage_pool() is pool  # one, reused
        main_tid = threading.get_native_id()

        def probe() -> tuple[str, int, int | None]:
            tid = threading.get_native_id()
            prio = os.getpriority(os.PRIO_PROCESS, tid) if hasattr(os, "getpriority") else None
            return threading.current_thread().name, tid, prio

        name, tid, prio = await asyncio.get_running_loop().run_in_executor(pool, probe)
        assert name.startswith("prestage") and tid != main_tid
        if sys.platform.startswith("linux"):
            assert prio is not None and prio >= PRESTAGE_NICE
            # only that thread was lowered, not the loop's
            assert os.getpriority(os.PRIO_PROCESS, main_tid) < PRESTAGE_NICE or \
                os.getpriority(os.PRIO_PROCESS, 0) >= PRESTAGE_NICE
        assert _prestage_threads()
        await drv.stop(drain_s=0.1)
        assert drv._pre_pool is None
        assert not _prestage_threads()
        drv._prestage_kick(2)  # after stop: nothing starts again
        assert drv._pre_task is None and drv._pre_pool is None

    asyncio.run(main())
    assert not _prestage_threads()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_an_apply_waiting_for_the_prestage_raises_its_priority_until_its_next_step() -> None:
    """An apply that waits for the prestage thread's slice raises that thread to the
    loop's priority (where the system allows it), and the thread's next step lowers it
    again; where raising is refused nothing changes and the apply still waits."""
    from node.driver import PRESTAGE_NICE, Driver

    old, _ = _dense_case(tensors=1)
    w = _holder(old)

    async def main() -> None:
        drv = Driver(None, None, None, weights=w, host="127.0.0.1", port=0)  # type: ignore[arg-type]
        gate, inside = threading.Event(), threading.Event()
        seen: list[int] = []

        real_step = drv._prestage_step

        def busy_step(v: int) -> None:  # a slice's decode that takes a while
            with contextlib.suppress(AttributeError):  # the real step: no store here
                real_step(v)
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            inside.set()
            assert gate.wait(10)
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

        drv._prestage_step = busy_step  # type: ignore[method-assign]
        drv._prestage_kick(2)
        assert await asyncio.to_thread(inside.wait, 10)
        loop_prio = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        allowed = loop_prio < PRESTAGE_NICE
        try:  # can this process raise a thread's priority at all?
            os.setpriority(os.PRIO_PROCESS, drv._pre_tid, PRESTAGE_NICE + 1)
            os.setpriority(os.PRIO_PROCESS, drv._pre_tid, PRESTAGE_NICE)
        except PermissionError:
            allowed = False

        async def no_apply(version: int, t0: float) -> None:
            pass

        drv._apply_locked = no_apply  # type: ignore[method-assign]
        applying = asyncio.ensure_future(drv._apply(2))  # waits for the slice
        await asyncio.sleep(0.05)
        assert not applying.done()
        gate.set()
        await applying
        assert seen[0] >= PRESTAGE_NICE
        if allowed:
            assert drv.prestage_boosts == 1 and seen[1] == loop_prio
        else:
            assert drv.prestage_boosts == 0 and seen[1] == seen[0]
        # the thread's next step lowers it again
        gate.clear()
        inside.clear()
        drv._prestage_kick(2)
        assert await asyncio.to_thread(inside.wait, 10)
        assert seen[2] >= PRESTAGE_NICE
        gate.set()
        await asyncio.shield(drv._pre_task)
        drv._boost_prestage()  # nothing running: nothing to raise
        assert drv.prestage_boosts == (1 if allowed else 0)
        await drv.stop(drain_s=0.1)

    asyncio.run(main())


def test_lower_thread_priority_never_raises(monkeypatch) -> None:
    from node import driver

    def refuse(*a):
        raise PermissionError("no")

    if hasattr(os, "setpriority"):
        monkeypatch.setattr(os, "setpriority", refuse)
        monkeypatch.setattr(os, "getpriority", lambda *a: 0)
    driver.lower_thread_priority()  # ignored
    monkeypatch.setattr(sys, "platform", "darwin")
    driver.lower_thread_priority()  # not Linux: left alone


def test_xor_ahead_equals_the_planes_path_for_every_itemsize() -> None:
    """The fused un-shuffle + hash ahead gives the digest and XOR of the commit-time path."""
    for dtype in DTYPES:
        old, new = _states(11, ["dense"], dtype, n=70000)  # more than one block
        res = encode_patch(old, new, threads=1)
        got = []
        for ahead in (True, False):
            weights = {k: v.clone() for k, v in old.items()}
            applier = PatchApplier(weights, stage=True, ahead=ahead)
            applier.feed(res.patch)
            changes = applier.staged_changes()
            report = applier.finish()
            got.append((report.target_digest, report.changed, applier._digests,
                        [np.asarray(c[2]).tolist() for c in changes], _bits(weights)))
        assert got[0] == got[1], dtype
