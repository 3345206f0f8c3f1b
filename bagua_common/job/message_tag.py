"""Message tags: proof that a message was written by a holder of a key (the job's secret, a cache's digest key).

A tag is HMAC-SHA256 under the key over a purpose (so that a tag made for one use is never accepted by another)
and the message's parts, each prefixed with its length (so that parts cannot be re-split into another message
with the same bytes). Every place that signs with a key uses these two functions.
"""

from __future__ import annotations

import hashlib
import hmac

__all__ = ["TAG_BYTES", "message_tag", "tag_matches"]

TAG_BYTES = 32
"""The length of a full tag (HMAC-SHA256's); a shorter one is its prefix."""


def message_tag(key: bytes, purpose: bytes, *parts: bytes | memoryview, size: int = TAG_BYTES) -> bytes:
    """The tag of ``parts`` under ``key`` for ``purpose``: the first ``size`` bytes (at most 32) of
    HMAC-SHA256(key, purpose and each part, every one prefixed with its length)."""
    if not 0 < size <= TAG_BYTES:
        raise ValueError(f"a message tag has 1 to {TAG_BYTES} bytes, not {size}")
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in (purpose, *parts):
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    return mac.digest()[:size]


def tag_matches(
    tag: bytes | memoryview, key: bytes, purpose: bytes, *parts: bytes | memoryview, size: int = TAG_BYTES
) -> bool:
    """Whether ``tag`` is the ``size``-byte tag of ``parts`` under ``key`` for ``purpose``, compared in constant
    time (a tag of another length never matches: a short one would be guessed)."""
    return hmac.compare_digest(bytes(tag), message_tag(key, purpose, *parts, size=size))
