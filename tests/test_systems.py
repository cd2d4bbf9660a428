"""Rows and rerankers are keyed by stable ids; the display labels come from one table, only where text is
rendered (`confrag.reranker.systems`)."""

from __future__ import annotations

import pytest

from confrag.reports.tables import markdown_table
from confrag.reranker.label_rules import RULES
from confrag.reranker.listwise_teachers import LISTWISE
from confrag.reranker.systems import ALL, LABELS, TABLE1, aligned, check_reranker, confidence_ft, label, labelled


def test_every_id_has_one_label_and_the_rule_family_follows_the_rules():
    assert [confidence_ft(rule) for rule in RULES] == [s for s in TABLE1 if s.startswith("confidence_ft.")]
    labels = [label(system) for system in ALL]
    assert len(set(labels)) == len(ALL)  # no two rows read the same
    assert label("confidence_ft.sign") == "base + confidence FT (sign)" and label("bm25") == "BM25"
    families = {confidence_ft(rule) for rule in RULES} | {aligned(teacher) for teacher in LISTWISE}
    assert set(LABELS) | families == set(ALL)
    assert label(aligned("likelihood")) == "base aligned to likelihood (listwise)"


@pytest.mark.parametrize("system", ["confidence_ft.nope", "confidence_ft", "BM25", "base reranker"])
def test_a_label_or_an_unknown_id_has_no_label(system):
    with pytest.raises(ValueError, match=rf"no system has the id {system!r}; ids: bm25, bi_encoder, base"):
        label(system)


def test_a_config_may_name_only_a_table1_row():
    assert check_reranker("confidence_ft.rank", "cbdr.reranker") == "confidence_ft.rank"
    for value in ("oracle", "base + confidence FT (sign)", None, 3):
        with pytest.raises(ValueError, match=r"cbdr\.reranker=.* is not one of \('bm25', 'bi_encoder', 'base'"):
            check_reranker(value, "cbdr.reranker")


def test_a_row_is_written_with_its_label_and_its_id_and_rendered_by_label():
    rows = [
        labelled({"system": "base", "P@1": 50.0, "MRR@1": 50.0}, "system"),
        labelled({"system": confidence_ft("sign"), "P@1": 100.0, "MRR@1": 100.0}, "system"),
    ]
    assert rows[0] == {"system": "base reranker", "id": "base", "P@1": 50.0, "MRR@1": 50.0}
    table = markdown_table(rows, "Table 1").splitlines()
    assert table[2] == "| Reranker | P@1 | MRR@1 |"  # the id is no column
    assert table[4:] == ["| base reranker | 50.00 | 50.00 |", "| base + confidence FT (sign) | 100.00 | 100.00 |"]
