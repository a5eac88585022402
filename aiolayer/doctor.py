"""``aiolayer doctor``: checks a P and a D across hosts for what is commonly set up wrong, one line per
check (OK, FAIL or SKIP) with how to fix each failure; exits 1 if any check failed.

Each side is given by its control endpoint (``tcp://host:port``) and/or a JSON file of its vLLM
``kv_connector_extra_config`` (the endpoint then comes from its ``transport`` and ``control_port``).
What each side runs is learnt from it over the control plane (``TopologyRequest``: identity, versions,
layout summary, Mooncake settings), never taken from the command line. The data path is tried with a
small verified transfer from a temporary runtime here toward D (``doctor_transfer``), so run the
doctor on P's host. Nothing here imports torch: ``aiolayer doctor --help`` stays cheap.
"""

from __future__ import annotations

import argparse
import sys

from .config import Timeouts
from .doctor_checks import (FAIL, PASS, SKIP, Check, Side, check_advertised, check_config, check_layout,
                            check_mooncake, check_protocol, check_reach, check_version, endpoint_from_config,
                            load_config)


def add_doctor_args(p: argparse.ArgumentParser) -> None:
    for side, who in (("p", "P (prefill)"), ("d", "D (decode)")):
        p.add_argument(f"--{side}-control", default="", help=f"{who}'s control endpoint, tcp://HOST:PORT")
        p.add_argument(f"--{side}-config", default="",
                       help=f"a JSON file of {who}'s kv_connector_extra_config (or of the kv_transfer_config "
                            "holding it): checked, and its control endpoint taken from it unless given")
    p.add_argument("--timeout", type=float, default=Timeouts().control_call,
                   help="seconds each control call may take (Timeouts.control_call)")
    p.add_argument("--bind-host", default="",
                   help="this host's address for the test transfer; empty: the one that routes to D")
    p.add_argument("--blocks", type=int, default=16, help="blocks of D's layout the test transfer writes")
    p.add_argument("--no-transfer", action="store_true", help="skip the data-path check (the test transfer)")


def run_doctor(args: argparse.Namespace) -> int:
    if args.blocks < 1 or not args.timeout > 0:
        print("aiolayer doctor: --blocks must be >= 1 and --timeout > 0", file=sys.stderr)
        return 2
    p, d = Side("P"), Side("D")
    checks: list[Check] = []
    for side, control, config in ((p, args.p_control, args.p_config), (d, args.d_control, args.d_config)):
        side.endpoint = control
        if config:
            checks.append(read_config(side, config))
    from .doctor_transfer import check_transfer, probe

    probe([s for s in (p, d) if s.endpoint], args.timeout)
    checks += [check_reach(p, args.timeout), check_reach(d, args.timeout), check_protocol(p, d),
               check_version(p, d), check_layout(p, d), check_advertised(p, d), check_advertised(d, p),
               check_mooncake(p, d)]
    ready = all(c.result == PASS for c in checks if c.name in ("reach D", "layout", "advertise D"))
    if args.no_transfer:
        checks.append(Check("data path", SKIP, "--no-transfer"))
    elif not ready:
        checks.append(Check("data path", SKIP, "D unreachable, or its layout or address wrong (above)"))
    else:
        checks.append(check_transfer(p, d, args))
    for check in checks:
        print(check.line(), flush=True)
    failed = [c.name for c in checks if c.result == FAIL]
    print(f"{len(failed)} check(s) failed: {', '.join(failed)}" if failed else "all checks passed")
    return 1 if failed else 0


def read_config(side: Side, path: str) -> Check:
    try:
        side.config, side.outer = load_config(path)
    except (OSError, ValueError) as exc:
        return Check(f"config {side.label}", FAIL, f"cannot read {path}: {exc}",
                     "give a JSON file holding the kv_connector_extra_config object")
    side.endpoint = side.endpoint or endpoint_from_config(side.config, side.outer)
    return check_config(side)
