"""The `>>>` examples in the package's docstrings run and print what they say."""

import doctest
import importlib
import pkgutil

import pytest

import trl_grpo_ext

MODULES = sorted(name for _, name, _ in pkgutil.walk_packages(trl_grpo_ext.__path__, prefix="trl_grpo_ext."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
