"""Node config validation: every mistake is a ConfigError naming its key."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.config import load_config, parse_config
from swarm.errors import ConfigError

SECRET = "ab" * 32


def _doc(**over: dict) -> dict:
    d = {
        "node": {"id": "n1", "region": "r1", "model": "m"},
        "network": {"listen": "127.0.0.1:7400", "bootstrap": ["127.0.0.1:7401"],
                    "swarm_secret": SECRET},
        "trust": {"trainer_keys": ["trainer.pub"]},
        "store": {"dir": "store"},
        "weights": {"base": "base.safetensors"},
    }
    for section, values in over.items():
        d.setdefault(section, {}).update(values)
    return d


def test_valid_config_resolves_paths_and_core_knobs(tmp_path: Path) -> None:
    cfg = parse_config(_doc(swarm={"mesh_degree": 5, "heartbeat_s": 2}), tmp_path)
    assert cfg.store_dir == tmp_path / "store"
    assert cfg.trainer_keys == (tmp_path / "trainer.pub",)
    core = cfg.core_config()
    assert core.mesh_degree == 5 and core.heartbeat_s == 2.0
    assert core.active_version == 1 and core.listen_addr == "127.0.0.1:7400"
    assert cfg.unsent_limit_kib == 128  # the shipped default
    assert parse_config(_doc(network={"unsent_limit_kib": 0}), tmp_path).unsent_limit_kib == 0
    assert cfg.warm_memory_mib == 256
    assert parse_config(_doc(node={"warm_memory_mib": 0}), tmp_path).warm_memory_mib == 0
    assert cfg.read_coalesce_ms == 2.0
    assert cfg.congestion_control == "bbr"
    assert parse_config(_doc(network={"congestion_control": ""}), tmp_path).congestion_control == ""
    assert parse_config(_doc(network={"read_coalesce_ms": 0}), tmp_path).read_coalesce_ms == 0
    assert cfg.read_lowat_kib == 256
    assert parse_config(_doc(network={"read_lowat_kib": 0}), tmp_path).read_lowat_kib == 0
    assert cfg.frames is True
    assert cfg.max_block_kib == 1024
    assert parse_config(_doc(network={"max_block_kib": 256}), tmp_path).max_block_kib == 256
    assert parse_config(_doc(network={"frames": False}), tmp_path).frames is False
    assert cfg.congestion_restart_s == 1.0
    assert parse_config(_doc(network={"congestion_restart_s": 0}),
                        tmp_path).congestion_restart_s == 0
    assert (cfg.lanes, cfg.lanes_auto) == (4, True)  # "auto" unless set
    assert parse_config(_doc(network={"lanes": 8}), tmp_path).lanes == 8
    auto = parse_config(_doc(network={"lanes": "auto"}), tmp_path)
    assert (auto.lanes, auto.lanes_auto) == (4, True)
    assert parse_config(_doc(network={"lanes": 4}), tmp_path).lanes_auto is False
    assert (cfg.warm_up_kib, cfg.warm_up_min_rtt_ms) == (0, 20.0)  # node.warm_up: a node's off
    assert cfg.congestion_restart_idle_s == 0.2
    assert parse_config(_doc(network={"congestion_restart_idle_s": 0}),
                        tmp_path).congestion_restart_idle_s == 0
    on = parse_config(_doc(network={"warm_up_kib": 512, "warm_up_min_rtt_ms": 0}), tmp_path)
    assert (on.warm_up_kib, on.warm_up_min_rtt_ms) == (512, 0.0)


@pytest.mark.parametrize(("over", "key"), [
    ({"network": {"listen": "nohost"}}, "network.listen"),
    ({"network": {"congestion_control": "BBR; rm"}}, "network.congestion_control"),
    ({"network": {"congestion_control": 1}}, "network.congestion_control"),
    ({"network": {"warm_up_kib": 32 * 1024 + 1}}, "network.warm_up_kib"),
    ({"network": {"congestion_restart_idle_s": 0.001}}, "network.congestion_restart_idle_s"),
    ({"network": {"warm_up_kib": "lots"}}, "network.warm_up_kib"),
    ({"network": {"read_lowat_kib": 4097}}, "network.read_lowat_kib"),
    ({"network": {"frames": "yes"}}, "network.frames"),
    ({"network": {"max_block_kib": 512 + 1}}, "network.max_block_kib"),
    ({"network": {"max_block_kib": 128}}, "network.max_block_kib"),
    ({"network": {"max_block_kib": 2048}}, "network.max_block_kib"),
    ({"network": {"max_block_kib": "1MiB"}}, "network.max_block_kib"),
    ({"network": {"read_lowat_kib": -1}}, "network.read_lowat_kib"),
    ({"network": {"warm_up_min_rtt_ms": -1}}, "network.warm_up_min_rtt_ms"),
    ({"network": {"warm_up_min_rtt_ms": True}}, "network.warm_up_min_rtt_ms"),
    ({"network": {"listen": "h:99999"}}, "network.listen"),
    ({"network": {"bootstrap": [1]}}, "network.bootstrap[0]"),
    ({"network": {"swarm_secret": "zz"}}, "network.swarm_secret"),
    ({"network": {"swarm_secret": "ab"}}, "network.swarm_secret"),
    ({"node": {"role": "king"}}, "node.role"),
    ({"node": {"id": ""}}, "node.id"),
    ({"store": {"quota_bytes": -1}}, "store.quota_bytes"),
    ({"network": {"unsent_limit_kib": -1}}, "network.unsent_limit_kib"),
    ({"network": {"unsent_limit_kib": "128"}}, "network.unsent_limit_kib"),
    ({"network": {"read_coalesce_ms": -1}}, "network.read_coalesce_ms"),
    ({"network": {"read_coalesce_ms": 51}}, "network.read_coalesce_ms"),
    ({"network": {"read_coalesce_ms": True}}, "network.read_coalesce_ms"),
    ({"network": {"lanes": 0}}, "network.lanes"),
    ({"network": {"lanes": 17}}, "network.lanes"),
    ({"network": {"lanes": "4"}}, "network.lanes"),
    ({"network": {"lanes": "Auto"}}, "network.lanes"),
    ({"network": {"lanes": True}}, "network.lanes"),
    ({"network": {"congestion_restart_s": 0.01}}, "network.congestion_restart_s"),
    ({"network": {"congestion_restart_s": -1}}, "network.congestion_restart_s"),
    ({"network": {"congestion_restart_s": False}}, "network.congestion_restart_s"),
    ({"network": {"congestion_restart_s": "1"}}, "network.congestion_restart_s"),
    ({"store": {"fsync": "yes"}}, "store.fsync"),
    ({"node": {"warm_memory_mib": -1}}, "node.warm_memory_mib"),
    ({"node": {"warm_memory_mib": 4096}}, "node.warm_memory_mib"),
    ({"node": {"warm_memory_mib": "256"}}, "node.warm_memory_mib"),
    ({"weights": {"device": "tpu"}}, "weights.device"),
    ({"weights": {"base_version": 0}}, "weights.base_version"),
    ({"trust": {"trainer_keys": []}}, "trust.trainer_keys"),
    ({"trust": {"trainer_keys": ["ok.pub", 7]}}, "trust.trainer_keys[1]"),
    ({"swarm": {"mesh_degree": "six"}}, "swarm.mesh_degree"),
    ({"swarm": {"no_such_knob": 1}}, "swarm.no_such_knob"),
    ({"swarm": {"node_id": "x"}}, "swarm.node_id"),
    ({"swarm": {"pipeline": 0}}, "pipeline"),
    ({"bogus": {"x": 1}}, "bogus"),
    ({"store": {"dirr": "x"}}, "store.dirr"),
])
def test_bad_values_name_their_key(tmp_path: Path, over: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        parse_config(_doc(**over), tmp_path)


@pytest.mark.parametrize(("content", "why"), [
    (None, "larger than 4096 bytes"),  # /dev/zero: must not read without bound
    (bytes(range(256)), "is binary"),
    (b"zz" * 16, "expected hex digits"),
])
def test_secret_file_errors_name_the_key(tmp_path: Path, content: bytes | None, why: str) -> None:
    path = Path("/dev/zero") if content is None else tmp_path / "secret"
    if content is not None:
        path.write_bytes(content)
    doc = _doc()
    del doc["network"]["swarm_secret"]
    doc["network"]["swarm_secret_file"] = str(path)
    with pytest.raises(ConfigError, match=r"network\.swarm_secret(_file)?: .*" + why):
        parse_config(doc, tmp_path)


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize(("knob", "value"), [
    ("heartbeat_s", INF), ("peer_timeout_s", INF), ("have_batch_s", INF), ("redial_s", -1),
    ("redial_s", NAN), ("ban_s", NAN), ("slow_factor", NAN), ("max_known_peers", -1),
    ("tracker_sample", -1), ("max_timeouts", -1), ("endgame_chunks", -1), ("heartbeat_s", 0),
    ("request_timeout_s", -INF), ("upload_slots", 0), ("peer_timeout_s", 0.5),
    ("cold_path_factor", -1), ("cold_path_factor", NAN),
])
def test_knob_ranges_name_the_knob(tmp_path: Path, knob: str, value: float) -> None:
    """The audit's list (issue #10): every one was accepted before."""
    with pytest.raises(ConfigError, match=knob):
        parse_config(_doc(swarm={knob: value}), tmp_path)


