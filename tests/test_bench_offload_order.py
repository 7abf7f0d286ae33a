"""bench_offload_order: what offload:which=boundaries moves, computed at a proxy size and scaled
to the target. The scaling is exact: the list at 128 px scaled from 64 px equals the list
computed at 128 px, shape for shape, dtype for dtype."""
import sys
from fractions import Fraction
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import bench_offload_order as order  # noqa: E402

SET = "amp:bf16,checkpoint,tile:3:keep=all"


def listing(proxy: int, target: int) -> list[tuple[tuple[int, ...], str, int]]:
    args = order.parse_args(["--size", str(target), "--proxy", str(proxy), "--techniques", SET,
                             "--set", "train.msssim_scales=1"])
    scale = Fraction(target, proxy)
    return order.at_target(order.saved_in_order(order.proxy_config(args), scale), scale)


def test_the_scaled_listing_equals_the_one_computed_at_the_target():
    direct = listing(128, 128)
    assert listing(64, 128) == direct
    # the tiled top region's kept input (block 4's conv1 output, 16 channels at full
    # resolution, bf16 under autocast) is the last saved: what hold=1 keeps
    assert direct[-1] == ((1, 16, 128, 128), "bfloat16", 16 * 128 * 128 * 2)


def test_a_proxy_off_the_stride_is_one_line_naming_the_fix():
    with pytest.raises(SystemExit, match="--proxy 100 is no multiple of the U-Net's stride 32; use 128"):
        order.main(["--proxy", "100"])


def test_stream_is_refused_since_the_cpu_cannot_tell_its_host_boundaries():
    for spelled in ("stream=true", "stream=True"):
        with pytest.raises(SystemExit, match="^bench_offload_order: tile:stream keeps its "
                                             "boundaries in host memory"):
            order.main(["--techniques", f"amp:bf16,checkpoint,tile:5:levels=4:{spelled}"])


@pytest.mark.parametrize("argv, says", [
    (["--techniques", "bogus"], "unknown technique 'bogus'"),
    (["--set", "model.encoder=resnet99"], "model.encoder = 'resnet99' is not a ResNet-family"),
])
def test_a_bad_technique_or_setting_is_one_line(argv, says):
    with pytest.raises(SystemExit, match=f"^bench_offload_order: {says}"):
        order.main(argv)
