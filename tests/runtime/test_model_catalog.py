"""runtime/model_catalog.py: models files (TOML and JSON) and their refusals, names and
aliases, the memory shares, and which models load at start under a budget."""

import json

import pytest

from mlxd.runtime.model_catalog import (Catalog, CatalogError, ModelEntry, build_catalog,
                                        read_models_file)


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_toml_file_and_a_json_file_give_the_same_entries(tmp_path):
    toml = write(tmp_path, "m.toml", """
[[models]]
name = "small"
model = "/models/small"
aliases = ["gpt-4o-mini"]
pinned = true

[[models]]
name = "big"
model = "ORG/Big:Q4_K_M"
replicas = 2
memory_gb = 6.5
""")
    items = [{"name": "small", "model": "/models/small", "aliases": ["gpt-4o-mini"],
              "pinned": True},
             {"name": "big", "model": "ORG/Big:Q4_K_M", "replicas": 2, "memory_gb": 6.5}]
    as_list = write(tmp_path, "m.json", json.dumps(items))
    as_object = write(tmp_path, "o.json", json.dumps({"models": items}))
    expected = [ModelEntry("small", "/models/small", ("gpt-4o-mini",), 1, True, 0.0),
                ModelEntry("big", "ORG/Big:Q4_K_M", (), 2, False, 6.5)]
    assert read_models_file(toml) == read_models_file(as_list) == \
        read_models_file(as_object) == expected


def test_replicas_default_to_the_given_number(tmp_path):
    path = write(tmp_path, "m.json", json.dumps([{"model": "a"}]))
    assert read_models_file(path, replicas=3)[0].replicas == 3


@pytest.mark.parametrize("text,says", [
    ("{", "not valid JSON"),
    ("[]", "non-empty list"),
    ('{"model": "a"}', "non-empty list"),
    ('["a"]', "expected a table"),
    ('[{"model": "a", "gpu": 1}]', "unknown keys ['gpu']"),
    ('[{"model": 5}]', "model has the wrong type"),
    ('[{"model": "a", "replicas": true}]', "replicas has the wrong type"),
    ('[{"model": "a", "replicas": 0}]', "replicas must be >= 1"),
    ('[{"model": "a", "memory_gb": -1}]', "memory_gb >= 0"),
    ('[{"model": "a", "aliases": [""]}]', "aliases must be non-empty"),
    ('[{"replicas": 1}]', "give at least `model`"),
])
def test_a_bad_models_file_is_refused_saying_why(tmp_path, text, says):
    with pytest.raises(CatalogError, match="--models .*" + says.replace("[", r"\[")
                       .replace("]", r"\]").replace("(", r"\(")):
        read_models_file(write(tmp_path, "m.json", text))


def test_a_missing_or_bad_toml_file_is_refused(tmp_path):
    with pytest.raises(CatalogError, match="No such file"):
        read_models_file(str(tmp_path / "absent.json"))
    with pytest.raises(CatalogError, match="not valid TOML"):
        read_models_file(write(tmp_path, "m.toml", "[[models]\n"))


def entries(*specs) -> list[ModelEntry]:
    return [ModelEntry(name, name, aliases, pinned=pinned, memory_gb=gb, path="/" + name)
            for name, aliases, pinned, gb in specs]


def test_a_name_or_alias_given_twice_is_refused():
    with pytest.raises(CatalogError, match="'x' is given to two models"):
        build_catalog(entries(("a", ("x",), False, 0), ("x", (), False, 0)), 0, 8, 0.3)
    with pytest.raises(CatalogError, match="has no name"):
        build_catalog(entries(("", (), False, 0)), 0, 8, 0.3)


def test_without_a_budget_every_model_loads_at_start_with_an_equal_share():
    catalog = build_catalog(entries(("a", (), False, 0), ("b", (), False, 0),
                                    ("c", (), False, 2.0)), 0, 9.0, 0.3)
    assert catalog.at_start == ("a", "b", "c")
    assert [catalog.memory_of(e) for e in catalog.entries] == [3.0, 3.0, 2.0]
    assert catalog.entry("b") is catalog.entries[1] and catalog.entry("z") is None


def test_under_a_budget_pinned_models_load_first_then_the_others_in_order_while_they_fit():
    catalog = build_catalog(entries(("a", (), False, 2.0), ("b", (), False, 2.0),
                                    ("p", ("alias",), True, 1.0), ("c", (), False, 1.0)),
                            4.0, 16.0, 0.3)
    assert catalog.at_start == ("p", "a", "c")
    assert catalog.entry("alias").name == "p"


def test_a_budget_too_small_for_the_pinned_models_or_for_one_model_is_refused():
    with pytest.raises(CatalogError, match="pinned models need 3.00 GiB"):
        build_catalog(entries(("a", (), True, 2.0), ("b", (), True, 1.0)), 2.5, 16, 0.3)
    with pytest.raises(CatalogError, match="b: needs more than --models-memory"):
        build_catalog(entries(("a", (), False, 1.0), ("b", (), False, 3.0)), 2.5, 16, 0.3)


def test_the_catalog_round_trips_through_its_file(tmp_path):
    catalog = build_catalog(entries(("a", ("x", "y"), True, 1.5), ("b", (), False, 0)),
                            4.0, 6.0, 0.3)
    path = str(tmp_path / "catalog.json")
    catalog.dump(path)
    assert Catalog.load(path) == catalog
