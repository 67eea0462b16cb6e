"""``benchmarks/agent_session.py`` end to end at a tiny size, on the default model: against our
server, and llama.cpp's ``llama-server`` where its binary is built (``make bench-peer``).

What it checks is what the benchmark reports and the cache makes true whatever the timing: later
turns hit the cache for the earlier turns' prompt; sessions sent at once on a prefix neither has
seen compute it once (all but one compute only their own tail: the shared-prefix wait in the
scheduler); after a restart, turn 1 of a new session is served from the disk tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import agent_session

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "default"
BS = 16  # the server's default block size
# Four server starts and a few hundred-token prefills on the default model: about a minute on a quiet
# 2-core machine; the suite's 600 s default is too short where other jobs load it heavily.
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    """One run of the benchmark, shared by the tests below (llama-server's side where it is built)."""
    if not any(MODEL.glob("*.gguf")):
        pytest.skip(f"no default model at {MODEL} (make model)")
    out = tmp_path_factory.mktemp("agent") / "agent.json"
    argv = ["--model", str(MODEL), "--prompt-tokens", "700", "--turns", "3", "--sessions", "2"]
    argv += ["--max-tokens", "3", "--threads", "1", "--out", str(out)]
    # The watchdog and heartbeat judge time: on a machine other jobs load, a starved engine would be
    # declared hung. This test checks the cache, not those (tests/test_fault_watchdog_unit.py does).
    argv += ["--ours-arg=--watchdog-timeout", "--ours-arg=0"]
    argv += ["--ours-arg=--engine-heartbeat-timeout", "--ours-arg=300"]
    if not agent_session.LLAMA_SERVER.exists():
        argv.append("--skip-llama-server")
    result = agent_session.main(argv)
    assert out.exists()
    return result


def test_ours_turns_hit_the_cache_sessions_share_the_prefix_and_a_restart_reads_the_disk(replay):
    result = replay
    assert abs(result["turn1_prompt_tokens"] - 700) < 80 and result["tools"] == 24
    ours = result["sides"]["ours"]
    turns = ours["turns"]
    assert len(turns) == 3 and all(t["completion_tokens"] == 3 for t in turns)
    for before, after in zip(turns, turns[1:], strict=False):
        # A turn's prompt extends the last one's (the recorded call and its result appended): the
        # cache holds the last prompt's full blocks.
        assert after["prompt_tokens"] > before["prompt_tokens"]
        assert after["cached_tokens"] >= before["prompt_tokens"] // BS * BS
    shared = result["shared_prefix_tokens"] // BS * BS
    for phase in ("sessions_at_once_warm", "sessions_at_once_cold"):
        sessions = ours[phase]["sessions"]
        computed = sorted(s["computed_tokens"] for s in sessions)
        tails = max(s["prompt_tokens"] for s in sessions) - shared
        assert all(c <= tails for c in computed[:-1]), (
            f"{phase}: the shared prefix computed twice: {computed}"
        )
    restart = ours["after_restart"]
    assert restart["cached_tokens"] >= shared, "turn 1 after the restart was not served from the disk tier"


def test_llama_server_side_and_ratios(replay):
    if not agent_session.LLAMA_SERVER.exists():
        pytest.skip(f"llama-server is not built at {agent_session.LLAMA_SERVER} (make bench-peer)")
    assert set(replay["ratios"]) >= {
        "turn1_ttft",
        "sessions_at_once_cold_wall",
        "decode_last_turn",
        "decode_all_turns",
    }
    theirs = replay["sides"]["llama-server"]["turns"]
    assert (
        theirs[1]["cached_tokens"] > 0
        and theirs[0]["prompt_tokens"] == replay["sides"]["ours"]["turns"][0]["prompt_tokens"]
    )


def test_decode_rate_is_tokens_over_seconds_across_the_turns():
    """The all-turns decode figure weighs each turn by its seconds (not a mean of rates); a turn
    that decoded nothing (one token, or no rate) is left out."""
    turns = [
        {"completion_tokens": 32, "decode_tok_s": 31 / 2.0},
        {"completion_tokens": 11, "decode_tok_s": 10 / 3.0},
        {"completion_tokens": 1, "decode_tok_s": None},
    ]
    assert agent_session.decode_rate(turns) == pytest.approx(41 / 5.0)
