"""`batchspec generate` end to end on the tiny pair: outputs, per-prompt error records, clear errors."""

from __future__ import annotations

import argparse
import fcntl
import json

import pytest
from tinyworld import mixed_prompts_file

from batchspec.cli import COMMANDS, DESCRIPTION, build_parser, main
from batchspec.config import BatchspecError, SamplingParams
from batchspec.llm import LLM


@pytest.mark.parametrize("method", ["ragged", "eqspec", "exspec"])
def test_generate_writes_every_prompt_and_verifies(tmp_path, tiny_pair_dirs, capsys, method):
    target, draft = tiny_pair_dirs
    out = tmp_path / "out.jsonl"
    code = main(["generate", "--prompts", str(mixed_prompts_file(tmp_path)), "--target", str(target), "--draft", str(draft),
                 "--method", method, "--batch-size", "2", "--max-new-tokens", "8", "--output", str(out), "--verify"])
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "empty", "2", "b", "long", "c"]
    by_id = {r["id"]: r for r in rows}
    assert by_id["empty"]["error"] == "empty prompt"
    assert "invalid JSON" in by_id["2"]["error"]
    assert "exceeds the model's context" in by_id["long"]["error"]
    for rid in ("a", "b", "c"):
        row = by_id[rid]
        assert row["error"] is None and 1 <= len(row["token_ids"]) <= 8
        assert {"prompt", "text", "rounds", "accepted", "drafted", "finish_reason"} <= row.keys()
    assert by_id["b"]["prompt"] == "call him now and then"
    summary = json.loads(capsys.readouterr().out)
    assert summary["exact_match"] == "3/3"
    assert summary["errors"] == 3 and summary["prompts"] == 6
    policy = {"ragged": "adaptive", "eqspec": "fixed", "exspec": "fixed"}[method]  # each method's default
    assert summary["speculation"] == {"policy": policy, "max_drafts": 5, "drafter": "model"}


