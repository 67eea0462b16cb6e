"""Which FIM order completes better: the same keystroke sessions laid out prefix-suffix-middle (PSM)
and suffix-prefix-middle (SPM), greedy, through the offline engine.

    python -m benchmarks.fim_order [--model models/qwen2.5-coder-0.5b] [--keystrokes 10]

SPM puts the suffix before the prefix, so a keystroke recomputes only the prompt's changed tail
(benchmarks/autocomplete.py measures the time); whether a model completes as well from it is what
this measures. Sessions: standard-library modules nobody here wrote, the cursor at the start of a
long line at several depths, the user typing that line one character a keystroke, two other modules
as the repository's files (as in benchmarks/autocomplete.py, whose first session this is). Per
order: how many completions continue the real text (their first 10 characters, the autocomplete
benchmark's rule) and how many complete the rest of the line exactly. The prompts are built by
tokenizer_svc/fim.py as the gateway builds them; a session's keystrokes go to the engine together
(a request's greedy output does not depend on what shares its steps).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.autocomplete import MODEL, continues, session
from benchmarks.common import RESULTS_DIR, write_result

# (module, characters before the cursor): the first is benchmarks/autocomplete.py's session.
SESSIONS = (
    ("textwrap", 6000),
    ("textwrap", 12000),
    ("fnmatch", 2500),
    ("colorsys", 2000),
    ("bisect", 1500),
    ("heapq", 9000),
    ("glob", 4000),
    ("shutil", 20000),
)
CONTEXT = ("string", "shlex")


def line_done(completion: str, rest_of_line: str) -> bool:
    """The completion's first line is the rest of the real line."""
    return completion.split("\n", 1)[0].rstrip() == rest_of_line.rstrip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=MODEL, help="a GGUF file or a folder with one")
    ap.add_argument("--keystrokes", type=int, default=10)
    ap.add_argument("--n-predict", type=int, default=32)
    ap.add_argument("--sessions", type=int, default=len(SESSIONS))
    ap.add_argument("--orders", default="psm,spm")
    ap.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args()
    from engine_svc import LLM, SamplingParams
    from tokenizer_svc.fim import FimInput, build_ids, find_fim

    gguf = args.model if args.model.is_file() else next(args.model.glob("*.gguf"))
    llm = LLM(model=str(gguf), max_model_len=8192)
    tok = llm.get_tokenizer()
    spec = find_fim(tok.token_to_id, tok.bos_token_id, None, tok.convert_ids_to_tokens)

    def encode(text):
        return tok.encode(text, add_special_tokens=False, parse_special_tokens=False)

    params = SamplingParams(temperature=0, max_tokens=args.n_predict, stop_token_ids=list(spec.end_ids))
    orders = args.orders.split(",")
    result: dict = {"model": gguf.name, "keystrokes_per_session": args.keystrokes, "sessions": []}
    totals = {o: {"continues": 0, "line": 0, "same_as_psm": 0} for o in orders}
    for module, chars in SESSIONS[: args.sessions]:
        s = session(args.keystrokes, chars, module, CONTEXT)
        row: dict = {"file": s["file"], "line": s["typed"].strip(), "orders": {}}
        texts: dict[str, list[str]] = {}
        for order in orders:
            prompts = []
            for k in range(1, args.keystrokes + 1):
                inp = FimInput(s["before"] + s["typed"][:k], "\n" + s["after"], s["extra"], order=order)
                prompts.append({"prompt_token_ids": build_ids(spec, inp, encode, room=8192 - args.n_predict)})
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            texts[order] = [o.outputs[0].text for o in outs]
            rest = [s["typed"][k:] for k in range(1, args.keystrokes + 1)]
            c = sum(continues(t, r + "\n" + s["after"]) for t, r in zip(texts[order], rest, strict=True))
            ln = sum(line_done(t, r.rstrip("\n")) for t, r in zip(texts[order], rest, strict=True))
            row["orders"][order] = {"continues": c, "line": ln, "seconds": time.perf_counter() - t0}
            totals[order]["continues"] += c
            totals[order]["line"] += ln
            if "psm" in texts:
                same = sum(a == b for a, b in zip(texts["psm"], texts[order], strict=True))
                row["orders"][order]["same_as_psm"] = same
                totals[order]["same_as_psm"] += same
            print(
                f"{s['file']} {s['typed'].strip()[:40]!r} {order}: {c}/{args.keystrokes} continue, "
                f"{ln} complete the line",
                flush=True,
            )
        row["completions"] = texts
        result["sessions"].append(row)
    n = args.keystrokes * len(result["sessions"])
    result["totals"] = totals
    result["keystrokes"] = n
    for order in orders:
        t = totals[order]
        print(f"{order}: {t['continues']}/{n} continue the real text, {t['line']}/{n} complete the line")
    print(write_result("fim-order", result, args.results_dir))


if __name__ == "__main__":
    main()
