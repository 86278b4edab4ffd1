"""``benchmarks/bench_handoff.py`` runs end to end on a tiny view and refuses bad input."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import bench_handoff  # noqa: E402


def test_bench_handoff_times_both_shapes(tmp_path: Path, capsys) -> None:
    out = tmp_path / "h.json"
    assert bench_handoff.main(["--mib", "1", "--versions", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert [r["shape"] for r in res] == ["sparse", "dense"]
    for r in res:
        assert len(r["rows"]) == 2
        for row in r["rows"]:
            assert 0 < row["handoff_s"] <= row["handoff_plus_view_s"]
    sparse, dense = (r["median"]["patch_bytes"] for r in res)
    assert sparse < dense / 10  # 1 % of the values moved against all of them
    assert "hand-off s" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--mib", "0"], ["--versions", "0"], ["--sparse-pct", "0"],
                                  ["--sparse-pct", "101"]])
def test_bench_handoff_refuses_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bench_handoff.main(argv)
    assert e.value.code == 2
