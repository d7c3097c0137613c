"""Docstrings agree with signatures (STYLE.md §4): every parameter of a public function or
method is documented under ``Parameters`` and nothing else is, in signature order."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from collections.abc import Callable, Iterator

import pytest

_PACKAGES = ("ddtree.kernels", "ddtree.service", "ddtree.clients")
_SECTION = re.compile(
    r"^( *)Parameters\n\1-{10,}\n(.*?)(?:\n\1[A-Z][a-z]+\n\1-{3,}\n|\Z)", re.S | re.M
)


def _public_callables() -> Iterator[tuple[str, Callable[..., object]]]:
    for package_name in _PACKAGES:
        package = importlib.import_module(package_name)
        # The prefix lets walk_packages import and descend into subpackages (ddtree.clients.toy).
        names = [package_name] + [
            info.name
            for info in pkgutil.walk_packages(package.__path__, prefix=f"{package_name}.")
            if not info.name.rpartition(".")[2].startswith("_")
        ]
        for module_name in names:
            module = importlib.import_module(module_name)
            for name in getattr(module, "__all__", ()):
                obj = getattr(module, name)
                if getattr(obj, "__module__", None) != module_name:
                    continue  # re-exported: checked where it is defined
                if inspect.isclass(obj):
                    yield f"{module_name}.{name}", obj
                    for attr, member in vars(obj).items():
                        if inspect.isfunction(member) and not attr.startswith("_"):
                            yield f"{module_name}.{name}.{attr}", member
                elif inspect.isfunction(obj):
                    yield f"{module_name}.{name}", obj


def _documented(doc: str) -> list[str] | None:
    match = _SECTION.search(doc)
    if match is None:
        return None
    indent = match.group(1)
    names: list[str] = []
    for line in match.group(2).splitlines():
        if line.startswith(indent) and not line.startswith(indent + " ") and " : " in line:
            names += [n.strip().lstrip("*") for n in line.split(" : ")[0].split(",")]
        elif line.startswith(indent) and not line.startswith(indent + " ") and line.strip():
            names += [n.strip().lstrip("*") for n in line.split(",")]
    return names


def _parameters(obj: Callable[..., object]) -> list[str]:
    target = obj.__init__ if inspect.isclass(obj) else obj  # type: ignore[misc]
    names = []
    for parameter in inspect.signature(target).parameters.values():
        if parameter.name in ("self", "cls"):
            continue
        names.append(parameter.name)
    return names


def _documented_of(obj: Callable[..., object]) -> list[str] | None:
    documented = _documented(inspect.getdoc(obj) or "")
    if documented is None and inspect.isclass(obj):
        documented = _documented(inspect.getdoc(obj.__init__) or "")  # type: ignore[misc]
    return documented


# Only docstrings that have a Parameters section are checked: dataclasses document their fields
# beside them, and a few thin wrappers point to the op they wrap.
_CASES = sorted(
    (case for case in _public_callables() if _documented_of(case[1]) is not None),
    key=lambda case: case[0],
)


def test_the_parser_reads_names_and_sees_a_wrong_one() -> None:
    def sample(draft_logits: object, budget: int, *, temperature: float = 1.0) -> None:
        """Sample.

        Parameters
        ----------
        draft_logits : torch.Tensor
            Shape ``(batch_size, draft_len, vocab_size)``.
        budgets : int
            Misnamed.
        temperature : float
            Drafter temperature.
        """

    assert _documented_of(sample) == ["draft_logits", "budgets", "temperature"]
    assert _documented_of(sample) != _parameters(sample)


@pytest.mark.parametrize(("name", "obj"), _CASES, ids=[case[0] for case in _CASES])
def test_documented_parameters_match_the_signature(name: str, obj: Callable[..., object]) -> None:
    assert _documented_of(obj) == _parameters(obj), f"{name}: docstring and signature disagree"
