"""The step profile's arithmetic (memstudy/meters/profile.py): GPU-busy time is the union of
kernel intervals, overlapping work counted once."""
from memstudy.meters.profile import busy_ms


def test_busy_time_is_the_union_of_intervals():
    # 0-10 and 5-12 overlap (12 us), 20-25 apart (5 us), 21-22 inside it
    assert busy_ms([(20.0, 25.0), (0.0, 10.0), (5.0, 12.0), (21.0, 22.0)]) == 0.017
    assert busy_ms([]) == 0.0
