"""The exact tiled validation forward run several times in one process: does its first pass at a
size pay one-time costs (cuDNN's autotuning of strip shapes training never met, Triton's and
cuDNN's first loads) that a run meters, since it meters only its first validation
(docs/metrics.md)?

Per size: the default U-Net (ResNet-34) in eval mode, channels_last weights, bf16 autocast,
cudnn.benchmark on (as memstudy's tuned runs), one seeded image, `validation_forward` with the
default `train.val_tile_rows` three times, the device synchronised around each. The image on
the device, and in pinned host memory (a `tile:stream` run's validation batch: boundaries in
host memory too). Each size and placement in a fresh process, so nothing is autotuned before
its first pass. Writes --out/validation-passes.md.

    python benchmarks/bench_validation_passes.py --out results/validation-passes --sizes 8192,16384
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PASSES = 3


def passes(size: int, host: bool) -> dict:
    """Seconds of each validation pass at `size` (run in this process)."""
    import torch

    from memstudy.config import TrainConfig
    from memstudy.models import build_unet
    from memstudy.tiling.validation import validation_forward

    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = build_unet(seed=0).cuda().to(memory_format=torch.channels_last).eval()
    x = torch.rand(1, 1, size, size, generator=torch.Generator().manual_seed(0))
    x = x.pin_memory() if host else x.cuda().to(memory_format=torch.channels_last)
    rows, seconds, how = TrainConfig().val_tile_rows, [], ""
    for _ in range(PASSES):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            out, how = validation_forward(model, x, rows)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        del out
    return {"size": size, "host": host, "how": how, "seconds": seconds,
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--sizes", default="8192,16384")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # "size,host": run one here
    args = p.parse_args(argv)
    if args.one:
        size, host = args.one.split(",")
        print(json.dumps(passes(int(size), host == "1")), flush=True)
        return 0
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        for host in (False, True):
            done = subprocess.run([sys.executable, __file__, "--out", args.out, "--one",
                                   f"{size},{int(host)}"], capture_output=True, text=True)
            if done.returncode:
                print(done.stderr[-2000:], flush=True)
                rows.append(f"| {size} | {'host' if host else 'device'} | failed (exit "
                            f"{done.returncode}) | | | |")
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            s = r["seconds"]
            rows.append(f"| {size} | {'host' if host else 'device'} | {r['how']} | "
                        + " | ".join(f"{t:.2f}" for t in s) + " |")
            print(rows[-1], r["gpu"], r["torch"], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = ("| size px | image in | validation forward | " + " | ".join(
        f"pass {i + 1} s" for i in range(PASSES)) + " |\n|---|---|---|" + "---|" * PASSES)
    (out / "validation-passes.md").write_text(
        "# The tiled validation forward, three passes in one process\n\n"
        "ResNet-34 U-Net, eval, bf16 autocast, channels_last, cudnn.benchmark on; one image; "
        "the device synchronised around each pass (benchmarks/bench_validation_passes.py).\n\n"
        + header + "\n" + "\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
