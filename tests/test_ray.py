"""Scale-out on Ray Data (`batchspec.ray`, `generate --ray`): on a local 2-CPU cluster with the tiny
pair, every row comes back exactly once, token-identical to `LLM.generate` in one process, with
its id and (when Ray Data is asked to preserve it) its place; refused prompts are error rows; an
actor killed mid-batch is restarted and its rows redone."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import ray.data
from tinyworld import WORDS, mixed_prompts_file

from batchspec.cli import main
from batchspec.config import BatchspecError, ModelConfig, SamplingParams, SpecConfig
from batchspec.llm import LLM, RequestOutput
from batchspec.ray import OUTPUT_SCHEMA, BatchspecPredictor, generate_dataset

ROOT = Path(__file__).resolve().parents[1]
SPEC = {"method": "ragged", "num_draft_tokens": 3, "batch_size": 2}
SAMPLING = {"max_new_tokens": 8}
# Fields that must be identical whatever the batching; timings and per-row round counts may differ.
SAME = ("id", "prompt", "prompt_token_ids", "text", "token_ids", "finish_reason", "error")
VICTIM_DIR = "BATCHSPEC_TEST_VICTIM_DIR"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local 2-CPU Ray cluster whose workers import this checkout (and this test module, for the
    killable predictor below)."""
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    victims = tmp_path_factory.mktemp("victims")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
             object_store_memory=256 * 2**20,
             runtime_env={"env_vars": {"PYTHONPATH": path, VICTIM_DIR: str(victims)}})
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield victims
    ray.shutdown()


@pytest.fixture(scope="module")
def model(tiny_pair_dirs) -> dict:
    target, draft = tiny_pair_dirs
    return {"target": str(target), "draft": str(draft)}


@pytest.fixture(scope="module")
def llm(model) -> LLM:
    return LLM(ModelConfig(**model), spec=SpecConfig(**SPEC))