def test_generate_writes_a_step_trace(tmp_path, tiny_pair_dirs, capsys):
    """--trace: one JSON line per piece of every step (prefill chunks under the continuous scheduler's
    default budget, rounds), with the request ids of the prompts decoded; refused with --ray."""
    target, draft = tiny_pair_dirs
    trace = tmp_path / "trace.jsonl"
    code = main(["generate", "--prompts", str(mixed_prompts_file(tmp_path)), "--target", str(target), "--draft", str(draft),
                 "--batch-size", "2", "--max-new-tokens", "8", "--trace", str(trace), "--verify"])
    assert code == 0 and json.loads(capsys.readouterr().out)["exact_match"] == "3/3"
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert {r["piece"] for r in records} >= {"prefill", "round"}
    assert sorted({r["step"] for r in records}) == list(range(max(r["step"] for r in records) + 1))
    assert {i for r in records if r["piece"] == "prefill" for i in r["requests"]} == {0, 1, 2}  # the three decodable prompts
    args = ["generate", "--prompts", str(mixed_prompts_file(tmp_path)), "--target", str(target), "--trace", str(trace)]
    assert main(args + ["--ray"]) == 2 and "--trace records the engine of this process" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--num-draft-tokens", "0"], "num_draft_tokens must be >= 1"),
        (["--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
        (["--batch-size", "0"], "batch_size must be >= 1"),
        (["--target", "/nonexistent/model"], "not found"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, tiny_pair_dirs, capsys, extra, message):
    target, draft = tiny_pair_dirs
    args = ["generate", "--prompts", str(mixed_prompts_file(tmp_path)), "--target", str(target), "--draft", str(draft)]
    code = main(args + extra)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("batchspec generate: error:") and message in err[0]


def test_missing_prompts_file(capsys):
    assert main(["generate", "--prompts", "/nonexistent.jsonl"]) == 2
    assert "prompts file not found" in capsys.readouterr().err


# ---- bad input, tried as a new user would ------------------------------------------------------


def _tiny(tiny_pair_dirs) -> list[str]:
    target, draft = tiny_pair_dirs
    return ["--target", str(target), "--draft", str(draft), "--batch-size", "2", "--max-new-tokens", "6"]


def _one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"batchspec {command}: error: "), err
    return err[0]


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _word_prompts(tmp_path, count: int = 5):
    path = tmp_path / "words.jsonl"
    words = ["the water is long", "call him now", "write the number", "you were there", "make more people",
             "find the way", "look down", "go first"]
    lines = [json.dumps({"id": f"w{i}", "prompt": words[i % len(words)]}) for i in range(count)]
    path.write_text("\n".join(lines[:2] + ["{broken"] + lines[2:]) + "\n")  # one error record, written at once
    return path


@pytest.mark.parametrize(
    "command, extra, message",
    [
        ("generate", ["--temperature", "nan"], "argument --temperature: must be a finite number, got 'nan'"),
        ("generate", ["--top-p", "inf"], "argument --top-p: must be a finite number, got 'inf'"),
        ("generate", ["--temperature", "warm"], "argument --temperature: must be a number, got 'warm'"),
        ("generate", ["--limit", "-1"], "argument --limit: must be >= 1, got -1"),
        ("generate", ["--limit", "0"], "argument --limit: must be >= 1, got 0"),
        ("generate", ["--resume"], "--resume continues an earlier run's --output: give --output"),
        ("bench", ["--temperature=-inf"], "argument --temperature: must be a finite number, got '-inf'"),
        ("bench", ["--repeats", "0"], "--repeats must be >= 1, got 0"),
        ("audit", ["--limit", "-1"], "argument --limit: must be >= 1, got -1"),
        ("audit", ["--margin", "nan"], "argument --margin: must be a finite number, got 'nan'"),
        ("audit", ["--margin", "-1"], "--margin must be >= 0, got -1.0"),
        ("audit", ["--draft", "x"], "unrecognized arguments: --draft x"),
        ("verify-distribution", ["--limit", "-1"], "argument --limit: must be >= 1, got -1"),
        ("verify-distribution", ["--alpha", "2"], "--alpha must be in (0, 1), got 2.0"),
        ("verify-distribution", ["--alpha", "0"], "--alpha must be in (0, 1), got 0.0"),
        ("verify-distribution", ["--alpha", "nan"], "argument --alpha: must be a finite number, got 'nan'"),
        ("verify-distribution", ["--min-expected", "0"], "--min-expected must be > 0, got 0.0"),
        ("verify-distribution", ["--samples", "0"], "--samples must be >= 1"),
        ("verify-distribution", ["--positions", "2"], "--positions must be >= 3"),
        ("verify-distribution", ["--samples", "1.5"], "argument --samples: invalid int value: '1.5'"),
    ],
)
def test_bad_numbers_are_refused_before_any_model_loads(tmp_path, capsys, command, extra, message):
    prompts = _word_prompts(tmp_path)
    required = {
        "generate": ["--prompts", str(prompts)],
        "bench": [],
        "audit": ["--prompts", str(prompts), "--outputs", str(prompts), "--report", str(tmp_path / "r.json")],
        "verify-distribution": [],
    }[command]
    # a target that does not exist: had the check come after model loading, the error would be about it
    assert main([command, *required, "--target", "/nonexistent/model", *extra]) == 2
    assert message in _one_error_line(capsys, command)


def test_nan_temperature_is_refused_by_the_python_api_too():
    with pytest.raises(BatchspecError, match="temperature must be a finite number, got nan"):
        SamplingParams(temperature=float("nan"))


@pytest.mark.parametrize("name, content, message", [
    ("empty.txt", "", "no prompts in"),
    ("empty.jsonl", "", "no prompts in"),
    ("blank.txt", "\n   \n", "no prompts in"),
    ("folder", None, "prompts path is a directory, not a file"),
])
def test_prompts_files_without_prompts_are_one_clear_line(tmp_path, capsys, name, content, message):
    path = tmp_path / name
    path.mkdir() if content is None else path.write_text(content)
    assert main(["generate", "--prompts", str(path), "--target", "/nonexistent/model"]) == 2
    assert message in _one_error_line(capsys, "generate")


def test_bad_lines_become_error_records_and_a_bom_costs_nothing(tmp_path, tiny_pair_dirs, capsys):
    prompts = tmp_path / "prompts.TXT"
    prompts.write_bytes(b"\xef\xbb\xbfthe water is long\ncaf\xe9 now\ncall him now\n")
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--prompts", str(prompts), *_tiny(tiny_pair_dirs), "-o", str(out)]) == 0
    rows = _rows(out)
    assert [(r["id"], r["prompt"]) for r in rows] == [("0", "the water is long"), ("1", ""), ("2", "call him now")]
    assert rows[1]["error"] == "line 2 is not valid UTF-8 (byte 0xe9 at column 4)"
    assert rows[0]["error"] is None and rows[2]["error"] is None and rows[0]["token_ids"]


def test_uppercase_jsonl_is_read_as_json(tmp_path, tiny_pair_dirs, capsys):
    prompts = tmp_path / "prompts.JSONL"
    prompts.write_text(json.dumps({"id": "a", "prompt": "the water is long"}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--prompts", str(prompts), *_tiny(tiny_pair_dirs), "-o", str(out)]) == 0
    assert [(r["id"], r["prompt"]) for r in _rows(out)] == [("a", "the water is long")]
    as_text = ["generate", "--prompts", str(prompts), "--format", "text", *_tiny(tiny_pair_dirs), "-o", str(out)]
    assert main(as_text) == 0
    assert _rows(out)[0]["prompt"] == json.dumps({"id": "a", "prompt": "the water is long"})


def test_no_prompt_producing_output_exits_1(tmp_path, tiny_pair_dirs, capsys):
    out = tmp_path / "out.jsonl"
    args = ["generate", "--prompts", str(_word_prompts(tmp_path, 2)), *_tiny(tiny_pair_dirs), "-o", str(out)]
    assert main([*args, "--max-new-tokens", "100000"]) == 1
    rows = _rows(out)
    assert len(rows) == 3 and all(r["error"] for r in rows)
    assert sum("exceeds the model's context" in r["error"] for r in rows) == 2
    assert "no prompt produced output (all 3 refused" in capsys.readouterr().err


@pytest.mark.parametrize("where, message", [
    ("folder", "--output is a directory, not a file"),
    ("file/out.jsonl", "cannot create the folder of --output"),
    ("words.jsonl", "is the --output file"),
])
def test_a_bad_output_path_is_refused_before_any_model_loads(tmp_path, capsys, where, message):
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("a file, not a folder")
    args = ["generate", "--prompts", str(_word_prompts(tmp_path)), "--target", "/nonexistent/model"]
    assert main([*args, "-o", str(tmp_path / where)]) == 2
    assert message in _one_error_line(capsys, "generate")


def test_two_runs_cannot_write_one_output(tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    with open(tmp_path / "out.jsonl.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another run, mid-way
        args = ["generate", "--prompts", str(_word_prompts(tmp_path)), "--target", "/nonexistent/model"]
        assert main([*args, "-o", str(out)]) == 2
    assert "another run is writing" in _one_error_line(capsys, "generate")
    assert not out.exists() and not (tmp_path / "out.jsonl.partial").exists()


def _stream_interrupted_after(monkeypatch, count: int) -> None:
    """LLM.stream raising KeyboardInterrupt (Ctrl-C) after `count` finished prompts."""
    original = LLM.stream

    def stream(self, prompts, params=None):
        for n, out in enumerate(original(self, prompts, params)):
            if n == count:
                raise KeyboardInterrupt
            yield out

    monkeypatch.setattr(LLM, "stream", stream)


def _count_decoded(monkeypatch) -> list[str]:
    """The prompts `LLM.stream` is asked to decode from now on (what a resumed run decodes again)."""
    decoded: list = []
    original = LLM.stream

    def counting_stream(self, prompts, params=None):
        decoded.extend(prompts)
        yield from original(self, prompts, params)

    monkeypatch.setattr(LLM, "stream", counting_stream)
    return decoded


def test_ctrl_c_keeps_finished_records_and_resume_completes_the_output(tmp_path, tiny_pair_dirs, monkeypatch, capsys):
    prompts = _word_prompts(tmp_path, 7)
    ids = ["w0", "w1", "2", "w2", "w3", "w4", "w5", "w6"]
    uninterrupted = tmp_path / "reference.jsonl"
    assert main(["generate", "--prompts", str(prompts), *_tiny(tiny_pair_dirs), "-o", str(uninterrupted)]) == 0
    out, partial = tmp_path / "out.jsonl", tmp_path / "out.jsonl.partial"
    args = ["generate", "--prompts", str(prompts), *_tiny(tiny_pair_dirs), "-o", str(out)]

    with monkeypatch.context() as patch:
        _stream_interrupted_after(patch, 3)
        assert main(args) == 130
    assert not out.exists()
    kept = _rows(partial)  # the error record at once, then prompts in the order they finished
    assert len(kept) == 4 and kept[0]["id"] == "2" and len({r["id"] for r in kept}) == 4
    assert "rerun with --resume" in capsys.readouterr().err

    assert main(args) == 2  # a plain rerun would throw the finished records away
    assert "holds records of an interrupted run: pass --resume" in _one_error_line(capsys, "generate")

    decoded = _count_decoded(monkeypatch)
    assert main([*args, "--resume"]) == 0
    assert len(decoded) == 4  # only the prompts without a record
    assert json.loads(capsys.readouterr().out)["resumed"] == 3  # the error record is tried again
    rows = _rows(out)
    assert [r["id"] for r in rows] == ids  # every prompt exactly once, in input order
    keys = ("id", "prompt", "token_ids", "text", "finish_reason", "error")
    assert [{k: r[k] for k in keys} for r in rows] == [{k: r[k] for k in keys} for r in _rows(uninterrupted)]
    assert not partial.exists() and not (tmp_path / "out.jsonl.lock").exists()

    decoded.clear()  # resuming a finished output decodes nothing and loads no model
    assert main([*args[:3], "--target", "/nonexistent/model", "-o", str(out), "--resume"]) == 0
    assert not decoded and [r["id"] for r in _rows(out)] == ids


@pytest.mark.parametrize("ids, message", [
    (['"a"', '"a"'], "id 'a' is on lines 1 and 2"),
    (["1", '"1"'], "id '1' is on lines 1 and 2"),  # one id once written as text
    (["null", '"x"'], "line 1: `id` is null, not a string or an integer"),
    (['"x"', "[1]"], "line 2: `id` is a list, not a string or an integer"),
    (['"x"', "true"], "line 2: `id` is true or false"),
])
def test_ids_are_checked_before_any_model_loads_with_or_without_resume(tmp_path, capsys, ids, message):
    prompts = tmp_path / "ids.jsonl"
    prompts.write_text("".join(f'{{"id": {rid}, "prompt": "the water"}}\n' for rid in ids))
    for extra in ([], ["-o", str(tmp_path / "o.jsonl"), "--resume"]):
        assert main(["generate", "--prompts", str(prompts), "--target", "/nonexistent/model", *extra]) == 2
        assert message in _one_error_line(capsys, "generate")


def _run_and_partial(tmp_path, tiny_pair_dirs, lines: list[str]) -> tuple[list[str], object]:
    """A finished run's output moved to its .partial, as an interrupted run leaves it; the command."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    args = ["generate", "--prompts", str(prompts), *_tiny(tiny_pair_dirs), "-o", str(out)]
    assert main(args) == 0
    out.rename(tmp_path / "out.jsonl.partial")
    return args, out


def test_resume_refuses_records_written_for_other_prompts(tmp_path, tiny_pair_dirs, capsys):
    args, out = _run_and_partial(tmp_path, tiny_pair_dirs, [json.dumps({"prompt": "the water is long"})])
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "call him now"}) + "\n")  # same id 0, another prompt
    capsys.readouterr()
    assert main([*args, "--resume"]) == 2
    assert "was written for another prompt than line 1's" in _one_error_line(capsys, "generate")
    assert (tmp_path / "out.jsonl.partial").exists() and not out.exists()  # nothing lost


def test_resume_decodes_forged_records_and_error_records_again(tmp_path, tiny_pair_dirs, capsys, monkeypatch):
    lines = [json.dumps({"id": i, "prompt": p}) for i, p in enumerate(["the water is long", "call him now", "   "])]
    args, out = _run_and_partial(tmp_path, tiny_pair_dirs, lines)
    partial = tmp_path / "out.jsonl.partial"
    rows = _rows(partial)
    assert rows[2]["error"] == "empty prompt"
    good = {r["id"]: r for r in rows}
    forged = [{"id": "0", "prompt": "the water is long", "text": "FORGED"}, {**rows[1], "token_ids": "zz"}, rows[2]]
    partial.write_text("".join(json.dumps(r) + "\n" for r in forged))
    decoded = _count_decoded(monkeypatch)
    capsys.readouterr()
    assert main([*args, "--resume", "--keep-errors"]) == 0
    err = capsys.readouterr().err
    assert "2 earlier record(s) are not whole records of batchspec generate" in err and "Traceback" not in err
    assert decoded == ["the water is long", "call him now"]  # the kept error record is not retried
    final = _rows(out)
    assert [r["token_ids"] for r in final[:2]] == [good["0"]["token_ids"], good["1"]["token_ids"]]
    assert "FORGED" not in out.read_text()

    out.rename(partial)
    decoded.clear()
    assert main([*args, "--resume"]) == 0  # without --keep-errors the error record is tried again
    assert decoded == ["   "] and _rows(out)[2]["error"] == "empty prompt"  # refused again
    assert json.loads(capsys.readouterr().out)["resumed"] == 2


@pytest.mark.parametrize("prompts_name, output, extra", [
    ("o.jsonl.lock", "o.jsonl", []),
    ("o.jsonl.tmp", "o.jsonl", []),
    ("o.jsonl.partial", "o.jsonl", ["--resume"]),
    ("o.jsonl", "o.jsonl", []),
])
def test_prompts_named_like_the_outputs_side_files_are_refused_untouched(tmp_path, capsys, prompts_name, output,
                                                                          extra):
    prompts = tmp_path / prompts_name
    content = json.dumps({"id": "a", "prompt": "the water"}) + "\n"
    prompts.write_text(content)
    assert main(["generate", "--prompts", str(prompts), "-o", str(tmp_path / output), "--target",
                 "/nonexistent/model", *extra]) == 2
    assert "the run would destroy it" in _one_error_line(capsys, "generate")
    assert prompts.read_text() == content and sorted(p.name for p in tmp_path.iterdir()) == [prompts_name]


def test_a_hard_link_to_the_prompts_is_refused_too(tmp_path, capsys):
    prompts = _word_prompts(tmp_path)
    (tmp_path / "o.jsonl.tmp").hardlink_to(prompts)
    assert main(["generate", "--prompts", str(prompts), "-o", str(tmp_path / "o.jsonl")]) == 2
    assert "--output's .tmp file" in _one_error_line(capsys, "generate")


def test_bad_lines_of_every_kind_cost_only_themselves(tmp_path, tiny_pair_dirs, capsys):
    """A lone surrogate (valid JSON), a line nested 100k levels deep and an over-long line are error
    records; the other prompts are decoded."""
    import batchspec.prompts

    prompts = tmp_path / "bad.jsonl"
    lines = ['{"id": "ok1", "prompt": "the water is long"}', '{"id": "sur", "prompt": "\\ud800 x"}', "[" * 100_000,
             '{"id": "big", "prompt": "' + "word " * 40_000 + '"}', '{"id": "ok2", "prompt": "call him now"}']
    prompts.write_text("\n".join(lines) + "\n")
    out = tmp_path / "o.jsonl"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(batchspec.prompts, "MAX_LINE_BYTES", 150_000)
        assert main(["generate", "--prompts", str(prompts), *_tiny(tiny_pair_dirs), "-o", str(out)]) == 0
    rows = {r["id"]: r for r in _rows(out)}
    assert list(rows) == ["ok1", "sur", "2", "3", "ok2"]
    assert "lone surrogate U+D800" in rows["sur"]["error"]
    assert "nested too deeply" in rows["2"]["error"]
    assert "longer than 150000 bytes" in rows["3"]["error"]
    assert rows["ok1"]["error"] is None and rows["ok2"]["error"] is None and rows["ok2"]["token_ids"]


def test_a_device_file_or_an_endless_pipe_is_one_line(tmp_path, capsys, monkeypatch):
    assert main(["generate", "--prompts", "/dev/zero"]) == 2
    assert "not a regular file or a pipe: /dev/zero" in _one_error_line(capsys, "generate")
    import os
    import threading

    import batchspec.prompts

    monkeypatch.setattr(batchspec.prompts, "MAX_FILE_BYTES", 2**22)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def feed() -> None:
        with open(fifo, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 2**20)
            except BrokenPipeError:
                pass

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    assert main(["generate", "--prompts", str(fifo)]) == 2
    assert "is larger than 4 MiB" in _one_error_line(capsys, "generate")


@pytest.mark.parametrize("extra, message", [
    (["--generator-seed", "18446744073709551616"], "generator_seed must be in 0..2**64-1"),
    (["--generator-seed", "-1"], "generator_seed must be in 0..2**64-1"),
    (["--temperature", "1e-39", "--seed", "1"], "temperature must be 0 (greedy) or >= 0.01"),
    (["--keep-errors"], "--keep-errors says which records --resume keeps"),
])
def test_more_bad_numbers_are_refused_before_any_model_loads(tmp_path, capsys, extra, message):
    args = ["generate", "--prompts", str(_word_prompts(tmp_path)), "--target", "/nonexistent/model"]
    assert main([*args, *extra]) == 2
    assert message in _one_error_line(capsys, "generate")


def test_device_and_draft_count_that_cannot_work_are_one_line(tmp_path, tiny_pair_dirs, capsys):
    prompts = str(_word_prompts(tmp_path))
    assert main(["generate", "--prompts", prompts, *_tiny(tiny_pair_dirs), "--device", "cpu:99"]) == 2
    assert "there is no device cpu:99" in _one_error_line(capsys, "generate")
    assert main(["generate", "--prompts", prompts, *_tiny(tiny_pair_dirs), "-k", "600"]) == 2  # adaptive
    err = capsys.readouterr().err
    assert "Traceback" not in err and "batchspec generate: error: num_draft_tokens 600 cannot fit the model's " \
        "context of 512 tokens" in err.strip().splitlines()[-1]


def test_audit_refuses_an_unwritable_report_before_auditing(tmp_path, capsys, monkeypatch):
    import batchspec.commands.audit

    prompts = _word_prompts(tmp_path)
    (tmp_path / "file").write_text("a file, not a folder")
    monkeypatch.setattr(batchspec.commands.audit, "load_models", lambda *a, **k: pytest.fail("audited first"))
    for report, message in ((tmp_path / "file" / "r.json", "cannot write --report"),
                            (prompts, "is an input of this command")):
        assert main(["audit", "--prompts", str(prompts), "--outputs", str(prompts), "--report", str(report)]) == 2
        assert message in _one_error_line(capsys, "audit")


def test_prompt_text_cannot_forge_control_tokens_unless_allowed(tmp_path, tiny_pair_dirs, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("the water </s> is long\n")
    out = tmp_path / "out.jsonl"
    args = ["generate", "--prompts", str(prompts), *_tiny(tiny_pair_dirs), "-o", str(out)]
    eos = 1  # </s> in the tiny tokenizer
    assert main(args) == 0
    assert eos not in _rows(out)[0]["prompt_token_ids"]
    assert main([*args, "--allow-special-tokens"]) == 0
    assert eos in _rows(out)[0]["prompt_token_ids"]


# ---- --help ---------------------------------------------------------------------------------------


def _command_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser(COMMANDS)
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_top_level_help_describes_the_tool_and_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert DESCRIPTION in out and "examples:" in out
    for name in COMMANDS:
        assert f"batchspec {name}" in out


def test_every_option_has_help_and_shows_its_default(capsys):
    for name, parser in _command_parsers().items():
        for action in parser._actions:
            assert action.help, (name, action.option_strings)
    options = {name: {s for a in p._actions for s in a.option_strings} for name, p in _command_parsers().items()}
    for name in ("generate", "bench", "audit", "verify-distribution"):
        assert "--format" in options[name] and "--allow-special-tokens" in options[name]
    assert "--draft" in options["generate"] and not {"--draft", "--draft-dtype"} & options["audit"]
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "token budget per request (default: 64)" in out and "(default: None)" not in out
