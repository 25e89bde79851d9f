"""docs/support_matrix.md is what the validation rules say today, every refused combination
is refused by ExGRPOConfig.validate before any actor starts in one line naming fields, and
every test the table names exists; the combinations run as a whole cover every pair of
switch values the table accepts (tests/test_support_matrix_cells.py runs them)."""

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
    for tests in [support_matrix.RUN_WHOLE] + [t for _, t in support_matrix.RUN_BY]:
        for test in tests.split(", "):
            assert (REPO / test.split(" ")[0]).is_file(), test


def test_the_combinations_run_whole_cover_every_accepted_pair_of_switch_values():
    import itertools

    supported = [combo for combo, why in support_matrix.rows() if why is None]
    whole = support_matrix.pairwise_combinations()
    assert all(c in supported for c in whole) and len(whole) < len(supported) / 3
    ran = {((a, c[a]), (b, c[b])) for c in whole for a, b in itertools.combinations(support_matrix.SWITCHES, 2)}
    for combo in supported:
        for a, b in itertools.combinations(support_matrix.SWITCHES, 2):
            assert ((a, combo[a]), (b, combo[b])) in ran, (a, combo[a], b, combo[b])