def _rows() -> list[dict]:
    """Greedy and seeded rows, per-row lengths, and four rows batchspec must refuse, interleaved."""
    rng = random.Random(0)
    rows = []
    for i in range(14):
        row = {"id": f"p{i}", "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))}
        if i % 3 == 1:
            row |= {"seed": 100 + i, "temperature": 0.8, "top_p": 0.9}
        if i % 4 == 2:
            row["max_new_tokens"] = 3 + i % 5
        rows.append(row)
    rows.insert(3, {"id": "empty", "prompt": "   "})
    rows.insert(7, {"id": "long", "prompt": "word " * 600})
    rows.insert(11, {"id": "bad-temperature", "prompt": "the water", "temperature": -1.0})
    rows.insert(15, {"id": "no-prompt", "prompt": None})
    return rows


ROWS = _rows()
ERRORS = {
    "empty": "empty prompt",
    "long": "exceeds the model's context",
    "bad-temperature": "temperature must be >= 0",
    "no-prompt": "got NoneType",
}


def _filled(rows: list[dict]) -> list[dict]:
    """Every sampling column on every row (null where unset), as a table-shaped dataset has them."""
    names = ("seed", "temperature", "top_p", "max_new_tokens")
    return [{name: None for name in names} | row for row in rows]


@pytest.fixture(scope="module")
def expected(llm) -> dict[str, dict]:
    """What one process gives: LLM.generate over every valid row at once."""
    valid = [r for r in ROWS if r["id"] not in ERRORS]
    params = [SamplingParams(**(SAMPLING | {k: v for k, v in r.items() if k not in ("id", "prompt")})) for r in valid]
    outputs = llm.generate([r["prompt"] for r in valid], params)
    assert all(o.error is None for o in outputs)
    return {r["id"]: {"id": r["id"], **o.to_json()} for r, o in zip(valid, outputs)}


def _check(rows: list[dict], expected: dict[str, dict]) -> None:
    """Every input row exactly once; valid rows equal the one-process outputs, the others errors."""
    assert sorted(r["id"] for r in rows) == sorted(r["id"] for r in ROWS)
    for row in rows:
        if row["id"] in ERRORS:
            assert ERRORS[row["id"]] in row["error"] and row["token_ids"] == [], row
            continue
        want = expected[row["id"]]
        assert {k: row[k] for k in SAME} == {k: want[k] for k in SAME}, row["id"]
        assert row["rounds"] >= 1 and 0 <= row["accepted"] <= row["drafted"]
        assert 0 <= row["time_to_first_token"] <= row["latency"]


@pytest.fixture
def preserve_order(monkeypatch):
    monkeypatch.setattr(ray.data.DataContext.get_current().execution_options, "preserve_order", True)


@pytest.mark.parametrize("concurrency, batch_size", [(1, 4), (2, 1), (2, 5)])
def test_dataset_matches_one_process(cluster, model, expected, preserve_order, concurrency, batch_size):
    ds = ray.data.from_items(_filled(ROWS), override_num_blocks=4)
    out = generate_dataset(ds, model=model, spec=SPEC, sampling=SAMPLING, concurrency=concurrency,
                           batch_size=batch_size)
    rows = out.take_all()
    assert [r["id"] for r in rows] == [r["id"] for r in ROWS]  # Ray Data's preserve_order holds
    _check(rows, expected)


@pytest.mark.parametrize("fmt", ["json", "parquet"])
def test_files_in_files_out(cluster, model, expected, tmp_path, fmt):
    """read_json/read_parquet in, write_json/write_parquet out; JSONL rows omit unset fields."""
    src = tmp_path / f"prompts.{'jsonl' if fmt == 'json' else 'parquet'}"
    if fmt == "json":
        src.write_text("".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n" for r in ROWS))
        ds = ray.data.read_json(str(src))
    else:
        pq.write_table(pa.Table.from_pylist(_filled(ROWS)), src)
        ds = ray.data.read_parquet(str(src))
    out_dir = tmp_path / "out"
    out = generate_dataset(ds, model=model, spec=SPEC, sampling=SAMPLING, concurrency=1, batch_size=6)
    if fmt == "json":
        out.write_json(str(out_dir))
        rows = [json.loads(line) for f in sorted(out_dir.glob("*.json")) for line in f.read_text().splitlines()]
    else:
        out.write_parquet(str(out_dir))
        table = pq.read_table(out_dir)
        assert table.schema.names == OUTPUT_SCHEMA.names
        rows = table.to_pylist()
    _check(rows, expected)


class VictimPredictor(BatchspecPredictor):
    """The first actor to reach its second batch claims the victim file, writes its pid there and
    waits, mid-batch, for the driver to kill it. Every process records its pid when it serves."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.dir = Path(os.environ[VICTIM_DIR])
        self.calls = 0

    def __call__(self, batch):
        self.calls += 1
        (self.dir / f"pid-{os.getpid()}").touch()
        if self.calls == 2:
            try:
                fd = os.open(self.dir / "victim", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
                time.sleep(60)
                raise RuntimeError("the driver did not kill this actor")
        return super().__call__(batch)


def _kill_victim(victims: Path, stop: threading.Event, killed: list[int]) -> None:
    victim = victims / "victim"
    while not stop.is_set():
        if victim.exists() and victim.read_text():
            pid = int(victim.read_text())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return
        time.sleep(0.05)


def test_killed_actor_is_restarted_and_its_rows_redone(cluster, model, expected):
    victims = cluster
    ds = ray.data.from_items(_filled(ROWS), override_num_blocks=9)
    out = generate_dataset(ds, model=model, spec=SPEC, sampling=SAMPLING, concurrency=2, batch_size=2,
                           predictor=VictimPredictor)
    stop, killed = threading.Event(), []
    killer = threading.Thread(target=_kill_victim, args=(victims, stop, killed))
    killer.start()
    try:
        rows = out.take_all()
    finally:
        stop.set()
        killer.join()
    assert len(killed) == 1, "no actor reached its second batch"
    served = {int(p.name.removeprefix("pid-")) for p in victims.glob("pid-*")}
    assert killed[0] in served and len(served) >= 3  # two actors, then the victim's replacement
    _check(rows, expected)


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.8", "--top-p", "0.9", "--seed", "5"]],
                         ids=["greedy", "seeded"])
def test_cli_ray_writes_what_generate_writes(cluster, tiny_pair_dirs, tmp_path, capsys, sampling):
    target, draft = tiny_pair_dirs
    args = ["generate", "--prompts", str(mixed_prompts_file(tmp_path, "how many people could go")), "--target", str(target), "--draft", str(draft),
            "--batch-size", "2", "--num-draft-tokens", "3", "--speculation", "fixed", "--max-new-tokens", "8", *sampling]
    assert main(args + ["--output", str(tmp_path / "here.jsonl")]) == 0
    here = json.loads(capsys.readouterr().out)
    assert main(args + ["--output", str(tmp_path / "ray.jsonl"), "--ray", "--ray-workers", "2",
                        "--ray-batch-rows", "1"]) == 0
    there = json.loads(capsys.readouterr().out)
    local, remote = ([json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
                     for name in ("here.jsonl", "ray.jsonl"))
    assert [r["id"] for r in remote] == ["a", "empty", "2", "b", "long", "c", "d"]
    assert [{k: r[k] for k in SAME} for r in remote] == [{k: r[k] for k in SAME} for r in local]
    assert [r.keys() for r in remote] == [r.keys() for r in local]
    assert there["prompts"] == 7 and there["errors"] == 3
    assert there["generated_tokens"] == here["generated_tokens"] > 0
    assert there["acceptance_rate"] is not None and there["tokens_per_second"] > 0
    # engine timings come back from every worker's batches
    assert there["time_seconds"]["target_forwards"] > 0 and there["decode_tokens_per_second"] > 0


def test_cli_worker_that_cannot_load_its_models_is_one_clear_line(cluster, tiny_pair_dirs, tmp_path, capsys):
    _, draft = tiny_pair_dirs
    missing = tmp_path / "no-such-model"
    code = main(["generate", "--prompts", str(mixed_prompts_file(tmp_path, "how many people could go")), "--target", str(missing), "--draft", str(draft),
                 "--ray"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    assert last.startswith(f"batchspec generate: error: a Ray worker could not start: model path not found: {missing}")


def test_without_ray_flag_ray_is_never_imported(tiny_pair_dirs, tmp_path):
    target, draft = tiny_pair_dirs
    argv = ["generate", "--prompts", str(mixed_prompts_file(tmp_path, "how many people could go")), "--target", str(target), "--draft", str(draft),
            "--max-new-tokens", "2"]
    code = (f"import sys, batchspec; from batchspec.cli import main; rc = main({argv!r}); "
            "print(rc, sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "0 []"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--ray", "--verify"], "with --ray, run `batchspec audit` on the output instead"),
        (["--ray", "--ray-workers", "0"], "--ray-workers must be >= 1"),
        (["--ray", "--ray-batch-rows", "0"], "--ray-batch-rows must be >= 1"),
        (["--ray", "--ray-address", "ray://head:10001"], "Ray Data cannot run through Ray Client (ray://)"),
    ],
)
def test_bad_ray_options_are_one_clear_line(tiny_pair_dirs, tmp_path, capsys, extra, message):
    target, draft = tiny_pair_dirs
    code = main(["generate", "--prompts", str(mixed_prompts_file(tmp_path, "how many people could go")), "--target", str(target), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0]


def test_ray_missing_says_what_to_install(tiny_pair_dirs, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if not installed
    monkeypatch.delitem(sys.modules, "batchspec.ray")
    target, draft = tiny_pair_dirs
    code = main(["generate", "--prompts", str(mixed_prompts_file(tmp_path, "how many people could go")), "--target", str(target), "--ray"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["batchspec generate: error: Ray is not installed: pip install 'batchspec[ray]'"]


def test_predictor_without_a_cluster(model, expected):
    """The class Ray instantiates, called directly: numpy-style batches (NaN for a missing number),
    the output columns `generate` writes, and one-line errors for a bad dataset or bad settings."""
    import numpy as np

    predictor = BatchspecPredictor(model=model, spec=SPEC, sampling=SAMPLING)
    rows = [ROWS[0], ROWS[1], ROWS[3]]  # greedy, seeded, empty
    batch = {
        "id": np.array([r["id"] for r in rows], dtype=object),
        "prompt": np.array([r["prompt"] for r in rows], dtype=object),
        "seed": np.array([r.get("seed", np.nan) for r in rows], dtype=float),
        "temperature": np.array([r.get("temperature", np.nan) for r in rows], dtype=float),
        "top_p": np.array([r.get("top_p", np.nan) for r in rows], dtype=float),
    }
    table = predictor(batch)
    assert table.schema == OUTPUT_SCHEMA
    # every field but logprobs, which Ray rows cannot ask for (`generate --ray --logprobs` is refused)
    assert table.schema.names == ["id"] + [f for f in RequestOutput.__dataclass_fields__
                                           if f not in ("index", "logprobs", "prompt_logprobs")]
    out = table.to_pylist()
    for row in out[:2]:
        assert {k: row[k] for k in SAME} == {k: expected[row["id"]][k] for k in SAME}
    assert out[2]["error"] == "empty prompt"
    with pytest.raises(BatchspecError, match="rows need a `prompt` column; got text"):
        predictor({"text": np.array(["the"], dtype=object)})
    with pytest.raises(BatchspecError, match="bad spec settings .*known fields: method"):
        BatchspecPredictor(model=model, spec={"methd": "ragged"})
    odd = predictor({"prompt": ["the water", "the water"], "max_new_tokens": np.array([2.5, 2.0])}).to_pylist()
    assert odd[0]["error"] == "max_new_tokens must be an integer, got 2.5" and len(odd[1]["token_ids"]) == 2


@pytest.mark.real
def test_real_pair_through_ray(cluster, tmp_path, capsys):
    """Smoke test of the bundled pair through `generate --ray`: 2 short prompts x 8 tokens on one
    2-CPU actor (~8 GB with a bf16 drafter), kept that small for CI's 2 cores; each output equals plain
    greedy decoding in fp32 (the drafter's dtype changes acceptance, never the output)."""
    import torch
    from test_real import pair  # the same loaded models as the real-pair tests, and their skip/fail rule

    from batchspec.bundled import bundled_installed
    from batchspec.models import eos_token_ids
    from batchspec.reference import greedy_decode

    if not (bundled_installed("target") and bundled_installed("draft")):
        if os.environ.get("BATCHSPEC_REQUIRE_REAL") == "1":
            pytest.fail("bundled model pair not installed (run `make setup`)")
        pytest.skip("bundled model pair not installed (run `make setup`)")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                               for i, p in (("sum", "Write a Python function that adds two numbers."),
                                            ("ls", "Which shell command lists files?"))))
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--prompts", str(prompts), "--output", str(out), "--max-new-tokens", "8",
                 "--draft-dtype", "bfloat16", "--speculation", "fixed",  # so it drafts, whatever the costs here
                 "--ray", "--ray-workers", "1", "--ray-cpus-per-worker", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["sum", "ls"] and [r["error"] for r in rows] == [None, None]
    assert summary["acceptance_rate"] is not None
    assert summary["generated_tokens"] == sum(len(r["token_ids"]) for r in rows)
    models = pair()
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        stop = eos_token_ids(models.target, models.tokenizer)
        for row in rows:
            assert row["token_ids"] == greedy_decode(models.target, row["prompt_token_ids"], 8, stop), row["id"]
    finally:
        torch.set_num_threads(threads)
