"""Size bounds on the client's strings, checked before any work is done on them.

Each check costs at most one pass over a field already bounded by the one before it: the message
count is read first (O(1)), so a chat of millions of messages is refused without looking at any of
them. Violations name the field and the limit and quote at most a short prefix of what was sent.
"""

from __future__ import annotations

from gateway.errors import FieldViolation
from gateway.limits import Limits
from gateway.quoting import quote, utf8_len_over


def check_text(text: str, field: str, limits: Limits) -> list[FieldViolation]:
    if not text:
        return [FieldViolation(field, "must not be empty")]
    if len(text) > limits.max_prompt_chars:
        return [FieldViolation(field, f"has {len(text)} characters; the limit is {limits.max_prompt_chars}")]
    size = utf8_len_over(text, limits.max_prompt_bytes)
    if size is not None:
        return [
            FieldViolation(
                field, f"has {size} UTF-8 bytes; the limit is max_prompt_bytes={limits.max_prompt_bytes}"
            )
        ]
    return []


def check_chat(messages, field: str, limits: Limits) -> list[FieldViolation]:
    """``messages``: the proto's repeated ChatMessage. At most one violation per message, and the
    scan stops after a few, so that a million bad messages do not make a million-entry error."""
    count = len(messages)
    if not count:
        return [FieldViolation(field, "must not be empty")]
    if count > limits.max_chat_messages:
        return [
            FieldViolation(
                field, f"has {count} messages; the limit is max_chat_messages={limits.max_chat_messages}"
            )
        ]
    out: list[FieldViolation] = []
    allowed = limits.allowed_roles
    chars = 0
    for i, m in enumerate(messages):
        role, content = m.role, m.content
        chars += len(role) + len(content)
        if len(out) >= 8:
            continue
        if not role:
            out.append(FieldViolation(f"{field}[{i}].role", "must not be empty"))
        elif len(role) > limits.max_role_bytes or utf8_len_over(role, limits.max_role_bytes):
            out.append(
                FieldViolation(
                    f"{field}[{i}].role",
                    f"has {len(role)} characters; the limit is max_role_bytes={limits.max_role_bytes}",
                )
            )
        elif allowed and role not in allowed:
            out.append(
                FieldViolation(f"{field}[{i}].role", f"{quote(role)} is not one of {', '.join(allowed)}")
            )
    if chars > limits.max_prompt_chars:
        out.append(
            FieldViolation(
                field, f"have {chars} characters; the limit is max_prompt_chars={limits.max_prompt_chars}"
            )
        )
    elif 4 * chars > limits.max_prompt_bytes:
        size = sum(_utf8_len(m.role) + _utf8_len(m.content) for m in messages)
        if size > limits.max_prompt_bytes:
            out.append(
                FieldViolation(
                    field,
                    f"have {size} UTF-8 bytes of roles and contents; the limit is "
                    f"max_prompt_bytes={limits.max_prompt_bytes}",
                )
            )
    return out


def check_model_name(name: str, limits: Limits) -> list[FieldViolation]:
    if len(name) > limits.max_model_name_bytes or utf8_len_over(name, limits.max_model_name_bytes):
        return [
            FieldViolation(
                "model",
                f"{quote(name)} is longer than max_model_name_bytes={limits.max_model_name_bytes}",
            )
        ]
    return []


MAX_LORA_NAME_BYTES = 256  # the engine's bound on adapter names (engine_svc/lora/manager.py)


def check_lora_name(name: str) -> list[FieldViolation]:
    if len(name) > MAX_LORA_NAME_BYTES or utf8_len_over(name, MAX_LORA_NAME_BYTES):
        return [FieldViolation("lora", f"{quote(name)} is longer than {MAX_LORA_NAME_BYTES} UTF-8 bytes")]
    return []


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))
