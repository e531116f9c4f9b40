"""Scale-out on Ray Data: batchspec as a callable class for `Dataset.map_batches`.

A user with a million prompts and several machines already shards with Ray Data (`ray.data.llm`
wraps vLLM and SGLang the same way), so batchspec plugs into it rather than shipping a runner:

    ds = ray.data.read_json("prompts.jsonl")          # a `prompt` column, optional `id` + sampling
    out = generate_dataset(ds, model={"target": "/models/t", "draft": "/models/d"},
                           spec={"method": "ragged", "batch_size": 8}, concurrency=4)
    out.write_parquet("outputs/")

Each actor loads its models once and decodes the rows Ray hands it with `LLM.generate`, so every
output is the one plain decoding gives (greedy and seeded rows are batch-invariant). Faults are
Ray's: a dead actor is restarted (`max_restarts`) and its unfinished batches rerun
(`max_task_retries`); a prompt batchspec refuses is an `error` row, never a failed job.

`RayLLM` is the same thing behind `LLM.stream`'s interface, for `batchspec generate --ray`.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence as Seq
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from .config import BatchspecError, ModelConfig, SamplingParams, SpecConfig
from .llm import LLM, Prompt, RequestOutput
from .stats import EngineStats

try:
    import pyarrow as pa
    import ray
    import ray.data
except ImportError as _err:  # the optional extra is not installed
    raise BatchspecError("Ray is not installed: pip install 'batchspec[ray]'") from _err

# The columns `batchspec generate` writes, in its order, with types fixed so that every block has
# the same schema (an all-null `error` column must still be a string column for Parquet). Logprobs
# are not among them: rows cannot ask for them (SAMPLING_COLUMNS), and `generate --ray --logprobs`
# is refused.
OUTPUT_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("prompt", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int64())),
        ("text", pa.string()),
        ("token_ids", pa.list_(pa.int64())),
        ("finish_reason", pa.string()),
        ("error", pa.string()),
        ("rounds", pa.int64()),
        ("drafted", pa.int64()),
        ("accepted", pa.int64()),
        ("proposed_k", pa.list_(pa.int64())),
        ("chosen_k", pa.list_(pa.int64())),
        ("accepted_k", pa.list_(pa.int64())),
        ("time_to_first_token", pa.float64()),
        ("latency", pa.float64()),
        ("token_times", pa.list_(pa.float64())),
    ]
)
# Optional per-row columns overriding the `sampling` defaults (null/NaN: use the default).
SAMPLING_COLUMNS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids")
_INT_FIELDS = ("max_new_tokens", "top_k", "seed")
_FLOAT_FIELDS = ("temperature", "top_p")

# A finite number of restarts and retries: Ray Data's default (-1, forever) would loop on a batch
# that kills its actor every time (e.g. out of memory) instead of failing the job. They travel as
# `ray_remote_args`, which Ray 2.60 still honours but marks deprecated (to be removed in 2.64, with
# no named replacement yet): revisit when moving the pin past 2.63.
DEFAULT_MAX_RESTARTS = 4
DEFAULT_MAX_TASK_RETRIES = 4


def _build(cls: type, values: Mapping[str, Any] | None, what: str) -> Any:
    """A config from a plain dict (what serializes to actors), with a one-line error for bad keys."""
    try:
        return cls(**dict(values or {}))
    except TypeError as err:
        names = ", ".join(f.name for f in fields(cls))
        raise BatchspecError(f"bad {what} settings ({err}); known fields: {names}") from err


def _missing(value: object) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _sampling_value(name: str, value: object) -> object:
    """Coerce one per-row sampling cell: numeric columns with nulls arrive as floats (8.0)."""
    if name in _INT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
            raise BatchspecError(f"{name} must be an integer, got {value!r}")
        return int(value)
    if name in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BatchspecError(f"{name} must be a number, got {value!r}")
        return float(value)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise BatchspecError(f"{name} must be a list of token ids, got {value!r}")
    return tuple(value)  # type: ignore[arg-type]


def _columns(batch: Any) -> dict[str, list]:
    """Any batch format Ray Data hands a UDF (pyarrow, numpy dict, pandas) as plain Python lists."""
    if isinstance(batch, pa.Table):
        return {name: batch.column(name).to_pylist() for name in batch.column_names}
    if isinstance(batch, Mapping):
        return {name: col.tolist() if hasattr(col, "tolist") else list(col) for name, col in batch.items()}
    if hasattr(batch, "to_dict"):  # pandas.DataFrame
        return batch.to_dict("list")
    raise BatchspecError(f"unsupported batch type {type(batch).__name__}; use batch_format='pyarrow'")


class BatchspecPredictor:
    """Decodes one Ray Data batch per call; Ray keeps one instance (one engine, models loaded once)
    per actor. All constructor arguments are plain dicts so they pickle to any node:

    model: `ModelConfig` fields (target/draft paths are read on the worker's node);
    spec: `SpecConfig` fields (`batch_size` there is the rows decoded together inside the engine,
    not Ray's rows per call); sampling: `SamplingParams` fields, the default for every row;
    stats_sink: a `StatsSink` actor to report each batch's engine timings to (used by `RayLLM` and
    the bench; it keys batches by their ids, so rows need unique ids).

    Input columns: `prompt` (text, or a list of token ids), optional `id` and SAMPLING_COLUMNS.
    Output: OUTPUT_SCHEMA, one row per input row in the same order; `id` as a string.
    """

    def __init__(
        self,
        model: Mapping[str, Any] | None = None,
        spec: Mapping[str, Any] | None = None,
        sampling: Mapping[str, Any] | None = None,
        stats_sink: ray.actor.ActorHandle | None = None,
    ) -> None:
        self.defaults = asdict(_build(SamplingParams, sampling, "sampling"))
        self.llm = LLM(_build(ModelConfig, model, "model"), spec=_build(SpecConfig, spec, "spec"))
        self.stats_sink = stats_sink

    def __call__(self, batch: Any) -> pa.Table:
        started = time.time()
        columns = _columns(batch)
        if "prompt" not in columns:
            raise BatchspecError(f"rows need a `prompt` column; got {', '.join(columns) or 'none'}")
        prompts = columns["prompt"]
        ids = [None if _missing(v) else str(v) for v in columns.get("id", [None] * len(prompts))]
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        todo: list[int] = []
        encoded: list[list[int]] = []
        params: list[SamplingParams] = []
        for i, prompt in enumerate(prompts):
            try:
                # Encoding here (not in LLM.generate) keeps a batch of lone ints from being read as
                # one token-id prompt, and checks the row's sampling fields first.
                row_params = self._params(columns, i)
                encoded.append(self.llm.encode(prompt))
            except BatchspecError as err:
                outputs[i] = RequestOutput(i, _text(prompt), [], error=str(err))
                continue
            params.append(row_params)
            todo.append(i)
        self.llm.stats = EngineStats()
        for out in self.llm.generate(encoded, params):
            out.index = todo[out.index]
            out.prompt = _text(prompts[out.index])
            outputs[out.index] = out
        if self.stats_sink is not None:
            # Keyed by the batch's ids, so a batch rerun after a fault replaces its report.
            ray.get(self.stats_sink.put.remote(tuple(ids), asdict(self.llm.stats), (started, time.time())))
        return _table(ids, outputs)

    def _params(self, columns: dict[str, list], row: int) -> SamplingParams:
        values = dict(self.defaults)
        for name in SAMPLING_COLUMNS:
            if name in columns and not _missing(columns[name][row]):
                values[name] = _sampling_value(name, columns[name][row])
        return SamplingParams(**values)


def _text(prompt: object) -> str | None:
    return prompt if isinstance(prompt, str) else None


def _table(ids: list[str | None], outputs: Seq[RequestOutput | None]) -> pa.Table:
    rows = []
    for rid, out in zip(ids, outputs):
        assert out is not None  # every row got an output or an error above
        row = out.to_json()
        row.pop("index")
        rows.append({"id": rid, **row})
    return pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA)


@ray.remote(num_cpus=0)
class StatsSink:
    """Collects each batch's EngineStats and its wall-clock span in the actor, so the driver can say
    where the time went across workers (Ray Data returns rows only). One report per batch key: a
    batch rerun after a fault overwrites its first report instead of counting twice."""

    def __init__(self) -> None:
        self.reports: dict[tuple, dict] = {}
        self.spans: dict[tuple, tuple[float, float]] = {}

    def put(self, key: tuple, stats: dict, span: tuple[float, float]) -> None:
        self.reports[key] = stats
        self.spans[key] = span

    def batch_spans(self) -> list[tuple[float, float]]:
        """(start, end) of each batch's call, in `time.time()` of the actor's node, sorted."""
        return sorted(self.spans.values())

    def total(self) -> dict:
        total = EngineStats()
        for stats in self.reports.values():
            total.merge(EngineStats(**stats))
        return asdict(total)


def generate_dataset(
    ds: ray.data.Dataset,
    *,
    model: Mapping[str, Any] | None = None,
    spec: Mapping[str, Any] | None = None,
    sampling: Mapping[str, Any] | None = None,
    concurrency: int = 1,
    batch_size: int = 32,
    num_cpus: float = 1,
    num_gpus: float = 0,
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    max_task_retries: int = DEFAULT_MAX_TASK_RETRIES,
    stats_sink: ray.actor.ActorHandle | None = None,
    predictor: type[BatchspecPredictor] = BatchspecPredictor,
    **ray_remote_args: Any,
) -> ray.data.Dataset:
    """`ds.map_batches(BatchspecPredictor, ...)` with the settings it needs: a fixed pool of
    `concurrency` actors, `batch_size` rows per call, pyarrow batches, and fault tolerance.
    `predictor` may be a subclass (its own pre- or post-processing, same constructor).

    The settings are validated here, on the driver, so a typo fails before any actor starts.
    Output rows follow input order only if Ray Data is asked to preserve it
    (`DataContext.get_current().execution_options.preserve_order = True`); `id` always links them.
    """
    _build(ModelConfig, model, "model")
    _build(SpecConfig, spec, "spec")
    _build(SamplingParams, sampling, "sampling")
    if concurrency < 1:
        raise BatchspecError(f"concurrency must be >= 1, got {concurrency}")
    if batch_size < 1:
        raise BatchspecError(f"batch_size must be >= 1, got {batch_size}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        return ds.map_batches(
            predictor,
            fn_constructor_kwargs={
                "model": dict(model or {}),
                "spec": dict(spec or {}),
                "sampling": dict(sampling or {}),
                "stats_sink": stats_sink,
            },
            compute=ray.data.ActorPoolStrategy(size=concurrency),
            batch_size=batch_size,
            batch_format="pyarrow",
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            udf_modifying_row_count=False,
            max_restarts=max_restarts,
            max_task_retries=max_task_retries,
            **ray_remote_args,
        )


def _absolute(path: str | None) -> str | None:
    """A model path that exists here, made absolute (workers do not share the driver's directory);
    anything else is left for the workers to resolve on their own nodes."""
    return str(Path(path).resolve()) if path is not None and Path(path).exists() else path


class RayLLM:
    """`LLM.stream` on a Ray cluster, for `batchspec generate --ray`: prompts go out as a dataset,
    outputs come back as each batch finishes, with `index` into the given prompts, and `stats`
    summed over every worker's batches of the last `stream`.

    address: None starts a new local cluster (unless this process is connected already); "auto" joins
    the cluster `ray start` runs on this node; "HOST:6379" a cluster's head. Ray Client addresses
    (ray://) are refused: Ray Data's streaming executor needs a full driver (Ray 2.60).
    rows_per_call None: enough batches to keep every worker busy, at most 64 rows each.
    """

    def __init__(
        self,
        model: ModelConfig,
        spec: SpecConfig,
        workers: int = 1,
        address: str | None = None,
        rows_per_call: int | None = None,
        num_cpus: float = 1,
        num_gpus: float = 0,
    ) -> None:
        if workers < 1:
            raise BatchspecError(f"--ray-workers must be >= 1, got {workers}")
        if rows_per_call is not None and rows_per_call < 1:
            raise BatchspecError(f"--ray-batch-rows must be >= 1, got {rows_per_call}")
        self.model = asdict(model) | {"target": _absolute(model.target), "draft": _absolute(model.draft)}
        self.spec = asdict(spec)
        self.workers = workers
        self.rows_per_call = rows_per_call
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.stats = EngineStats()
        if address is not None and address.startswith("ray://"):
            raise BatchspecError("Ray Data cannot run through Ray Client (ray://); run this on a cluster node with "
                                 "--ray-address auto, or send it there with `ray job submit -- batchspec generate ...`")
        if not ray.is_initialized():
            try:
                ray.init(address=address or "local", include_dashboard=False, logging_level="WARNING",
                         log_to_driver=False)
            except ConnectionError as err:
                raise BatchspecError(f"cannot reach the Ray cluster at {address} ({err}); is `ray start` running "
                                     "there, and has this machine the cluster's token (RAY_AUTH_MODE=token)?") from err
        ray.data.DataContext.get_current().enable_progress_bars = False  # generate draws its own

    def stream(self, prompts: Seq[Prompt], params: Seq[SamplingParams]) -> Iterator[RequestOutput]:
        """Every prompt's output (or error) once, as batches finish; `index` says which prompt."""
        if len(params) != len(prompts):
            raise BatchspecError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if not prompts:
            return
        rows = [{"id": str(i), "prompt": p, **asdict(sp)} for i, (p, sp) in enumerate(zip(prompts, params))]
        per_call = self.rows_per_call or max(1, min(64, math.ceil(len(rows) / (2 * self.workers))))
        ds = ray.data.from_items(rows, override_num_blocks=math.ceil(len(rows) / per_call))
        sink = StatsSink.remote()
        try:
            out = generate_dataset(ds, model=self.model, spec=self.spec, concurrency=self.workers,
                                   batch_size=per_call, num_cpus=self.num_cpus, num_gpus=self.num_gpus,
                                   stats_sink=sink)
            for batch in out.iter_batches(batch_size=None, batch_format="pyarrow"):
                for row in batch.to_pylist():
                    yield RequestOutput(index=int(row.pop("id")), **row)
            self.stats = EngineStats(**ray.get(sink.total.remote()))
        except ray.exceptions.ActorDiedError as err:
            if not err.actor_init_failed:
                raise
            # e.g. a model path missing on a worker's node: the last line is the worker's own error
            reason = str(err).strip().splitlines()[-1]
            reason = reason.removeprefix(f"{BatchspecError.__module__}.{BatchspecError.__name__}: ")
            raise BatchspecError(f"a Ray worker could not start: {reason}") from err
        finally:
            ray.kill(sink)
