"""What the host-device link carries: pinned copies to the device, to the host, and both
directions at once, at the sizes tile:stream copies a strip in.

    python benchmarks/bench_link.py --out benchmarks/results/h200/link

Why: a streamed step moves its boundaries both ways at once (memstudy/streaming.py: one side
stream each way), so the floor its copies set is the step's bytes over the rates the link
holds with both directions busy, not over one direction's rate alone. Each copy is one
contiguous pinned host buffer to or from one device buffer (a channels_last strip is
contiguous), timed by CUDA events around `--copies` copies after warm-up, the median of
`--repeat`; "both" issues the same copies to the device and to the host together on two
streams, and its rates count each direction's bytes over the time both took. Writes link.md
and link.json and prints the table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from cuda_timing import median_ms  # benchmarks/ is on sys.path when run as a script

MIB = 2 ** 20
SIZES_MIB = (4, 64, 400)  # a small copy; a 784-row strip at 1/4 resolution (16384 px); one at full


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for link.md and link.json")
    p.add_argument("--sizes-mib", default=",".join(map(str, SIZES_MIB)),
                   help="copy sizes in MiB, comma-separated")
    p.add_argument("--copies", type=int, default=8, help="copies each way in one timed repeat")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("the link is the GPU's: this benchmark needs a machine with a CUDA GPU")
    try:
        args.sizes = [int(s) for s in args.sizes_mib.split(",")]
    except ValueError:
        p.error(f"--sizes-mib takes whole MiB, comma-separated (e.g. 4,64,400), "
                f"got {args.sizes_mib!r}")
    if min(args.sizes) < 1 or args.copies < 1 or args.repeat < 1:
        p.error("--sizes-mib, --copies and --repeat must be positive")
    return args


def rates(nbytes: int, copies: int, repeat: int) -> dict[str, float]:
    """GB/s to the device alone, to the host alone, and each way with both at once."""
    host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_in = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    streams = {"in": torch.cuda.Stream(), "out": torch.cuda.Stream()}

    def run(ways: tuple[str, ...]) -> None:
        compute = torch.cuda.current_stream()
        for way in ways:
            streams[way].wait_stream(compute)
            with torch.cuda.stream(streams[way]):
                for _ in range(copies):
                    if way == "in":
                        dev_in.copy_(host_in, non_blocking=True)
                    else:
                        host_out.copy_(dev_out, non_blocking=True)
        for way in ways:  # the timing events on the current stream close after both
            compute.wait_stream(streams[way])

    moved_gb = nbytes * copies / 1e9
    ms = {ways: median_ms(lambda: run(ways), repeat=repeat, warmup=2)
          for ways in (("in",), ("out",), ("in", "out"))}
    return {"to_device": moved_gb / ms[("in",)] * 1e3, "to_host": moved_gb / ms[("out",)] * 1e3,
            "both_each_way": moved_gb / ms[("in", "out")] * 1e3}


def table(rows: dict[int, dict[str, float]]) -> list[str]:
    lines = ["| copy MiB | to device GB/s | to host GB/s | both at once: each way GB/s | "
             "both at once: sum GB/s |", "|---|---|---|---|---|"]
    for size, r in rows.items():
        lines.append(f"| {size} | {r['to_device']:.1f} | {r['to_host']:.1f} | "
                     f"{r['both_each_way']:.1f} | {2 * r['both_each_way']:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = {size: rates(size * MIB, args.copies, args.repeat) for size in args.sizes}
    gpu = torch.cuda.get_device_name()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = [f"# Pinned copies over the host-device link, {gpu}", "",
            f"Recorded {when}; torch {torch.__version__}. {args.copies} copies of one size each "
            f"way per repeat, median of {args.repeat} (benchmarks/bench_link.py).", "",
            *table(rows)]
    (args.out / "link.md").write_text("\n".join(text) + "\n")
    (args.out / "link.json").write_text(json.dumps(
        {"gpu": gpu, "recorded": when, "torch": torch.__version__, "copies": args.copies,
         "repeat": args.repeat, "gb_per_s": {str(k): v for k, v in rows.items()}}, indent=1))
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
