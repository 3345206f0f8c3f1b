"""The public names stay: every module and ``__all__`` name in ``public_api.txt`` still imports.

``public_api.txt`` lists the public modules (no path part with a leading underscore) of the four
packages and the names of their ``__all__``, as of the last release and since. A module or name
that moved must keep working for one release with a ``DeprecationWarning`` that names its new
place (:mod:`bagua_common.moved`); one removed on purpose is taken out of the list in the same
change, where a reviewer sees it.
"""

from __future__ import annotations

import pytest
from package_probe import LISTED, package_of, package_report


@pytest.fixture(scope="module")
def found() -> dict[str, list[str]]:
    """The fate of every listed line and of the probe's controls, from one fresh interpreter per package (the
    import rules' test reads the same ones)."""
    packages = {package_of(line) for line in LISTED.read_text().split()}
    return {line: fate for package in sorted(packages) for line, fate in package_report(package)["found"].items()}


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
