"""Every command the README and the reference docs show names a module or script that exists,
and every flag it passes is one that module (or a module it imports from this repository)
declares: the docs cannot drift from the code unnoticed. Read statically: nothing runs
(`python -m tools.doc_commands --run` runs them)."""

from __future__ import annotations

import pytest

from tools.doc_extract import DOCS, ROOT, commands, problems_of


def test_the_docs_show_commands():
    assert sum(1 for _, line in commands() if problems_of(line) is not None) > 50


@pytest.mark.parametrize("doc", [d.relative_to(ROOT).as_posix() for d in DOCS])
def test_every_documented_command_exists_with_its_flags(doc):
    bad = [
        f"{line!r}: {problem}"
        for where, line in commands()
        if where == doc
        for problem in problems_of(line) or []
    ]
    assert not bad, "\n".join(bad)


def test_a_stale_command_is_caught():
    assert problems_of("python -m tools.traces synth --rate 1 --no-such-flag") == [
        "tools.traces declares no --no-such-flag"
    ]
    assert problems_of("python -m bench.no_such_module") == ["no module bench.no_such_module"]
    assert problems_of("bash scripts/no-such.sh") == ["no script scripts/no-such.sh"]
    assert problems_of("python -m tools.traces synth --input-range 1 2") == []
