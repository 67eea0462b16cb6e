"""The prefix cache's tiers below the pool (engine_svc/kv_tiers/): the disk entry's checks, the
tiers' bounds, and at engine level that a request whose prefix came back from host memory or from
disk (after a restart of the engine) gets exactly its solo run's tokens and logprobs, while a
corrupt, truncated or foreign entry is skipped and counted, never used."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine_svc import SamplingParams
from engine_svc.kv_tiers.entry import BadEntry, BlockMeta, TierEntry, decode, encode
from engine_svc.kv_tiers.store import DiskTier, HostTier, TieredStore
from tests.engine_helpers import make_engine, random_model, random_prompts

FP = bytes(range(16))


def _entry(key: int, n: int = 64, tokens=(5, 6, 7, 8)) -> TierEntry:
    payload = np.random.default_rng(key).integers(0, 256, n, dtype=np.uint8)
    return TierEntry(BlockMeta(key, tuple(tokens), parent=key + 1, salt=3, listed=True), payload)


def _file(entry: TierEntry, fp: bytes = FP) -> bytes:
    return b"".join(bytes(p) for p in encode(entry, fp))


# --- the disk entry ---------------------------------------------------------------------------------
def test_entry_round_trips_bitwise():
    e = _entry(11)
    back = decode(_file(e), FP, 11, (5, 6, 7, 8))
    assert back.meta == e.meta and back.payload.tobytes() == e.payload.tobytes()


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda b: b[:-1], "payload is"),  # truncated
        (lambda b: b[:20], "truncated"),
        (lambda b: b + b"\0", "payload is"),  # longer than it says
        (lambda b: b[:-5] + bytes([b[-5] ^ 1]) + b[-4:], "checksum"),  # one bit of the payload
        (lambda b: b[:30] + bytes([b[30] ^ 0x80]) + b[31:], "checksum"),  # one bit of the header
        (lambda b: b"XXXXXXXX" + b[8:], "magic"),
    ],
)
def test_a_damaged_entry_is_refused(damage, why):
    with pytest.raises(BadEntry, match=why):
        decode(damage(_file(_entry(11))), FP, 11, (5, 6, 7, 8))


def test_a_foreign_or_mismatched_entry_is_refused():
    data = _file(_entry(11))
    with pytest.raises(BadEntry, match="foreign"):
        decode(data, bytes(16), 11, (5, 6, 7, 8))
    with pytest.raises(BadEntry, match="key"):
        decode(data, FP, 12, (5, 6, 7, 8))
    with pytest.raises(BadEntry, match="token ids"):
        decode(data, FP, 11, (5, 6, 7, 9))


# --- the tiers ------------------------------------------------------------------------------------
def test_host_tier_keeps_its_bound_and_hands_its_overflow_down():
    host = HostTier(3 * 64)
    spilled = [old for k in range(5) for old in host.put(_entry(k))]
    assert [e.meta.key for e in spilled] == [0, 1] and host.stats.bytes == 3 * 64
    assert host.get(0, (5, 6, 7, 8)) is None and host.get(4, (5, 6, 7, 8)) is not None
    assert host.get(4, (1, 2, 3, 4)) is None  # other tokens under the same key: not this block


def test_disk_tier_survives_a_restart_keeps_its_bound_and_deletes_bad_files(tmp_path):
    size = len(_file(_entry(0)))
    disk = DiskTier(tmp_path, 3 * size, FP)
    for k in range(4):
        disk.put(_entry(k))
    assert disk.stats.bytes == 3 * size and 0 not in disk and disk.stats.evicted == 1
    again = DiskTier(tmp_path, 3 * size, FP)  # a new engine
    assert sorted(again.index) == [1, 2, 3]
    got = again.get(2, (5, 6, 7, 8))
    assert got is not None and got.payload.tobytes() == _entry(2).payload.tobytes()
    # One byte of a file flipped on disk: skipped, counted, deleted, never returned.
    path = again._path(3)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert again.get(3, (5, 6, 7, 8)) is None
    assert again.stats.rejected == 1 and not path.exists() and 3 not in again
    # Another fingerprint's entry put under this one's name: foreign, skipped.
    again._path(1).write_bytes(_file(_entry(1), fp=bytes(16)))
    assert again.get(1, (5, 6, 7, 8)) is None and again.stats.rejected == 2


def test_store_puts_host_overflow_on_disk_once(tmp_path):
    store = TieredStore(2 * 64, 1 << 20, tmp_path, FP)
    for k in range(4):
        store.put(_entry(k))
    assert sorted(store.host.entries) == [2, 3] and sorted(store.disk.index) == [0, 1]
    assert store.get(0, (5, 6, 7, 8)).payload.tobytes() == _entry(0).payload.tobytes()
    assert store.disk.stats.hits == 1 and store.host.stats.hits == 0


def test_moves_run_in_the_order_they_were_decided():
    """run_tier_ops on a small cache tensor, read back independently: a copy decided before a load
    into its destination (or its source) leaves the loaded bytes; a block loaded twice in one
    list holds the second entry; a save reads the block as it was before a later load."""
    import torch

    from engine_svc.kv_tiers.transfer import TierOp, run_tier_ops

    cache = torch.arange(2 * 6 * 4, dtype=torch.float32).reshape(2, 6, 4)  # [K/V, blocks, page]
    page = cache[:, 0].numel() * 4
    before = cache.clone()

    def entry(key: int) -> TierEntry:
        payload = np.random.default_rng(key).integers(0, 256, page, dtype=np.uint8)
        return TierEntry(BlockMeta(key, (key,)), payload)

    def page_bytes(block: int, t=cache) -> bytes:
        return t[:, block].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()

    def holds(block: int, e: TierEntry) -> bool:
        return page_bytes(block) == e.payload.tobytes()

    e1, e2, e3 = entry(1), entry(2), entry(3)
    ops = [
        TierOp(4, meta=BlockMeta(9, (9,))),  # a save of block 4 ...
        TierOp(2, src=1),  # copy-on-write 1 -> 2, then both pages reused:
        TierOp(2, entry=e1),
        TierOp(1, entry=e2),
        TierOp(4, entry=e3),  # ... then block 4 loaded
        TierOp(3, src=0),
        TierOp(3, entry=e1),  # block 3 loaded twice: the later entry is what it holds
        TierOp(3, entry=e2),
        TierOp(5, src=0),  # a copy after the loads sees none of them
        TierOp(0, src=5),  # copies in a chain: the second reads what the first wrote
        TierOp(5, src=4),
        TierOp(0, src=5),
    ]
    (saved,) = run_tier_ops([cache], ops)
    assert saved.payload.tobytes() == page_bytes(4, before)
    assert holds(2, e1) and holds(1, e2) and holds(4, e3) and holds(3, e2)
    assert holds(5, e3) and holds(0, e3)


# --- the engine -----------------------------------------------------------------------------------
BS = 16
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def model(tmp_path_factory, trained_tokenizer_dir) -> Path:
    return random_model(
        tmp_path_factory.mktemp("tiers") / "llama",
        trained_tokenizer_dir,
        "llama",
        seed=77,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
    )


def _run(engine, prompts: dict) -> dict:
    """Tokens and logprobs per request id (the pool checked after every step)."""
    out = {}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, PARAMS)
    while engine.has_unfinished_requests():
        for d in engine.step():
            toks, lps = out.setdefault(d.request_id, ([], []))
            toks += d.new_token_ids
            lps += d.logprobs  # TokenLogprob dataclasses: compared field by field, floats with ==
        engine.check_invariants()
    return out


def _tiers(engine) -> dict:
    return {t.tier: t for t in engine.stats().kv_tiers}


PROMPTS = random_prompts([150, 120, 130, 140], 1000, seed=3)  # 9, 7, 8, 8 full blocks


@pytest.fixture(scope="module")
def solo(model) -> dict:
    """Each prompt alone, on an engine without tiers."""
    return {i: _run(make_engine(model), {"s": p})["s"] for i, p in enumerate(PROMPTS)}


def test_prefix_back_from_disk_after_a_restart_equals_its_solo_run(model, solo, tmp_path):
    """Prompt 0's blocks are written through to disk as they are computed; a new engine (a
    restart) on the same directory loads its 9 blocks back, and prompt 0, batched with others,
    gets its solo run's tokens and logprobs bitwise."""
    tiers = dict(kv_disk_bytes=1 << 30, kv_disk_dir=str(tmp_path), num_kv_blocks=64)
    first = make_engine(model, **tiers)
    assert _run(first, {"a": PROMPTS[0]})["a"] == solo[0]
    assert _tiers(first)["disk"].stored >= 9
    first.shutdown()
    second = make_engine(model, **tiers)  # nothing in its pool
    got = _run(second, {"a": PROMPTS[0], "b": PROMPTS[1], "c": PROMPTS[2]})
    assert got["a"] == solo[0] and got["b"] == solo[1] and got["c"] == solo[2]
    disk = _tiers(second)["disk"]
    assert disk.hits == 9 and disk.rejected == 0
    assert second.stats().prefix_hit_tokens == 9 * BS
    assert second.stats().prompt_tokens_computed == sum(map(len, PROMPTS[:3])) - 9 * BS


