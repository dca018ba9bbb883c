"""Token ids as text: JSON digits each followed by a comma (`151644,8948,`), as the engine sent them.

The capture graph, the splice and the engine client all hold ids this way: the text is sliced
straight out of the engine's reply, so thousands of prompt ids are never turned into Python ints,
and byte prefixes ending at a comma are exactly token prefixes.
"""

from __future__ import annotations

import msgspec

SEP = b","
_DIGITS = b"0123456789"
_WHITESPACE = b" \t\r\n"


def token_text(ids: list[int]) -> bytes:
    """Token ids as the tree's text: each id's digits followed by a comma."""
    return msgspec.json.encode(ids)[1:-1] + SEP if ids else b""


def ids_text(array_json: bytes) -> tuple[bytes, int] | None:
    """The tree's text and the token count of a valid JSON array of ids (as an engine sent it), or None.

    Valid JSON holding only digits and commas inside one pair of brackets is a flat array of
    non-negative integers, so one C-level pass (deleting the digits) both checks it and counts it.
    """
    if b" " in array_json or b"\n" in array_json:
        array_json = array_json.translate(None, _WHITESPACE)
    commas = array_json.translate(None, _DIGITS)
    if len(commas) < 2 or commas != b"[" + SEP * (len(commas) - 2) + b"]":
        return None
    inner = array_json[1:-1]
    return (inner + SEP, len(commas) - 1) if inner else (b"", 0)


def ids_array(text: bytes) -> msgspec.Raw:
    """Token text as the JSON array of its ids, to send as it is (no ids turned into ints)."""
    return msgspec.Raw(b"[" + text[:-1] + b"]" if text else b"[]")


def token_ids(text: bytes) -> list[int]:
    return msgspec.json.decode(ids_array(text))


def count_tokens(text: bytes) -> int:
    return text.count(SEP)


def offset_after(text: bytes, tokens: int) -> int:
    """Byte offset just past the first `tokens` tokens of `text`."""
    return len(text) - len(text.split(SEP, tokens)[-1]) if tokens else 0
