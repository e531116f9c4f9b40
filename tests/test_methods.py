"""The method registry: one table that config, CLI, bench and the engine factory all read."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from batchspec.bench.methods import MethodSpec, parse_methods
from batchspec.config import BatchspecError, SpecConfig
from batchspec.engine import Engine
from batchspec.layouts import Layout
from batchspec.methods import METHODS, correct_methods, wrong_methods


def test_every_method_resolves_to_a_layout_and_an_engine():
    for method in METHODS.values():
        assert issubclass(method.layout_class(), Layout)
        assert issubclass(method.engine_class(), Engine)
        assert method.default_scheduler in method.schedulers
    assert correct_methods() == ["ar", "eqspec", "ragged", "exspec"]
    assert wrong_methods() == ["naive-kv", "naive-positions", "naive-bonus", "naive-state"]


def test_one_default_scheduler_and_speculation_everywhere():
    """`ragged@4` means the same in `bench` as `--method ragged` in `generate`: the ragged layout
    speculates adaptively by default, the paper's methods verify a fixed K as the paper does."""
    for name, method in METHODS.items():
        assert SpecConfig(method=name).scheduler == MethodSpec(name, 4).scheduler == method.default_scheduler
        assert SpecConfig(method=name).speculation == MethodSpec(name, 4).speculation == method.default_speculation
    ragged = parse_methods("ragged@4", [4])[1]
    assert ragged.scheduler == SpecConfig(method="ragged").scheduler == "continuous"
    assert ragged.speculation == SpecConfig().speculation == "adaptive"
    assert SpecConfig(method="eqspec").speculation == SpecConfig(method="exspec").speculation == "fixed"
    assert ragged.name == "ragged@4"
    assert parse_methods("ragged+static@4", [4])[1].name == "ragged+static@4"
    assert parse_methods("ragged+fixed@4", [4])[1].name == "ragged+fixed@4"
    assert parse_methods("eqspec+adaptive@4", [4])[1].name == "eqspec+adaptive@4"
    assert parse_methods("eqspec+fixed@4", [4])[1].name == "eqspec@4"


@pytest.mark.parametrize("method, own", [("eqspec", "static"), ("exspec", "pool"), ("naive-kv", "static")])
def test_schedulers_a_method_lacks_are_refused(method, own):
    with pytest.raises(BatchspecError, match=f"method {method} supports the {own} scheduler, not continuous"):
        SpecConfig(method=method, scheduler="continuous")
    with pytest.raises(BatchspecError, match=f"supports the {own} scheduler"):
        parse_methods(f"{method}+continuous@2", [2])
    with pytest.raises(BatchspecError, match="max_prefill_tokens .* needs the continuous scheduler"):
        SpecConfig(method=method, max_prefill_tokens=8)


def test_engine_and_correct_methods_do_not_load_forensics():
    """The engine never imports the forensics package, and the deliberately wrong methods' code is
    loaded only when one of them is built (no registration by import side effect)."""
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from batchspec.llm import LLM\n"
        "from batchspec.build import build_engine\n"
        "from batchspec.config import SpecConfig\n"
        "from tinyworld import tiny_model\n"
        "m = tiny_model('llama')\n"
        "build_engine(m, SpecConfig(method='ragged'), draft_model=m).generate([[5, 6]], __import__('batchspec').SamplingParams(max_new_tokens=3))\n"
        "assert not any(n.startswith('batchspec.forensics') for n in sys.modules), sorted(sys.modules)\n"
        "build_engine(m, SpecConfig(method='naive-bonus'), draft_model=m)\n"
        "assert 'batchspec.forensics.broken' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
