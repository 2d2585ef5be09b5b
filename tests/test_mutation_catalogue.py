"""The mutation catalogue stays plantable: a refactor that removes a mutation's text fails here, in seconds,
rather than at the end of ``make mutations`` (tests/mutations.py)."""

from __future__ import annotations

import pytest

from tests.mutations import CATALOGUE, REPO_ROOT, Mutation


def test_names_are_unique() -> None:
    names = [m.name for m in CATALOGUE]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize("mutation", CATALOGUE, ids=lambda m: m.name)
def test_each_mutation_finds_its_text_once_and_names_existing_tests(mutation: Mutation) -> None:
    count = (REPO_ROOT / mutation.path).read_text().count(mutation.find)
    assert count == 1, f"{mutation.name}: its text occurs {count} times in {mutation.path}; rewrite it for the code"
    assert mutation.find != mutation.replace, f"{mutation.name} plants nothing"
    for test in mutation.tests:
        file, _, function = test.partition("::")
        source = (REPO_ROOT / file).read_text()
        assert not function or f"def {function.split('[')[0]}(" in source, f"{mutation.name}: no test {test}"
