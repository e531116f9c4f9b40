import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))
# Tiny models are overhead-bound: one thread beats two (by 5x when other work shares the cores).
# The real-model tests raise it for themselves.
torch.set_num_threads(1)

# Deterministic property tests: the same examples every run, so CI is reproducible.
settings.register_profile(
    "ci", derandomize=True, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("ci")


@pytest.fixture(scope="session")
def tiny_pair_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """HF folders of a tiny Llama target and a perturbed drafter sharing a word-level tokenizer."""
    from tinyworld import save_pair

    return save_pair(tmp_path_factory.mktemp("tiny_pair"))


@pytest.fixture(scope="session", autouse=True)
def _costs_cache(tmp_path_factory):
    """Cost models measured by tests (tiny models) go to a temporary dir, never the user's cache."""
    folder = tmp_path_factory.mktemp("costs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("batchspec.costs.costs_dir", lambda: folder)
        yield
