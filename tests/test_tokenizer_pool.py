"""TokenizerPool: real worker processes, protobuf over pipes; results, loop latency, death, close."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest

from tokenizer_svc.pool import TokenizerPool, TokenizerWorkerDied
from tokenizer_svc.tokenizer import load_tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好 👋 café"}]


def long_prompt(chars: int, seed: int) -> str:
    """Varied text (no repeated words, so the tokenizer's word cache does not make it cheap)."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyzéèçñ你好世界天气很公园🦀👋"
    words = []
    while sum(map(len, words)) + len(words) < chars:
        words.append("".join(rng.choice(alphabet) for _ in range(rng.randint(2, 9))))
    return " ".join(words)[:chars]


def worker_children() -> list[int]:
    """Live processes whose parent is this test process and that run a tokenizer worker."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and b"tokenizer_svc.worker" in cmdline:
            found.append(int(entry.name))
    return found


async def max_loop_gap_during(work) -> float:
    """Longest time the event loop went without running a 1 ms ticker while ``work`` ran."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker():
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    await work()
    done.set()
    await task
    return max(gaps)


def test_pool_matches_in_process_and_keeps_the_loop_responsive(trained_tokenizer_dir):
    tok = load_tokenizer(trained_tokenizer_dir)
    prompts = [long_prompt(32_000, seed) for seed in range(4)]
    texts = ["hello world", "def f(x):\n    return x", "", "naïve 你好 👨‍👩‍👧", prompts[0]]

    async def main():
        async with TokenizerPool(trained_tokenizer_dir, num_workers=2) as pool:
            pids = pool.worker_pids
            assert len(pids) == 2 and sorted(pids) == sorted(worker_children())

            # Many requests in flight at once, spread over both workers, each answered correctly.
            encoded = await asyncio.gather(*(pool.encode(t) for t in texts * 4))
            assert encoded == [tok.encode(t) for t in texts * 4]
            assert await pool.encode("hi", add_special_tokens=False) == tok.encode("hi", False)
            assert await pool.apply_chat_template(MESSAGES) == tok.apply_chat_template(MESSAGES)
            assert await pool.apply_chat_template(MESSAGES, add_generation_prompt=False) == (
                tok.apply_chat_template(MESSAGES, add_generation_prompt=False)
            )
            ids = [1, *tok.encode("naïve 你好 👨‍👩‍👧"), 2]
            assert await pool.decode(ids) == tok.decode(ids)
            assert await pool.decode(ids, skip_special_tokens=False) == tok.decode(ids, False)
            with pytest.raises(ValueError, match="no 'content'"):
                await pool.apply_chat_template([{"role": "user"}])
            with pytest.raises(ValueError, match="token ids"):
                await pool.decode([-1])

            async with TokenizerPool(trained_tokenizer_dir, num_workers=0) as local:
                expected = [tok.encode(prompt) for prompt in prompts]  # before the clock runs
                results = {}

                async def encode_all(p):
                    results[p] = [await p.encode(prompt) for prompt in prompts]

                gap_local = await max_loop_gap_during(lambda: encode_all(local))
                gap_pool = await max_loop_gap_during(lambda: encode_all(pool))
                assert results[local] == results[pool] == expected
            print(
                f"max loop gap while encoding 32k-char prompts: in-process {gap_local * 1e3:.1f} ms, "
                f"workers {gap_pool * 1e3:.1f} ms"
            )
        return pids, gap_local, gap_pool

    pids, gap_local, gap_pool = asyncio.run(main())
    assert gap_local > 0.004, "the in-process encode should visibly stall the loop"
    assert gap_pool < gap_local / 2, (gap_pool, gap_local)
    # close() waited for every worker: none is left, not even as a zombie.
    assert worker_children() == []
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists()


def test_worker_errors_and_death_are_reported_and_the_worker_restarts(trained_tokenizer_dir, tmp_path):
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(trained_tokenizer_dir / name, tmp_path / name)
    config = json.loads((trained_tokenizer_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))

    async def main():
        async with TokenizerPool(tmp_path, num_workers=1) as pool:
            # An error raised inside the worker comes back as an exception with its message.
            with pytest.raises(ValueError, match="no chat template"):
                await pool.apply_chat_template(MESSAGES)
            (pid,) = pool.worker_pids

            in_flight = asyncio.create_task(pool.encode(long_prompt(32_000, 1) * 60))
            await asyncio.sleep(0.2)
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(TokenizerWorkerDied, match=rf"pid {pid}\).*exit code -9"):
                await in_flight

            # The pool starts a new worker and the next request is served by it.
            assert await pool.encode("still here") == load_tokenizer(tmp_path).encode("still here")
            (new_pid,) = pool.worker_pids
            assert new_pid != pid
        assert worker_children() == []

    asyncio.run(main())


def test_in_process_pool_without_workers(trained_tokenizer_dir):
    tok = load_tokenizer(trained_tokenizer_dir)

    async def main():
        pool = TokenizerPool(trained_tokenizer_dir, num_workers=0)
        await pool.start()
        assert pool.worker_pids == [] and worker_children() == []
        assert await pool.encode("你好 world") == tok.encode("你好 world")
        assert await pool.apply_chat_template(MESSAGES) == tok.apply_chat_template(MESSAGES)
        assert await pool.decode([1, 5, 9]) == tok.decode([1, 5, 9])
        await pool.close()

    asyncio.run(main())


def test_worker_that_cannot_start_is_reported(tmp_path):
    async def main():
        with pytest.raises(TokenizerWorkerDied, match="before it was ready"):
            await TokenizerPool(tmp_path, num_workers=1).start()  # no tokenizer.json there

    asyncio.run(main())
    assert worker_children() == []


def test_a_sessions_turns_go_to_the_worker_that_holds_its_system_prompt(trained_tokenizer_dir):
    """With several workers, the chats of one long system prompt go back to the worker that encoded
    it last (its piece cache holds the prompt's ids), unless that worker is the busier; other
    requests still spread over the least loaded; the ids are the in-process tokenizer's."""
    local = load_tokenizer(trained_tokenizer_dir)
    system = {"role": "system", "content": long_prompt(6000, seed=3)}
    other = {"role": "system", "content": long_prompt(6000, seed=4)}

    async def main():
        async with TokenizerPool(trained_tokenizer_dir, num_workers=3) as pool:
            served: list[tuple[str, int]] = []
            for w in pool._workers:
                call = w.call

                async def record(request, _w=w, _call=call):
                    served.append((request.WhichOneof("kind"), _w.index))
                    return await _call(request)

                w.call = record
            turns = [[system, {"role": "user", "content": f"turn {k}"}] for k in range(4)]
            for msgs in turns:
                assert await pool.apply_chat_template(msgs) == local.apply_chat_template(msgs)
            sticky = {i for kind, i in served if kind == "chat"}
            assert len(sticky) == 1, f"one session's turns went to workers {served}"
            served.clear()
            await pool.apply_chat_template([other, {"role": "user", "content": "hi"}])
            await asyncio.gather(*(pool.encode(f"text {k}") for k in range(6)))
            assert len({i for _, i in served}) > 1, f"everything went to one worker: {served}"
            # The session's worker busy with another request: the next turn goes to a free one.
            (home,) = sticky
            busy = asyncio.ensure_future(pool._workers[home].call(_encode_request(long_prompt(200000, 9))))
            while not pool._workers[home].pending:  # the busy request is written to the worker
                await asyncio.sleep(0)
            served.clear()
            turn = asyncio.ensure_future(pool.apply_chat_template(turns[0]))
            await asyncio.sleep(0)  # picked now: the home worker still has the long encode
            assert served[-1] == ("chat", served[-1][1]) and served[-1][1] != home, served
            assert await turn == local.apply_chat_template(turns[0])
            await busy

    asyncio.run(main())


def _encode_request(text: str):
    from llmserve_proto.tokenizer.v1 import tokenizer_pb2 as pb

    return pb.WorkerRequest(encode=pb.EncodeRequest(text=text, add_special_tokens=False))