def test_blocks_the_pool_evicted_come_back_from_host_memory(model, solo):
    """The GPU design on CPU: a host tier and no disk. A pool too small for two prompts evicts the
    first one's blocks to host memory; asked again, its prefix is loaded back and its answer is
    its solo run's."""
    engine = make_engine(model, kv_offload_bytes=64 << 20, num_kv_blocks=12)
    assert _run(engine, {"a": PROMPTS[0]})["a"] == solo[0]
    assert _run(engine, {"d": PROMPTS[3]})["d"] == solo[3]  # evicts prompt 0's blocks
    keys = engine.kv.block_hashes(_seq_of(engine, PROMPTS[0]), 9)
    in_pool = [
        engine.kv.pool.lookup(k, tuple(PROMPTS[0][i * BS : (i + 1) * BS])) is not None
        for i, k in enumerate(keys)
    ]
    gone = in_pool.index(False)  # the tail went first; the chain's head may still be in the pool
    assert gone < 9 and not any(in_pool[gone:])
    before = _tiers(engine)["host"].hits
    assert _run(engine, {"a": PROMPTS[0]})["a"] == solo[0]
    assert _tiers(engine)["host"].hits - before == 9 - gone


def _seq_of(engine, prompt):
    from engine_svc.sequence import Request, Sequence

    request = Request("probe", list(prompt), PARAMS, 0, None, 0, 10)
    return Sequence(request, 0, list(prompt))


