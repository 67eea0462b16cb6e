"""The logprob scores (sampler._score) against the whole-vocabulary count they shortcut: a rank read
off the top k must equal 1 + the number of strictly greater logprobs, for tokens inside the top k,
on its boundary, tied with it, and far outside it."""

from __future__ import annotations

import torch

from engine_svc.sampler import _score


def reference(lp: torch.Tensor, chosen: torch.Tensor, top_n: int):
    chosen_lp = lp.gather(1, chosen[:, None]).squeeze(1)
    ranks = (lp > chosen_lp[:, None]).sum(dim=-1) + 1
    return chosen_lp, ranks


def test_ranks_equal_the_full_count_inside_on_and_outside_the_top_k():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 5000, generator=g)
    logits[:, 100:120] = logits[:, 100:101]  # a run of ties
    logits[5, :] = 0.0  # a row that is all one value
    lp = logits.log_softmax(dim=-1)
    order = lp.argsort(dim=-1, descending=True)
    cases = {"inside": 0, "boundary": 0, "outside": 0}
    for top_n in (0, 1, 3, 20):
        k = max(top_n, 1)
        picks = []
        for r in range(lp.shape[0]):
            kind = r % 4
            if kind == 0:
                picks.append(order[r, 0])  # the greedy token
            elif kind == 1:
                picks.append(order[r, k - 1])  # the k-th largest: on the boundary
            elif kind == 2:
                picks.append(torch.tensor(110))  # inside the ties
            else:
                picks.append(order[r, 3000])  # far outside
        chosen = torch.stack(picks)
        got_lp, got_ranks, top_lp, top_ids = _score(lp, chosen, top_n)
        ref_lp, ref_ranks = reference(lp, chosen, top_n)
        assert torch.equal(got_lp, ref_lp)
        assert torch.equal(got_ranks, ref_ranks), top_n
        assert torch.equal(top_lp, lp.topk(k, dim=-1).values)
        inside = got_lp >= top_lp[:, k - 1]
        cases["inside"] += int(inside.sum())
        cases["outside"] += int((~inside).sum())
        cases["boundary"] += int((got_lp == top_lp[:, k - 1]).sum())
    assert all(cases.values()), cases  # every path was taken
