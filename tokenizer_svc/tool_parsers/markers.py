"""How a tool or reasoning grammar writes a marker (``<tool_call>``, ``</think>``) for one vocabulary."""

from __future__ import annotations

import json
from collections.abc import Callable


def marker_for(tokenizer) -> Callable[[str], str]:
    """A marker string in a grammar: its special token where the vocabulary has one (a control
    token never matches text), else the string itself."""

    def marker(s: str) -> str:
        tid = tokenizer.token_to_id(s) if tokenizer is not None else None
        if tid is not None and tid in tokenizer.all_special_ids:
            return f"<[{tid}]>"
        return json.dumps(s)

    return marker