def test_corrupt_truncated_and_foreign_files_are_skipped_never_used(model, solo, tmp_path):
    """After a first run, block 3 of prompt 0's file is damaged, block 5's truncated, and block 7's
    replaced by another fingerprint's entry; the restarted engine loads blocks 0-2 only, counts the
    bad file it met, and prompt 0's answer is still its solo run's."""
    tiers = dict(kv_disk_bytes=1 << 30, kv_disk_dir=str(tmp_path), num_kv_blocks=24)
    first = make_engine(model, **tiers)
    _run(first, {"a": PROMPTS[0]})
    disk = first.kv_tiers.disk
    keys = first.kv.block_hashes(_seq_of(first, PROMPTS[0]), 9)
    p3, p5, p7 = (disk._path(keys[i]) for i in (3, 5, 7))
    data = bytearray(p3.read_bytes())
    data[len(data) // 2] ^= 0x01
    p3.write_bytes(bytes(data))
    p5.write_bytes(p5.read_bytes()[:-100])
    foreign = make_engine(
        model, dtype="bfloat16", kv_disk_bytes=1 << 30, kv_disk_dir=str(tmp_path / "x"), num_kv_blocks=24
    )
    assert foreign.kv_tiers.fingerprint != disk.fingerprint  # another dtype: another fingerprint
    _run(foreign, {"a": PROMPTS[0]})
    p7.write_bytes(foreign.kv_tiers.disk._path(keys[7]).read_bytes())
    second = make_engine(model, **tiers)
    assert _run(second, {"a": PROMPTS[0]})["a"] == solo[0]
    st = _tiers(second)["disk"]
    assert st.hits == 3 and st.rejected == 1
    # The bad file was deleted, block 3 recomputed and written through again, whole this time.
    decode(p3.read_bytes(), disk.fingerprint, keys[3], tuple(PROMPTS[0][3 * BS : 4 * BS]))
    third = make_engine(model, **tiers)  # block 3 recomputed and written again; 5 and 7 are next
    assert _run(third, {"a": PROMPTS[0]})["a"] == solo[0]
    st = _tiers(third)["disk"]
    assert st.hits == 5 and st.rejected == 1
    fourth = make_engine(model, **tiers)
    assert _run(fourth, {"a": PROMPTS[0]})["a"] == solo[0]
    st = _tiers(fourth)["disk"]
    assert st.hits == 7 and st.rejected == 1  # the foreign entry
    assert _run(make_engine(model, **tiers), {"a": PROMPTS[0]})["a"] == solo[0]


def test_an_engine_of_another_block_size_never_reads_the_entries(model, tmp_path):
    make_engine(model, kv_disk_bytes=1 << 30, kv_disk_dir=str(tmp_path), num_kv_blocks=24)
    a = make_engine(model, kv_disk_bytes=1 << 30, kv_disk_dir=str(tmp_path), num_kv_blocks=24)
    _run(a, {"a": PROMPTS[0]})
    b = make_engine(model, kv_disk_bytes=1 << 30, kv_disk_dir=str(tmp_path), num_kv_blocks=48, block_size=8)
    assert b.kv_tiers.disk.dir != a.kv_tiers.disk.dir and not b.kv_tiers.disk.index
    _run(b, {"a": PROMPTS[0]})
    assert _tiers(b)["disk"].hits == 0


def test_a_sliding_window_model_restores_every_group_from_disk(tmp_path, trained_tokenizer_dir):
    """Gemma 3's window groups: each group's page is its own entry; after a restart the prompt's
    pages of every group it reads come back, and the answers equal the solo runs."""
    from tests.test_gemma3 import GEMMA

    gemma = random_model(
        tmp_path / "gemma3", trained_tokenizer_dir, "gemma3", seed=31, vocab_size=1032, **GEMMA
    )
    prompts = random_prompts([100, 90], 1000, seed=1)
    solo = [_run(make_engine(gemma), {"s": p})["s"] for p in prompts]
    tiers = dict(kv_disk_bytes=1 << 30, kv_disk_dir=str(tmp_path / "kv"), num_kv_blocks=200)
    _run(make_engine(gemma, **tiers), {"a": prompts[0]})
    again = make_engine(gemma, **tiers)
    got = _run(again, {"a": prompts[0], "b": prompts[1]})
    assert got["a"] == solo[0] and got["b"] == solo[1]
    assert again.stats().prefix_hit_tokens == 6 * BS and _tiers(again)["disk"].hits > 6


def test_sizes_and_metrics():
    from engine_svc.rpc.engine_options import parse_bytes
    from gateway.metrics import _kv_tier_metrics
    from llmserve_proto.engine.v1 import engine_pb2 as pb

    assert [parse_bytes(x) for x in ("4096", "512M", "4G", "1.5GiB", "0")] == [
        4096,
        512 << 20,
        4 << 30,
        3 << 29,
        0,
    ]
    load = pb.Load(kv_tiers=[pb.KVTierLoad(tier="disk", hits=7, bytes=99)])
    got = {(s.name, s.labels["tier"]): s.value for f in _kv_tier_metrics(load) for s in f.samples}
    assert got[("llmserve_kv_tier_hit_blocks_total", "disk")] == 7
    assert got[("llmserve_kv_tier_bytes", "disk")] == 99


def test_a_reset_of_the_prefix_cache_empties_the_host_tier(model, solo):
    engine = make_engine(model, kv_offload_bytes=64 << 20)
    _run(engine, {"a": PROMPTS[0]})
    assert _tiers(engine)["host"].entries >= 9
    engine.kv.pool.reset_prefix_cache()
    assert _tiers(engine)["host"].entries == 0
    before = engine.stats().prompt_tokens_computed
    assert _run(engine, {"a": PROMPTS[0]})["a"] == solo[0]
    assert engine.stats().prompt_tokens_computed - before == len(PROMPTS[0])  # computed again


def test_a_block_loaded_where_a_copy_on_write_was_queued_holds_the_loaded_bytes(model, tmp_path):
    """Issue 43's batch-invariance failure with the disk tier on (the service test's priority
    request off its solo run at its 8th token). In one schedule: a forked request's sequence
    copies its shared partial block (copy-on-write, a copy queued for before the forward), then
    an urgent request, its prefix on disk, preempts both forked sequences for room, and its
    blocks are loaded into the pages they released -- the copy's source and its destination.
    The moves must run in the order they were decided; the copy run after the loads wrote the
    forked request's partial block (or the wrong loaded one) over the urgent request's prefix."""
    urgent = random_prompts([65], 1000, seed=5)[0]  # 4 full blocks and the token computed
    forked = random_prompts([20], 1000, seed=6)[0]  # block 1 partial: shared after the fork
    tiers = dict(kv_disk_bytes=1 << 30, kv_disk_dir=str(tmp_path), scheduling_policy="priority")
    alone = make_engine(model, scheduling_policy="priority")
    ref = _run(alone, {"u": urgent})["u"]
    fork_params = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=3, logprobs=2)
    alone.add_request("f", forked, fork_params)
    ref_fork = {}
    while alone.has_unfinished_requests():
        for d in alone.step():
            ref_fork.setdefault(d.index, []).extend(d.new_token_ids)
    first = make_engine(model, **tiers)
    _run(first, {"u": urgent})
    first.shutdown()  # the urgent prompt's blocks on disk; a restart with a pool of 5 blocks
    engine = make_engine(model, num_kv_blocks=5, **tiers)
    engine.add_request("f", forked, fork_params, priority=1)
    got_fork: dict[int, list[int]] = {}
    for d in engine.step():  # the forked prompt: 2 blocks, shared by both sequences once forked
        got_fork.setdefault(d.index, []).extend(d.new_token_ids)
    assert len(engine.scheduler.running) == 2
    engine.add_request("u", urgent, PARAMS, priority=0)
    out = engine.scheduler.schedule  # the step that decides the copy, the preemptions and the loads

    def observed():
        step = out()
        kinds = [op.kind for op in step.tier_ops or []]
        seen.append((len(step.copies) + kinds.count("copy"), len(step.preempted), kinds.count("load")))
        return step

    seen: list = []
    engine.scheduler.schedule = observed
    got = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            if d.request_id == "u":
                toks, lps = got.setdefault("u", ([], []))
                toks += d.new_token_ids
                lps += d.logprobs
            else:
                got_fork.setdefault(d.index, []).extend(d.new_token_ids)
        engine.check_invariants()
    copies, preempted, loads = seen[0]
    assert (copies, preempted, loads) == (1, 2, 4), seen[0]  # the case named above
    assert got["u"] == ref
    assert got_fork == ref_fork


