"""The one comparison of a recorded target with a given one, which `train` (a cache) and `eval` (an
export) both make."""

from __future__ import annotations

import dataclasses

import pytest

from dflash_cache.errors import UserError
from dflash_cache.store.manifest import TargetIdentity
from dflash_cache.target.identity import TARGET_FIELDS, TargetRecord, first_difference

RECORDED = TargetIdentity(name="/models/a", model_type="qwen3", config_hash="0123456789abcdef", dtype="bfloat16",
                          num_hidden_layers=36, hidden_size=4096, vocab_size=151936, weights_fingerprint="a" * 16)
OTHER = dict(model_type="llama", num_hidden_layers=28, hidden_size=2048, vocab_size=32000, config_hash="f" * 16)
RECORD = TargetRecord(RECORDED, "cache manifest", "extracted from", "extract a cache for this target")


def test_the_same_model_under_another_name_or_dtype_is_no_difference():
    same = dataclasses.replace(RECORDED, name="/moved/a", dtype="float32")
    assert first_difference(RECORDED, same, weights=True) is None
    RECORD.check(same, weights=True)


def test_the_most_telling_difference_is_named_first():
    """Each field in turn differs along with every field after it: the first of them is the one named."""
    assert set(OTHER) == set(TARGET_FIELDS)
    for i, field in enumerate(TARGET_FIELDS):
        given = dataclasses.replace(RECORDED, weights_fingerprint="b" * 16,
                                    **{name: OTHER[name] for name in TARGET_FIELDS[i:]})
        assert first_difference(RECORDED, given) == field
        assert first_difference(RECORDED, given, weights=True) == field


def test_other_weights_differ_only_when_weights_are_compared():
    finetune = dataclasses.replace(RECORDED, name="/models/finetune", weights_fingerprint="b" * 16)
    assert first_difference(RECORDED, finetune) is None
    assert first_difference(RECORDED, finetune, weights=True) == "weights_fingerprint"
    RECORD.check(finetune)
    with pytest.raises(UserError, match="field target.weights_fingerprint is 'aaaa"):
        RECORD.check(finetune, weights=True)


def test_a_refusal_is_one_line_naming_the_record_both_models_and_the_field():
    given = dataclasses.replace(RECORDED, name="/models/b", num_hidden_layers=28, config_hash="f" * 16)
    with pytest.raises(UserError) as e:
        RECORD.check(given)
    assert str(e.value) == ("cache manifest field target.num_hidden_layers is 36 (extracted from target /models/a), "
                            "but --target /models/b has 28; extract a cache for this target")
    beside = RECORD.refusal("layer_ids", (1, 9), "/models/b", (1, 2))  # what the record holds beside the identity
    assert str(beside) == ("cache manifest field layer_ids is (1, 9) (extracted from target /models/a), "
                           "but --target /models/b has (1, 2); extract a cache for this target")
