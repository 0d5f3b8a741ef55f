"""First call of SDPA on 30 new key lengths each, in the shape of engine/model/attention.py's masked
query blocks (SmolLM2's heads), with cuDNN's attention on and off (docs/benchmarks/gpu.md).

Run on a CUDA machine: python3 scripts/sdpa_new_shapes.py
"""

import time

import torch
import torch.nn.functional as F

dev, dt = "cuda", torch.float16


def mask(end, rows):
    hidden = torch.arange(end, device=dev)[None, :] > rows[:, None]
    return torch.zeros(hidden.shape, dtype=dt, device=dev).masked_fill_(hidden, float("-inf"))


def run(name, base, fold):
    times = []
    for j in range(30):
        end = base + 13 * j
        q = torch.randn(9, 128, 64, device=dev, dtype=dt)
        k, v = (
            torch.randn(3, end, 64, device=dev, dtype=dt),
            torch.randn(3, end, 64, device=dev, dtype=dt),
        )
        rows = torch.sort(torch.randperm(end, device=dev)[:128]).values
        rows[-1] = end - 1
        m = mask(end, rows)
        torch.cuda.synchronize()
        t = time.perf_counter()
        if fold:
            F.scaled_dot_product_attention(
                q.reshape(3, 384, 64)[None], k[None], v[None], attn_mask=m.repeat(3, 1)
            )
        else:
            F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=m, enable_gqa=True)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    print(
        f"{name:34} first call on a new key length: "
        f"median {times[15]:.3f} ms, max {times[-1]:.3f} ms"
    )


warm = torch.randn(1, 3, 8, 64, device=dev, dtype=dt)
F.scaled_dot_product_attention(warm, warm, warm)  # create the CUDA context before timing
run("gqa+mask, cuDNN on (before)", 600, False)
run("folded+mask, cuDNN on", 1600, True)
torch.backends.cuda.enable_cudnn_sdp(False)
run("gqa+mask, cuDNN off", 2600, False)
run("folded+mask, cuDNN off (after)", 3600, True)
