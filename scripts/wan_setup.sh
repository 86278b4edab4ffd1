#!/bin/sh
# Set-up for the emulated-WAN benchmark (benchmarks/bench_wan.py) and its slow test
# (tests/test_wan_lab.py), as root on Debian/Ubuntu:
#   - nftables and iptables: the lab's delay rules (this kernel build has no nft
#     `queue` expression, so the NFQUEUE target goes in through iptables-nft);
#   - the `wan` extra: fnfqueue (the holder's NFQUEUE binding) and libtorrent (the
#     comparison), at the versions pinned in constraints.txt.
# Usage: scripts/wan_setup.sh [VENV]   (default: .venv in the repository root)
set -eu
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
if [ "$(id -u)" != 0 ]; then
    echo "wan_setup: run as root (network namespaces, nftables)" >&2
    exit 2
fi
if ! command -v nft >/dev/null 2>&1 || ! command -v iptables-nft >/dev/null 2>&1; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q nftables iptables
fi
[ -x "$VENV/bin/pip" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q -c constraints.txt -e '.[test,wan]'
"$VENV/bin/python" -c "from lab.netlab import delay_available as d; w = d(); print(w or 'emulated WAN: ready'); raise SystemExit(1 if w else 0)"
