"""The peers' pinned sources: CleanRL's SAC (benchmarks/sac/vs_cleanrl.py, sac_ladder.py) and LeanRL's compiled
SAC (vs_cleanrl.py --system leanrl), got at run time (benchmarks/peers/pinned.py) and never committed here.

    python -m benchmarks.peers.sources [--peer cleanrl|leanrl] [--src DIR]   # fetch (or check DIR); print it
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.peers.pinned import Pinned, PeerSourceError, PeerSourceMissing  # noqa: F401  (the callers' errors)

CLEANRL = Pinned(
    name="CleanRL", repo="vwxyzjn/cleanrl", commit="fe8d8a03c41a7ef5b523e2e354bd01c363e786bb",
    files={  # MIT
        "cleanrl/sac_continuous_action.py": "f411ff829c864f1312dbca6a01b7a8c8830a4d9640e37beffa41630ff71bb7e0",
        "cleanrl_utils/buffers.py": "b43d54020783ac53f7d23fe7c0ed72aff20e1f377a633d134d66eb9bdbece4b8",
        "cleanrl_utils/__init__.py": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        "LICENSE": "c6c269472eecb009754856b5fe1029ee53b99b986f57bf22ad7c747b04799c69",
    },
    script="cleanrl/sac_continuous_action.py", env_var="HPCRL_CLEANRL_SRC", flag="--cleanrl-src")

LEANRL = Pinned(
    name="LeanRL", repo="meta-pytorch/LeanRL", commit="760837e0844e32bb5e1b06afb612ac694f7240ca",
    files={  # MIT
        "leanrl/sac_continuous_action_torchcompile.py": "b0cb8f80eaf10c51ce2791a6c046cd596f596b876fdac867f423fcbecf9d2e35",
        "LICENSE": "5ee733ff54d624d73a0bb13f18cac3ee0297ad1e0014d680bdf3954157dc956e",
    },
    script="leanrl/sac_continuous_action_torchcompile.py", env_var="HPCRL_LEANRL_SRC", flag="--leanrl-src")

PEERS = {"cleanrl": CLEANRL, "leanrl": LEANRL}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", choices=sorted(PEERS), default="cleanrl")
    ap.add_argument("--src", default=None, help="a checkout of the peer's repository at the pinned commit")
    a = ap.parse_args(argv)
    try:
        print(PEERS[a.peer].locate(a.src))
    except PeerSourceError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
