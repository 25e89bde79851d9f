"""The config field table: the one definition that defaults, training(), checks and docs share."""

import inspect
from pathlib import Path

import pytest

from rllib_exgrpo.rllib.algorithm import ExGRPOConfig
from rllib_exgrpo.rllib.config_fields import FIELDS, FIELDS_BY_NAME, markdown_table, number, one_of


def _bad_value(f):
    d = f.check.describe.removeprefix("None or ")
    if d.startswith("one of"):
        return "no-such-choice"
    if d == "True or False":
        return "yes"
    if d == "a dict":
        return [1]
    if "string" in d:
        return 7
    if "integer" in d:
        return -1
    return "not a number"


def test_training_signature_lists_every_field_keyword_only():
    params = inspect.signature(ExGRPOConfig.training).parameters
    for f in FIELDS:
        assert params[f.name].kind is inspect.Parameter.KEYWORD_ONLY, f.name
    assert "lr" in params and "minibatch_size" in params  # RLlib's own stay
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    doc = ExGRPOConfig.training.__doc__
    assert all(f"    {f.name}: " in doc for f in FIELDS)


def test_training_sets_every_field_and_refuses_unknown_keys():
    values = {f.name: f.default for f in FIELDS}
    cfg = ExGRPOConfig().training(**values)
    assert all(getattr(cfg, n) == v for n, v in values.items())
    with pytest.raises(TypeError, match="no_such_field"):
        ExGRPOConfig().training(no_such_field=1)


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_each_rule_refuses_a_bad_value_with_the_field_name(field):
    bad = _bad_value(field)
    message = field.error(bad)
    assert message is not None and message.startswith(f"{field.name} must be ")
    assert repr(bad) in message
    with pytest.raises(ValueError, match=f"{field.name} must be"):
        ExGRPOConfig().training(**{field.name: bad}).validate()


def test_number_and_choice_rules():
    unit = number(0, 1, high_open=True)
    assert unit(0) is None and unit(0.99) is None and unit(1) == "in [0, 1)" and unit(-0.1) == "in [0, 1)"
    assert unit(True) is not None  # a bool is not a number here
    assert one_of(["a", "b"])("c") == "one of ['a', 'b']"


def test_docs_config_md_is_generated_from_the_table():
    text = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    assert text == markdown_table(), "regenerate: python -m rllib_exgrpo.rllib.config_fields"
    assert len(FIELDS_BY_NAME) == len(FIELDS)


def test_no_declared_field_default_is_repeated_outside_the_table():
    """``getattr(config, "<declared field>", <default>)`` repeats (and can contradict) the
    field's default: the package reads ``config.<field>``, or ``field_value`` where the config
    may be RLlib's own."""
    import ast
    from pathlib import Path

    import rllib_exgrpo
    from rllib_exgrpo.rllib.config_fields import FIELDS

    names = {f.name for f in FIELDS}
    found = []
    root = Path(rllib_exgrpo.__file__).parent
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            # getattr(config, "<field>", <default>) and any alias of it (_get, g = getattr, ...):
            # a call of three arguments whose second names a declared field; setattr writes.
            func = node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else None
            if (
                func is not None
                and func != "setattr"
                and len(node.args) == 3
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in names
            ):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {node.args[1].value}")
    assert not found, "declared fields read with a literal default:\n" + "\n".join(found)


def test_field_value_reads_the_config_or_the_table_default():
    from ray.rllib.algorithms.ppo import PPOConfig

    from rllib_exgrpo import ExGRPOConfig
    from rllib_exgrpo.rllib.config_fields import field_value

    assert field_value(PPOConfig(), "skip_update_grad_norm") == ExGRPOConfig().skip_update_grad_norm
    assert field_value(ExGRPOConfig().training(group_size=3), "group_size") == 3
    with pytest.raises(KeyError, match="not an ExGRPOConfig field"):
        field_value(PPOConfig(), "no_such_field")


def test_config_attributes_module_is_generated_from_the_table():
    """``rllib/config_attributes.py`` (the fields' types for type checkers) is what the table
    generates, and ``ExGRPOConfig`` inherits its annotations, one per field, no defaults."""
    import typing

    import rllib_exgrpo.rllib.config_attributes as generated
    from rllib_exgrpo import ExGRPOConfig
    from rllib_exgrpo.rllib.config_fields import attributes_module

    text = Path(generated.__file__).read_text(encoding="utf-8")
    assert text == attributes_module(), "regenerate: python -m rllib_exgrpo.rllib.config_fields"
    hints = typing.get_type_hints(generated.ExGRPOConfigFields)
    assert list(hints) == [f.name for f in FIELDS]
    assert not any(f.name in vars(generated.ExGRPOConfigFields) for f in FIELDS), "annotations only, no defaults"
    assert issubclass(ExGRPOConfig, generated.ExGRPOConfigFields)
    assert hints["group_size"] is int and hints["heldout_dataset"] == typing.Optional[str]
    config = ExGRPOConfig()
    for f in FIELDS:
        assert f.error(getattr(config, f.name)) is None
