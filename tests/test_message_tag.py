"""Message tags (bagua_common.job.message_tag) against HMAC-SHA256 computed here from the documented layout."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from bagua_common.job.message_tag import TAG_BYTES, message_tag, tag_matches

KEY = b"k" * 24


def reference(key: bytes, purpose: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(len(p).to_bytes(8, "little") + p for p in (purpose, *parts)), hashlib.sha256).digest()


def test_the_tag_is_hmac_sha256_of_the_length_prefixed_parts():
    assert message_tag(KEY, b"use", b"ab", b"c") == reference(KEY, b"use", b"ab", b"c")
    assert message_tag(KEY, b"use", memoryview(b"xyz"), size=16) == reference(KEY, b"use", b"xyz")[:16]
    assert tag_matches(reference(KEY, b"use", b"ab", b"c"), KEY, b"use", b"ab", b"c")


@pytest.mark.parametrize(
    "other",
    [
        (KEY, b"use", b"a", b"bc"),  # the same bytes split otherwise
        (KEY, b"other use", b"ab", b"c"),
        (b"j" * 24, b"use", b"ab", b"c"),
        (KEY, b"use", b"ab", b"d"),
    ],
)
def test_a_tag_matches_only_its_key_purpose_and_parts(other):
    assert not tag_matches(message_tag(KEY, b"use", b"ab", b"c"), *other)


def test_a_tag_of_another_length_never_matches():
    tag = message_tag(KEY, b"use", b"ab")
    assert not tag_matches(tag[:1], KEY, b"use", b"ab")
    assert not tag_matches(tag[:16], KEY, b"use", b"ab")
    assert tag_matches(tag[:16], KEY, b"use", b"ab", size=16)
    assert not tag_matches(b"", KEY, b"use", b"ab")
    with pytest.raises(ValueError):
        message_tag(KEY, b"use", size=TAG_BYTES + 1)
