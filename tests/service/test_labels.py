"""Client ids and model labels: exactly the documented alphabet, nothing after it."""

from __future__ import annotations

import pytest

from ddtree.service.calls import validate_model_label
from ddtree.service.errors import InvalidArgument, InvalidModelLabel
from ddtree.service.memory import check_client_id


@pytest.mark.parametrize("label", ["", "kimi-k2", "deepseek_v3:0.1", "a" * 64])
def test_labels_of_the_alphabet_pass(label: str) -> None:
    validate_model_label("request.model", label)
    check_client_id("request.client_id", label)


@pytest.mark.parametrize("label", ["abc\n", "\nabc", "a b", "a/b", "é", "a" * 65])
def test_other_labels_are_refused_naming_the_field(label: str) -> None:
    with pytest.raises(InvalidModelLabel, match=r"^request\.model: "):
        validate_model_label("request.model", label)
    with pytest.raises(InvalidArgument, match=r"^request\.client_id: "):
        check_client_id("request.client_id", label)
