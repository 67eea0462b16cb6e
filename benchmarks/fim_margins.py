"""How close the calls are: the autocomplete session's keystrokes, greedy with the top-3 logprobs
of every token, ours through the offline engine and (``--llama``) llama-server's ``/infill`` with
``n_probs`` 3, each keystroke sent to llama-server in the order given after a cold start.

    python -m benchmarks.fim_margins --model models/qwen2.5-coder-1.5b --keystrokes 7,9,15 [--llama]

Greedy tokens do not depend on timing, so this runs at normal priority. Per keystroke: the
completion, whether it continues the real text (benchmarks/autocomplete.py's rule), and at each of
the first tokens the top three with their logprobs; where the two sides differ, the first differing
token's margins on both. llama-server's completion depends on what its cache held (a keystroke sent
cold computes the whole prompt in its batches, one after the previous keystroke only the tail), so
its side is of this order of requests; ours is the same whatever came before.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx

from benchmarks.autocomplete import LLAMA_SERVER, MODEL, LlamaServer, continues, keystroke_bodies, session
from benchmarks.common import RESULTS_DIR, write_result


def ours(gguf: Path, s: dict, keys: list[int], n_predict: int) -> dict[int, dict]:
    from engine_svc import LLM, SamplingParams
    from tokenizer_svc.fim import FimInput, build_ids, find_fim

    llm = LLM(model=str(gguf), max_model_len=8192)
    tok = llm.get_tokenizer()
    spec = find_fim(tok.token_to_id, tok.bos_token_id, None, tok.convert_ids_to_tokens)

    def encode(text):
        return tok.encode(text, add_special_tokens=False, parse_special_tokens=False)

    params = SamplingParams(
        temperature=0, max_tokens=n_predict, stop_token_ids=list(spec.end_ids), logprobs=3
    )
    out = {}
    for k in keys:  # one at a time: each after the last is in the prefix cache
        inp = FimInput(s["before"] + s["typed"][:k], "\n" + s["after"], s["extra"])
        ids = build_ids(spec, inp, encode, room=8192 - n_predict)
        o = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
        tops = [
            [
                [tok.decode([t]), round(lp, 3)]
                for lp, t in sorted(zip(x.top_logprobs, x.top_ids, strict=True), reverse=True)
            ]
            for x in o.logprobs
        ]
        out[k] = {"text": o.text, "prompt_tokens": len(ids), "tops": tops}
    return out


def llama(gguf: Path, s: dict, keys: list[int], n_predict: int, threads: int) -> dict[int, dict]:
    bodies = keystroke_bodies(s, max(keys), n_predict)
    server = LlamaServer(LLAMA_SERVER, gguf, threads, 8192)
    out = {}
    try:
        for k in keys:
            r = httpx.post(server.url + "/infill", json={**bodies[k - 1], "n_probs": 3}, timeout=3600).json()
            tops = [
                [[t["token"], round(t["logprob"], 3)] for t in p["top_logprobs"]]
                for p in r.get("completion_probabilities", [])
            ]
            out[k] = {"text": r["content"], "prompt_tokens": r["tokens_evaluated"], "tops": tops}
    finally:
        server.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=MODEL, help="a GGUF file or a folder with one")
    ap.add_argument("--keystrokes", default="7,9,15", help="keystrokes of the session, in this order")
    ap.add_argument("--n-predict", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama", action="store_true", help="llama-server's side too (n_probs 3)")
    ap.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args()
    gguf = args.model if args.model.is_file() else next(args.model.glob("*.gguf"))
    keys = [int(k) for k in args.keystrokes.split(",")]
    s = session(20, 6000)
    sides = {"ours": ours(gguf, s, keys, args.n_predict)}
    if args.llama:
        sides["llama_server"] = llama(gguf, s, keys, args.n_predict, args.threads)
    for k in keys:
        rest = s["typed"][k:] + "\n" + s["after"]
        for name, side in sides.items():
            r = side[k]
            r["continues"] = continues(r["text"], rest)
            print(
                f"keystroke {k} {name}: {r['prompt_tokens']} prompt tokens, "
                f"continues {r['continues']}: {r['text'][:60]!r}"
            )
        if len(sides) == 2:
            a, b = sides["ours"][k]["tops"], sides["llama_server"][k]["tops"]
            at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x[0][0] != y[0][0]), None)
            if at is not None:
                print(f"  first difference at token {at}: ours {a[at][:2]}, llama-server {b[at][:2]}")
    result = {"model": gguf.name, "keystrokes": keys} | {
        name: {str(k): v for k, v in side.items()} for name, side in sides.items()
    }
    print(write_result("fim-margins", result, args.results_dir))


if __name__ == "__main__":
    main()
