"""``benchmarks/bench_node_cpu.py``'s sorting of py-spy's native stacks into stages."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_node_cpu as bench

WRITER = ["_run_module_as_main (<frozen runpy>:198)", "Handle__run (loop.c:70935)",
          "task_step_impl (_asynciomodule.c:2704)", "Driver._writer (node/driver.py:714)",
          "Link.send_nowait (node/link.py:630)", "TlsProtocol.write_app (node/tls_layer.py:546)"]


def test_a_system_call_under_the_driver_is_a_system_call_not_the_drivers_python() -> None:
    """py-spy's samples from round 57's loopback run: the kernel's send (``writev``) under
    the driver's writer went to "driver (Python)"; it is the syscall's."""
    send = [*WRITER, "writelines (loop.c:110523)", "uv__try_write (stream.c:813)",
            "writev (libc.so.6)"]
    assert bench.classify(send) == "event loop / syscalls"
    assert bench.classify(WRITER) == "driver (Python)"  # the driver's own Python


def test_native_work_keeps_its_stage_whatever_calls_it() -> None:
    """A hash, a cipher or a store write keeps its stage above Python frames, also where
    its leaf is a libc copy."""
    sealed = [*WRITER, "FrameWriter.seal (node/frames.py:130)", "EVP_EncryptUpdate (libcrypto.so.3)"]
    assert bench.classify(sealed) == "TLS (OpenSSL)"
    hashed = ["Driver._filled (node/driver.py:908)", "blake3_hash_many_avx512 (blake3.so)",
              "memcpy (libc.so.6)"]
    assert bench.classify(hashed) == "hash (BLAKE3)"
    stored = ["ChunkStore._atomic_write (node/store.py:610)", "write (libc.so.6)"]
    assert bench.classify(stored) == "store write"


def test_a_thread_waiting_is_left_out() -> None:
    idle = ["_worker (concurrent/futures/thread.py:81)", "_queue_SimpleQueue_get_impl (_queuemodule.c:207)",
            "PyThread_acquire_lock_timed (libpython3.11.so.1.0)", "do_futex_wait (libc.so.6)",
            "__futex_abstimed_wait_common (libc.so.6)"]
    assert bench.classify(idle) == "(waiting)"
