"""Does the L2 prefetch of the shared experts pay, in isolation? One decode layer's shape without
the attention's own kernels: a spin kernel that leaves HBM idle for a set time (`torch.cuda._sleep`,
standing in for the attention core's latency-bound kernels), then the MoE layer (router, sort,
block kernels on two streams, pair sum), cycled over several layers' weights inside one CUDA graph.

    python scripts/bench_l2_prefetch.py [--tokens 1 8 32 128] [--idle-us 20 40] [--layers 6]

Rows, µs per layer with the idle time taken off (the spin kernel timed alone), so each is the MoE's
time after an idle window of that length:
- `no prefetch`: the default plan (moe_shared_stream on);
- `prefetch N MB [policy]`: `MoE.prefetch` forks the side stream before the idle window and asks
  L2 for N MB of the shared experts' weights (moe_shared_prefetch_mb, moe_shared_prefetch_policy);
- `..., evict-first`: with the MoE kernels' expert-weight loads at L2's evict-first priority
  (moe_evict_first_max_tokens), so the routed stream does not push the prefetched lines out;
- `evict-first alone`.
The shared experts' bytes (34.6 MB a layer for V2-Lite) at ~4.3 TB/s are ~8 µs: what the best row
can take off `no prefetch`.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from bench_common import graph_us

from common.kernel_plan import KernelPlan
from common.launch_settings import use_autotune, use_moe_evict_first
from models.config import ModelConfig
from models.loader import init_dummy_weights
from models.moe import MoE

CLOCK_GHZ = 1.98  # the H200's SM clock under load (the device notes), for the spin kernel's cycles


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="configs/models/DeepSeek-V2-Lite")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--idle-us", type=float, nargs="+", default=[20.0, 40.0])
    p.add_argument("--layers", type=int, default=6, help="layers' weights cycled through, to defeat L2")
    a = p.parse_args()
    use_autotune(True)
    cfg = ModelConfig.from_pretrained(a.model)
    base = KernelPlan(moe="triton", router="triton", moe_fused_max_tokens=4, moe_blocked_max_tokens=512,
                      moe_shared_dense_min_tokens=1024, moe_shared_stream=True)
    torch.manual_seed(0)
    layers = []
    for i in range(a.layers):
        moe = MoE(cfg, torch.bfloat16, base).cuda()
        init_dummy_weights(moe, seed=i, storage_dtype=torch.bfloat16)
        moe.gate.keep_bf16_weight()
        moe.process_weights_after_loading()
        layers.append(moe)
    shared_mb = sum(t.numel() * t.element_size() for t in (layers[0].w13[-layers[0].n_shared:],
                                                             layers[0].w2[-layers[0].n_shared:])) / 2**20
    print(f"shared experts: {shared_mb:.1f} MB a layer\n")
    variants = [("no prefetch", {}, 0)]
    for mb in (24, 40):
        variants.append((f"prefetch {mb} MB", dict(moe_shared_prefetch_mb=mb), 0))
    variants += [("prefetch 40 MB evict_last", dict(moe_shared_prefetch_mb=40,
                                                    moe_shared_prefetch_policy="evict_last"), 0),
                 ("prefetch 40 MB bulk", dict(moe_shared_prefetch_mb=40, moe_shared_prefetch_policy="bulk"), 0),
                 ("prefetch 40 MB, evict-first", dict(moe_shared_prefetch_mb=40), 1 << 20),
                 ("prefetch 24 MB, evict-first", dict(moe_shared_prefetch_mb=24), 1 << 20),
                 ("evict-first alone", {}, 1 << 20)]
    print("| tokens | idle µs | row | µs per layer, idle taken off |\n|---|---|---|---|")
    for T in a.tokens:
        xs = [torch.randn(T, cfg.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in layers]
        calls = list(zip(layers, xs))
        for idle in a.idle_us:
            cycles = int(idle * CLOCK_GHZ * 1e3)
            spin = graph_us(lambda m, x: torch.cuda._sleep(cycles), calls)
            for name, over, evict in variants:
                plan = dataclasses.replace(base, **over)
                for m in layers:
                    m.plan, m._prefetch_ranges = plan, None

                def layer(m, x):
                    m.prefetch(T, x.device)  # forks before the idle window, where the model would
                    torch.cuda._sleep(cycles)
                    return m(x)
                use_moe_evict_first(evict)
                try:
                    us = graph_us(layer, calls)
                finally:
                    use_moe_evict_first(0)
                print(f"| {T} | {idle:.0f} (spin {spin:.1f}) | {name} | {us - spin:.1f} |", flush=True)


if __name__ == "__main__":
    main()
