"""The line and block rules of a code completion (tokenizer_svc/code_stop.py), on texts whose right
stop point is known, in every split a stream could deliver them; and the request fields that ask
for them, checked with their limits."""

from __future__ import annotations

import pytest

from tokenizer_svc.code_stop import BLOCK, LINE, CodeStop, block_threshold, cursor_indent

# (text before the cursor, rule, the model's output, what the client gets, whether the rule ended it)
CASES = [
    # the rest of the line
    ("def f(n):\n    return ", LINE, "n * 2\n\nprint(f(3))\n", "n * 2", True),
    # a finished line: the next line (the leading newline is not the line's end)
    ("def f(n):", LINE, "\n    return n\nprint(1)", "\n    return n", True),
    ("x = ", LINE, "1", "1", False),  # ends otherwise: all of it
    # inside a function body (indent 4): statements at 4 and deeper go on, a dedent ends it
    (
        "def f(n):\n    total = 0\n    ",
        BLOCK,
        "for i in range(n):\n        total += i\n    return total\n\n\ndef g():\n    pass\n",
        "for i in range(n):\n        total += i\n    return total",
        True,
    ),
    # at the top level (indent 0): the definition, up to the next unindented line
    (
        "import os\n\n",
        BLOCK,
        "def walk(path):\n    for x in os.listdir(path):\n\n        yield x\nprint(walk('.'))",
        "def walk(path):\n    for x in os.listdir(path):\n\n        yield x",
        True,
    ),
    # the block is over at once: nothing but the cursor line's own end
    ("    return x", BLOCK, "\n\nclass A:\n", "", True),
    # tabs count one each, as spaces do
    ("if x:\n\t", BLOCK, "y()\n\tz()\nw()", "y()\n\tz()", True),
    # C-like code: the closing brace, less indented, ends the block
    (
        "int f(void) {\n    int a = 1;\n    ",
        BLOCK,
        "a += 2;\n    return a;\n}\n",
        "a += 2;\n    return a;",
        True,
    ),
    # trailing blank lines with no line after them: released at the end
    ("def f():\n    ", BLOCK, "pass\n\n", "pass\n\n", False),
]


def _run(rule: str, threshold: int, pieces: list[str]) -> tuple[str, bool]:
    stop = CodeStop(rule, threshold)
    out = ""
    for piece in pieces:
        step = stop.push(piece)
        out += step.text
        if step.ended:
            return out, True
    return out + stop.flush(), False


@pytest.mark.parametrize(("before", "rule", "output", "expected", "ended"), CASES)
def test_the_rule_stops_where_the_code_says_in_every_split(before, rule, output, expected, ended):
    threshold = block_threshold(before)
    assert _run(rule, threshold, [output]) == (expected, ended)
    # one character at a time, and every cut in two: the same text, the same verdict
    assert _run(rule, threshold, list(output)) == (expected, ended)
    for i in range(1, len(output)):
        assert _run(rule, threshold, [output[:i], output[i:]]) == (expected, ended), i


def test_the_threshold_is_the_cursor_lines_indentation_or_the_clients():
    assert cursor_indent("def f():\n        x = 1") == 8
    assert cursor_indent("a\n\t\t") == 2
    assert block_threshold("x = ") == 1  # the top level: a statement ends at an unindented line
    assert block_threshold("def f():\n    y", indent=2) == 2
    # llama.cpp's n_indent: a line indented less than it ends the output
    assert _run(BLOCK, 2, ["a\n  b\n c"]) == ("a\n  b", True)


def test_after_the_end_nothing_more_is_sent():
    stop = CodeStop(LINE)
    assert stop.push("a\nb").text == "a" and stop.ended
    assert stop.push("c").text == "" and stop.flush() == ""
    with pytest.raises(ValueError, match="rule must be"):
        CodeStop("word")


def test_the_request_fields_are_checked_with_their_limits():
    from gateway.errors import RequestError
    from gateway.limits import Limits
    from gateway.validation import validate_generate
    from llmserve_proto.llmserve.v1 import generation_pb2 as pb

    def check(**fields):
        return validate_generate(pb.GenerateRequest(**fields), 1000, 4096, Limits())

    v = check(infill=pb.Infill(prefix="def f():\n\tif x:\n\t\t"), stop_at=pb.STOP_AT_BLOCK)
    assert v.code_stop == (BLOCK, 2)
    assert check(text="x = ", stop_at=pb.STOP_AT_LINE).code_stop == (LINE, 1)
    assert check(text="x", stop_at=pb.STOP_AT_BLOCK, stop_indent=3).code_stop == (BLOCK, 3)
    assert check(text="x").code_stop is None
    bad = [
        (dict(stop_at=7), "stop_at", "STOP_AT_LINE or STOP_AT_BLOCK"),
        (dict(stop_at=pb.STOP_AT_LINE, stop_indent=2), "stop_indent", "needs stop_at: block"),
        (dict(stop_at=pb.STOP_AT_BLOCK, stop_indent=5000), "stop_indent", "[1, 1024]"),
        (dict(supersede_key="k" * 300), "supersede_key", "at most 256"),
        (dict(supersede_key="a\nb"), "supersede_key", "printable"),
    ]
    for fields, field, words in bad:
        with pytest.raises(RequestError) as e:
            check(text="x", **fields)
        [violation] = e.value.violations
        assert violation.field == field and words in violation.description, violation
