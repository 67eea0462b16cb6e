"""``llmserve serve`` options for engine replicas and the router, and the addresses they name."""

from __future__ import annotations

import argparse
from pathlib import Path

from gateway.router import RoutingPolicy


def add_replica_options(p: argparse.ArgumentParser) -> None:
    d = RoutingPolicy()
    g = p.add_argument_group("replicas and routing")
    g.add_argument(
        "--engines-file",
        metavar="PATH",
        help="engine addresses, one per line ('#' comments), added to any --engine",
    )
    g.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="K",
        help="start K local engine processes (each its own KV pool) behind the router",
    )
    g.add_argument(
        "--route-prefix-blocks",
        type=int,
        default=d.prefix_blocks,
        help="full prompt blocks hashed for prefix affinity",
    )
    g.add_argument(
        "--route-balance-abs",
        type=float,
        default=d.balance_abs,
        help="a replica yields its affinity when it has this many more requests than the least loaded...",
    )
    g.add_argument(
        "--route-balance-rel",
        type=float,
        default=d.balance_rel,
        help="...and this many times its load",
    )


def read_engines_file(path: str | Path) -> list[str]:
    out = []
    for line in Path(path).read_text().splitlines():
        address = line.split("#", 1)[0].strip()
        if address:
            out.append(address)
    return out


def engine_addresses(args) -> list[str]:
    """Every engine named by --engine (repeatable) and --engines-file, in order, checked."""
    addresses = list(args.engine or [])
    if args.engines_file:
        addresses += read_engines_file(args.engines_file)
    if len(addresses) != len(set(addresses)):
        raise ValueError(f"an engine address is named twice: {addresses}")
    if addresses and args.replicas > 1:
        raise ValueError("--replicas starts local engines; it does not combine with --engine/--engines-file")
    if args.replicas < 1:
        raise ValueError("--replicas must be at least 1")
    return addresses


def routing_policy(args) -> RoutingPolicy:
    if args.route_prefix_blocks < 1 or args.route_balance_abs < 0 or args.route_balance_rel < 1:
        raise ValueError(
            "routing: --route-prefix-blocks >= 1, --route-balance-abs >= 0, --route-balance-rel >= 1"
        )
    return RoutingPolicy(
        prefix_blocks=args.route_prefix_blocks,
        balance_abs=args.route_balance_abs,
        balance_rel=args.route_balance_rel,
    )
