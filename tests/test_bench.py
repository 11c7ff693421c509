"""Smoke tests of scripts/bench.py's own logic (no servers are started)."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("bench", os.path.join(ROOT, "scripts", "bench.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_merge_keeps_other_sections():
    """Rewriting a results section keeps a section another engineer wrote."""
    text = ("# Benchmarks\n\nintro\n\n## Results: quick\n\nold\n\n"
            "## Load\n\nload table\n| a | b |\n\n## Results: full\n\nfull old\n")
    out = bench.merge(text, {"Results: quick": "new", "How to run": "run it"})
    assert "## Load\n\nload table\n| a | b |\n" in out
    assert "new" in out and "old\n\n## Load" not in out
    assert "full old" in out
    assert out.count("## How to run") == 1
    assert out.index("## Results: quick") < out.index("## Load") < out.index("## Results: full")


def test_merge_on_empty_file():
    """A missing file gets a title and the owned sections."""
    out = bench.merge("", {"Results: full": "table"})
    assert out.startswith("# Benchmarks")
    assert "## Results: full\n\ntable\n" in out


def test_ratio_and_formats():
    """Ratios say how many times better ours is; sizes and times read well."""
    assert bench.Table.ratio(0.01, 0.1, "lower") == "10×"
    assert bench.Table.ratio(2.0, 1.0, "higher") == "2×"
    assert bench.Table.ratio(0.01, "n/a (no store)", "lower") == "n/a"
    assert bench.fmt_size(1_500_000) == "1.5 MB"
    assert bench.fmt_ms(0.0123) == "12.3 ms"


def test_added_bytes_counts_new_blobs_and_manifests():
    """Store growth: blobs not there before, plus manifest growth."""
    before = ({b"k1": 100}, 50, 0)
    after = ({b"k1": 100, b"k2": 30}, 80, 0)
    assert bench.added_bytes(before, after) == 60