def test_knob_ranges_from_toml_literals(tmp_path: Path) -> None:
    import tomllib

    doc = _doc()
    doc["swarm"] = tomllib.loads("[swarm]\nban_s = nan\nheartbeat_s = inf\n")["swarm"]
    with pytest.raises(ConfigError, match=r"ban_s|heartbeat_s"):
        parse_config(doc, tmp_path)


def test_plaintext_on_a_public_address_needs_to_be_asked_for(tmp_path: Path) -> None:
    doc = _doc(network={"listen": "0.0.0.0:7400"})
    with pytest.raises(ConfigError, match=r"tls: a node listening on 0\.0\.0\.0 needs \[tls\]"):
        parse_config(doc, tmp_path)
    doc["network"]["allow_plaintext"] = True
    assert parse_config(doc, tmp_path).tls is None


def test_origin_needs_a_signing_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"publish\.signing_key"):
        parse_config(_doc(node={"role": "origin"}), tmp_path)


def test_an_origin_warms_its_long_links_by_default(tmp_path: Path) -> None:
    """node.warm_up ships on for the origin (its pushes start from an open window) and off
    for a node; set, either is as given."""
    origin = {"node": {"role": "origin"}, "publish": {"signing_key": "trainer.key"}}
    assert parse_config(_doc(**origin), tmp_path).warm_up_kib == 512
    assert parse_config(_doc(**origin, network={"warm_up_kib": 0}), tmp_path).warm_up_kib == 0
    assert parse_config(_doc(), tmp_path).warm_up_kib == 0
    assert parse_config(_doc(network={"warm_up_kib": 64}), tmp_path).warm_up_kib == 64


