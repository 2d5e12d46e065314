"""Weight sync of one model across two emulated hosts: the trainer on host 0, one vLLM replica on
host 1, over each transport (``nccl`` sockets, ``rdma``: Monarch's TCP fallback here); no training,
so the full 8B shape fits one GPU per host. Run by tests/gpu/two_hosts.sh, which starts the two
workers (``python -m launch.bootstrap worker``, the entry point every SLURM/SkyPilot node runs).

    python -m tests.gpu.sync_two_hosts --model llama3_8b --port 26600 [--reps 3] [--out sync.json]

Prints one JSON line per transport: transfer seconds and GB/s (bytes on the wire, while the engine
could generate), the load seconds (the time generation waits: staged bytes -> engine weights), and
whether every TP rank of the engine holds the trainer's weights bit for bit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os


async def main_async(a) -> list:
    from forge_core.config import load_config
    from forge_core.layout import plan_layout
    from forge_core.services import call, spawn_service
    from launch import bootstrap

    cluster = bootstrap.Cluster(0, ["127.0.0.1", "127.0.0.2"], a.port)
    mesh = await bootstrap.attach(cluster, 300)
    cfg = load_config("llama3_8b" if a.model.startswith("llama3") else "qwen3_8b", [
        f"model.name={a.model}", "model.init=random", "layout.nodes=2", "layout.gpus_per_node=1",
        "layout.generator.host=1", "layout.generator.tp=1", "layout.generator.replicas=1", "layout.trainer.host=0",
        "layout.trainer.gpus=1", "layout.reference.host=0", "layout.reference.gpus=0",
        "generator.gpu_memory_utilization=0.5", "generator.max_prompt_tokens=256", "generator.max_response_tokens=256",
        f"data.dir={os.environ.get('GSM8K_DIR', '')}"])
    plan = plan_layout(cfg)
    out = []
    t = await spawn_service(cfg, "trainer", plan.trainer, plan, mesh)
    g = await spawn_service(cfg, "generator", plan.generators[0], plan, mesh)
    try:
        for generation, transport in enumerate(a.transports.split(",")):
            fetch, load = [], []
            for _ in range(a.reps if transport == "nccl" else 1):
                h = await call("trainer", t.publish, transport == "rdma", 2 if transport == "nccl" else 0, generation)
                fetch.append(await call("receiver", g.receiver.fetch, h, transport, 1))
                load.append(await call("generator", g.update_weights, h, True))
            bad = await call("generator", g.weights_match)
            best = min(range(len(fetch)), key=lambda i: fetch[i]["transfer_s"])
            r = {"model": a.model, "transport": transport, "gb": h.nbytes / 1e9, "transfer_s": fetch[best]["transfer_s"],
                 "transfer_gb_s": fetch[best]["gb_s"], "load_s": min(x["sync_s"] for x in load),
                 "bit_identical": not bad, "mismatched": bad[:3],
                 "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}
            print(json.dumps(r), flush=True)
            out.append(r)
    finally:
        await g.stop(60)
        await t.stop(60)
        await mesh.shutdown()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3_8b")
    p.add_argument("--port", type=int, default=26600)
    p.add_argument("--reps", type=int, default=3, help="transfers per transport (rdma: one, it is slow)")
    p.add_argument("--transports", default="nccl,rdma")
    p.add_argument("--out", default="")
    a = p.parse_args()
    res = asyncio.run(main_async(a))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
