"""The replicas' loads added up for the gateway's metrics (gateway/replica_set.sum_loads): counts
summed, adapter names joined, and the KV tiers' figures summed tier by tier (a repeated message
field: the set-of-names rule for repeated fields raised on it, and /metrics answered 500 with
--replicas 2)."""

from __future__ import annotations

from gateway.replica_set import sum_loads
from llmserve_proto.engine.v1 import engine_pb2 as pb


def test_kv_tiers_are_summed_tier_by_tier():
    a = pb.Load(num_running=2, running_lora_adapters=["x"])
    a.kv_tiers.add(tier="disk", bytes=10, hits=1, load_seconds=0.5)
    b = pb.Load(num_running=3, running_lora_adapters=["x", "y"])
    b.kv_tiers.add(tier="host", bytes=7, hits=2)
    b.kv_tiers.add(tier="disk", bytes=5, hits=4, load_seconds=0.25)
    total = sum_loads([a, b])
    assert total.num_running == 5 and list(total.running_lora_adapters) == ["x", "y"]
    got = {t.tier: (t.bytes, t.hits, t.load_seconds) for t in total.kv_tiers}
    assert got == {"disk": (15, 5, 0.75), "host": (7, 2, 0.0)}