def test_the_server_keeps_a_bounded_disk_tier_by_default(model, tmp_path, monkeypatch):
    """`llmserve serve` without --kv-disk-bytes asks for the default size (None): 4 GiB, never more
    than a quarter of the disk's free space (the tier's own files counted as free); 0 turns it off.
    The library's default stays off."""
    from engine_svc.kv_tiers import setup
    from engine_svc.server.main import build_parser, engine_config_kwargs

    def kwargs(*argv):
        return engine_config_kwargs(build_parser().parse_args(["--model", str(model), *argv]))

    assert kwargs()["kv_disk_bytes"] is None
    assert kwargs("--kv-disk-bytes", "0")["kv_disk_bytes"] == 0
    assert make_engine(model).kv_tiers is None  # LLMEngine / LLM: off unless asked
    assert setup.free_bytes(tmp_path / "not" / "made") > 0  # the nearest folder that exists
    monkeypatch.setattr(setup, "free_bytes", lambda path: 64 << 30)  # not another job's writes
    engine = make_engine(model, kv_disk_bytes=None, kv_disk_dir=str(tmp_path / "kv"))
    assert engine.kv_tiers.disk.stats.capacity_bytes == 4 << 30
    _run(engine, {"a": PROMPTS[0]})
    held = _tiers(engine)["disk"].bytes
    assert held > 0
    # A nearly full disk: the default tier takes a quarter of what is free, its own files counted.
    monkeypatch.setattr(setup, "free_bytes", lambda path: 3 * held)
    again = make_engine(model, kv_disk_bytes=None, kv_disk_dir=str(tmp_path / "kv"))
    assert again.kv_tiers.disk.stats.capacity_bytes == held
    assert _tiers(again)["disk"].bytes == held  # nothing it held was dropped
    monkeypatch.setattr(setup, "free_bytes", lambda path: held)
    small = make_engine(model, kv_disk_bytes=None, kv_disk_dir=str(tmp_path / "kv"))
    assert small.kv_tiers.disk.stats.bytes <= held // 2  # the least recently used files went
