"""planner/format.py: byte units at their edges."""

from planner.format import byte_unit, fmt_bytes


def test_byte_units_at_their_edges():
    assert [fmt_bytes(n) for n in (0, 1023, 1024, 2**20 - 1, 2**20, 2**30, -3 * 2**20)] == [
        "0 B", "1023 B", "1.00 KiB", "1024.00 KiB", "1.00 MiB", "1.00 GiB", "-3.00 MiB"]
    assert fmt_bytes(1536, digits=0) == "2 KiB" and fmt_bytes(1536, digits=3) == "1.500 KiB"
    assert [byte_unit(n) for n in (5, 2**10, 2**20 + 1, 2**40)] == [
        (1, "B"), (2**10, "KiB"), (2**20, "MiB"), (2**30, "GiB")]


