"""Structured node logs: protocol fields survive as data in both formats."""

from __future__ import annotations

import json
import logging

from node.logs import JsonFormatter, TextFormatter


def _record(**fields) -> logging.LogRecord:
    rec = logging.LogRecord("patchswarm.node", logging.WARNING, __file__, 1, "peer_closed", (), None)
    rec.fields = fields
    return rec


def test_json_lines_carry_event_and_fields():
    line = JsonFormatter("n0-1").format(_record(reason="bad frame", conn=7, peer=None))
    obj = json.loads(line)
    assert obj["msg"] == "peer_closed" and obj["level"] == "warning" and obj["node"] == "n0-1"
    assert obj["reason"] == "bad frame" and obj["conn"] == 7 and obj["peer"] is None


def test_text_lines_are_key_value():
    line = TextFormatter("n0-1").format(_record(reason="x", conn=7))
    assert line.endswith("n0-1 WARNING peer_closed reason=x conn=7")


def test_log_format_validated(tmp_path):
    import pytest

    from node.config import parse_config
    from swarm.errors import ConfigError
    from tests.test_node_config import _doc

    assert parse_config(_doc(log={"format": "json"}), tmp_path).log_format == "json"
    with pytest.raises(ConfigError, match=r"log\.format"):
        parse_config(_doc(log={"format": "xml"}), tmp_path)
