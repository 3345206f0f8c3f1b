"""The public names stay: every module and ``__all__`` name in ``public_api.txt`` still imports.

``public_api.txt`` lists the public modules (no path part with a leading underscore) of the four
packages and the names of their ``__all__``, as of the last release and since. A module or name
that moved must keep working for one release with a ``DeprecationWarning`` that names its new
place (:mod:`bagua_common.moved`); one removed on purpose is taken out of the list in the same
change, where a reviewer sees it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fresh_interpreter import run_json

LISTED = Path(__file__).resolve().parent / "public_api.txt"

PROBE = r"""
import importlib, json, sys, warnings
found = {}
for line in dict.fromkeys(sys.stdin.read().split()):
    module, _, name = line.partition(":")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = importlib.import_module(module)
            if name:
                value = getattr(value, name)
        except (ImportError, AttributeError) as error:
            found[line] = ["missing", f"{type(error).__name__}: {error}"]
            continue
    moved = [
        str(w.message) for w in caught if issubclass(w.category, DeprecationWarning) and " moved to " in str(w.message)
    ]
    found[line] = ["moved", moved[0]] if moved else ["here", ""]
print(json.dumps(found))
"""


def probe(lines: list[str]) -> dict[str, list[str]]:
    """Each line's fate in a fresh interpreter: ``here``, ``moved`` (with the warning) or ``missing``."""
    return run_json(PROBE, stdin="\n".join(lines))


DEMO = ["bagua_torch:with_bagua", "bagua_torch:no_such_name", "bagua_common.elastic_sampler"]


@pytest.fixture(scope="module")
def found() -> dict[str, list[str]]:
    """The fate of every listed line and of :data:`DEMO`'s, from one interpreter."""
    return probe(DEMO + LISTED.read_text().split())  # DEMO first: a moved module warns on its first import


def test_every_listed_public_name_imports_or_warns_where_it_went(found):
    listed = {line: found[line] for line in LISTED.read_text().split()}
    missing = {line: why for line, (fate, why) in listed.items() if fate == "missing"}
    assert not missing, f"public names gone without a deprecation (bagua_common.moved): {missing}"
    moved = {line: why for line, (fate, why) in listed.items() if fate == "moved"}
    for line, message in moved.items():
        module = line.partition(":")[0]
        assert message.split(" moved to ")[0] in (module, line.replace(":", ".")), (line, message)
    assert "bagua_torch.algorithms.q_adam" in moved  # the project's own path until the last round


def test_the_probe_tells_a_vanished_name_from_a_moved_one(found):
    """It can fail: a name that is not there is reported missing, a moved module as moved."""
    assert found["bagua_torch:with_bagua"][0] == "here"
    assert found["bagua_torch:no_such_name"][0] == "missing"
    assert found["bagua_common.elastic_sampler"] == [
        "moved",
        "bagua_common.elastic_sampler moved to bagua_common.data.elastic_sampler; "
        "the old name goes in the next release",
    ]
