"""benchmarks/autocomplete.py's split session: runs of keystroke ranges merged into one result.

A 1.5B session against llama-server does not fit one quiet slot, so it runs as ranges (1-10, then
10-20: each run's first request is its cold one). The merge must keep the first run's cold request,
leave out the later runs' (a repeat of the keystroke before), and count continuations per keystroke.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import autocomplete as ac


@pytest.fixture(scope="module")
def s():
    return ac.session(20, 6000)


def _part(s, first, last, tmp_path, side="llama_server"):
    ks = range(first, last + 1)
    # keystrokes divisible by 3 continue the real text; every other completion does not
    comps = [s["typed"][k : k + 12] if k % 3 == 0 else "zz" for k in ks]
    r = ac.summary([float(k) for k in ks], [100 + k for k in ks], sum(k % 3 == 0 for k in ks))
    doc = {
        "keystroke_range": [first, last],
        "model": "m",
        side: r | {"completions": comps, "first_keystroke": first},
    }
    path = tmp_path / f"{side}-{first}.json"
    path.write_text(json.dumps(doc))
    return path


def test_merge_joins_ranges_without_the_repeated_cold_request(s, tmp_path):
    a, b = _part(s, 1, 10, tmp_path), _part(s, 10, 20, tmp_path)
    r = ac.merge([b, a], s)["llama_server"]  # in any order
    assert r["keystrokes"] == 20
    assert r["latencies_s"] == [float(k) for k in range(1, 21)]
    assert r["cold_s"] == 1.0 and r["p50_s"] == 11.0  # the warm ones: keystrokes 2..20
    assert r["computed_per_keystroke"] == [100 + k for k in range(1, 21)]
    assert r["continues_real_text"] == 6  # 3, 6, ..., 18: keystroke 9 counted once
    assert len(r["completions"]) == 20


def test_merge_refuses_ranges_that_do_not_join(s, tmp_path):
    a, b = _part(s, 1, 10, tmp_path), _part(s, 12, 20, tmp_path)
    with pytest.raises(SystemExit, match="do not join"):
        ac.merge([a, b], s)


def test_sides_from_separate_runs_are_compared(s, tmp_path):
    ours = _part(s, 1, 20, tmp_path, side="ours")
    a, b = _part(s, 1, 10, tmp_path), _part(s, 10, 20, tmp_path)
    result = ac.merge([ours, a, b], s)
    ac.report(result)
    assert result["ratios"]["p50"] == 1.0 and result["same_completions"] == 20
