"""The per-node entry point of multi-node launchers (SLURM and SkyPilot run this on every node).

    python -m launch.node --from slurm|sky RECIPE [overrides ...]

Every node runs a Monarch worker. Node rank 0 also runs the controller on the host mesh of all
workers, so the recipe's ``layout`` places each service on its node (:func:`run_node`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from typing import Optional, Sequence

from launch import bootstrap


async def _controller(cluster: bootstrap.Cluster, cfg, out: str, timeout_s: float) -> dict:
    from forge_core.controller import Controller

    mesh = await bootstrap.attach(cluster, timeout_s)
    try:
        return await Controller(cfg, out, hosts=mesh).run()
    finally:
        with contextlib.suppress(Exception):
            await mesh.shutdown()


def run_node(source: str, recipe: str, overrides: Sequence[str], attach_timeout_s: float) -> Optional[dict]:
    """This node's part of a multi-node run; raises instead of returning an exit code.

    Node rank > 0 runs its worker until the controller shuts the mesh down and returns ``None``.
    Node rank 0 checks the config against the allocation, this machine (:func:`launch.local.preflight`),
    the data and the reward (:func:`launch.local.check_task`, as ``make check``), starts its own worker,
    attaches to all (bounded by ``attach_timeout_s``) and runs the controller; returns the last step's metrics.
    Raises:
        ConfigError / PreflightError: bad recipe, or ``layout.nodes`` != the allocation's nodes.
        DataError / RewardError: bad data (names the file, line and the row's fields) or a failing reward.
        bootstrap.WorkerUnreachable: a worker was not up within the timeout (names its address).
        bootstrap.PortInUse: this node's worker port is taken (names address and port).
    """
    cluster = bootstrap.CLUSTER_FROM[source]()
    # the address the other nodes reach this one at (the worker's): where its actors listen for
    # weight transfers (forge_core.actors.placement), rather than the first of `hostname -I`
    os.environ["FORGE_NODE_ADDR"] = bootstrap.node_address(cluster)
    if not cluster.is_controller:
        print(f"[node] worker {bootstrap.worker_address(cluster)} (node {cluster.node_rank}/{cluster.num_nodes})",
              flush=True)
        bootstrap.run_worker(cluster)
        return None

    from forge_core.config import ConfigError, load_config
    from launch.local import check_task, preflight, run_dir

    cfg = load_config(recipe, list(overrides))
    if cfg.layout.nodes != cluster.num_nodes:
        raise ConfigError(f"layout.nodes={cfg.layout.nodes} but the allocation has {cluster.num_nodes} node(s) "
                          f"({', '.join(cluster.hosts)})")
    preflight(cfg)
    print(f"[node] {check_task(cfg)}", flush=True)
    worker = bootstrap.start_worker_background(cluster)
    try:
        out = run_dir(cfg)
        print(f"[node] controller on {cluster.hosts[0]}, workers {', '.join(cluster.hosts)}; run directory: {out}",
              flush=True)
        return asyncio.run(_controller(cluster, cfg, out, attach_timeout_s))
    finally:
        bootstrap.stop(worker)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run this node's part; returns the exit code (2: config, pre-flight, data or reward error; 3:
    workers unreachable or this node's worker port taken)."""
    p = argparse.ArgumentParser(prog="python -m launch.node", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", choices=["slurm", "sky"], required=True)
    p.add_argument("--attach-timeout", type=float, default=float(os.environ.get("FORGE_ATTACH_TIMEOUT", 300)))
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", default=[])
    a = p.parse_args(argv)

    from forge_core.config import ConfigError
    from forge_core.data import DataError
    from forge_core.rewards import RewardError
    from launch.local import PreflightError

    bad_input = (ConfigError, PreflightError, DataError, RewardError)
    try:
        run_node(a.source, a.recipe, a.overrides, a.attach_timeout)
        return 0
    except (*bad_input, bootstrap.WorkerUnreachable, bootstrap.PortInUse) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, bad_input) else 3


if __name__ == "__main__":
    sys.exit(main())
