"""docs/support_matrix.md is what the validation rules say today, every refused combination
is refused by ExGRPOConfig.validate before any actor starts in one line naming fields, and
every test the table names exists."""

from pathlib import Path

from rllib_exgrpo.rllib import support_matrix
from rllib_exgrpo.rllib.config_fields import FIELDS_BY_NAME

REPO = Path(__file__).resolve().parents[1]


def test_the_doc_is_generated_from_the_validation_rules():
    text = (REPO / "docs" / "support_matrix.md").read_text(encoding="utf-8")
    assert text == support_matrix.markdown(), "regenerate: python -m rllib_exgrpo.rllib.support_matrix"


def test_each_refusal_is_one_line_naming_a_field_and_each_named_test_exists():
    table = support_matrix.rows()
    assert any(why is None for _, why in table) and any(why for _, why in table)
    for combo, why in table:
        if why:
            assert "\n" not in why and any(name in why for name in FIELDS_BY_NAME), (combo, why)
    for _, tests in support_matrix.RUN_BY:
        for test in tests.split(", "):
            assert (REPO / test.split(" ")[0]).is_file(), test