def test_an_origin_warms_more_heap_by_default(tmp_path: Path) -> None:
    """An origin's encode needs several views' worth of buffers: its default warm heap
    is DEFAULT_ORIGIN_WARM_MEMORY_MIB, a node's stays 256; set, either is as given."""
    from node.config import DEFAULT_ORIGIN_WARM_MEMORY_MIB

    origin = {"node": {"role": "origin"}, "publish": {"signing_key": "trainer.key"}}
    assert parse_config(_doc(**origin), tmp_path).warm_memory_mib == DEFAULT_ORIGIN_WARM_MEMORY_MIB == 1024
    origin["node"]["warm_memory_mib"] = 0
    assert parse_config(_doc(**origin), tmp_path).warm_memory_mib == 0
    assert parse_config(_doc(), tmp_path).warm_memory_mib == 256


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[node\nid=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_example_configs_parse(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parent.parent / "configs"
    from swarm.trust import ca

    ca.init_ca(tmp_path / "tls" / "ca")
    (tmp_path / "tls" / "ca.crt").write_bytes((tmp_path / "tls" / "ca" / "ca.crt").read_bytes())
    ca.issue(tmp_path / "tls" / "ca", "rollout-use1-a", region="us-east-1", out_dir=tmp_path / "tls")
    ca.issue(tmp_path / "tls" / "ca", "trainer", region="trainer", role="origin",
             out_dir=tmp_path / "tls")
    for name in ("node.toml", "trainer.toml"):
        (tmp_path / "swarm.secret").write_text(SECRET)
        text = (root / name).read_text()
        (tmp_path / name).write_text(text)
        cfg = load_config(tmp_path / name)
        assert cfg.model == "all-MiniLM-L6-v2"
        assert cfg.tls is not None and cfg.api_listen == ("127.0.0.1", 7401)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(["node", "network", "store", "weights", "swarm", "x"]),
                       st.dictionaries(st.text(max_size=12),
                                       st.one_of(st.integers(), st.text(max_size=8),
                                                 st.booleans(), st.lists(st.integers(), max_size=2)),
                                       max_size=4), max_size=5))
def test_arbitrary_documents_never_crash(doc: dict) -> None:
    with contextlib.suppress(ConfigError):
        parse_config(doc, Path("/nonexistent"))


def test_a_one_shot_publish_warms_only_what_one_version_needs(tmp_path: Path) -> None:
    """``patchswarm publish`` publishes one version: the origin's larger default heap and
    its link warm-ups are for a long-running one's later versions, so it takes a node's
    defaults at most (no heap past 256 MiB, no padding)."""
    from trainer.cli_publish import one_version

    origin = {"node": {"role": "origin"}, "publish": {"signing_key": "trainer.key"}}
    cut = one_version(parse_config(_doc(**origin), tmp_path))
    assert (cut.warm_memory_mib, cut.warm_up_kib) == (256, 0)
    origin["node"]["warm_memory_mib"] = 64
    assert one_version(parse_config(_doc(**origin), tmp_path)).warm_memory_mib == 64
