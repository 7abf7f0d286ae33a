"""benchmarks/bench_link.py: the link's rates, and its refusals before any copy."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_link as link  # noqa: E402


def test_without_a_gpu_it_is_one_line_before_any_copy(capsys, monkeypatch):
    monkeypatch.setattr(link.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        link.parse_args(["--out", "x"])
    assert "the link is the GPU's: this benchmark needs a machine with a CUDA GPU" \
        in capsys.readouterr().err


@pytest.mark.parametrize("sizes, says", [("4,big", "--sizes-mib takes whole MiB"),
                                         ("0,4", "must be positive")])
def test_bad_sizes_are_one_line(sizes, says, capsys, monkeypatch):
    monkeypatch.setattr(link.torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit):
        link.parse_args(["--out", "x", "--sizes-mib", sizes])
    assert says in capsys.readouterr().err


def test_the_table_adds_both_directions_at_once():
    rows = {64: {"to_device": 55.0, "to_host": 54.0, "both_each_way": 40.0}}
    assert link.table(rows)[2] == "| 64 | 55.0 | 54.0 | 40.0 | 80.0 |"


@pytest.mark.gpu
def test_the_link_moves_bytes_each_way_and_both_at_once(tmp_path):
    assert link.main(["--out", str(tmp_path), "--sizes-mib", "8", "--copies", "2",
                      "--repeat", "2"]) == 0
    rates = link.rates(8 * link.MIB, 2, 2)
    assert all(rate > 0.5 for rate in rates.values())  # GB/s: slower would be no PCIe link
    assert (tmp_path / "link.md").read_text().startswith("# Pinned copies over the host-device")
