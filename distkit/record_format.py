"""The harness record's format: how a record names its model, and how records are appended, read
and upgraded from older schemas. The fields are documented in :mod:`distkit.harness` (which builds
records); :mod:`distkit.compare` reads them through this module.
"""
from __future__ import annotations

import json
import os
from typing import Any

from .models import GPTConfig, LlamaModelConfig, gpt_config

RECORD_SCHEMA = 2  # the harness record of distkit.harness; read_records upgrades older ones


def describe_model(model_config: GPTConfig | LlamaModelConfig | dict[str, Any] | None) -> dict[str, Any] | None:
    """The record's ``model`` field: ``{"arch": "gpt"|"llama", <config fields>}``, a dict that already
    names its ``arch``, or None."""
    if model_config is None:
        return None
    if isinstance(model_config, (GPTConfig, LlamaModelConfig)):
        return {"arch": model_config.arch, **model_config.to_dict()}
    if "arch" not in model_config:
        raise ValueError(f"a model description needs an 'arch' key, got {sorted(model_config)}")
    return dict(model_config)


def append_record(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append one JSON record as a line to ``path`` (JSON Lines), creating folders as needed."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a results file (JSON Lines), oldest first, in the current schema."""
    with open(path) as f:
        return [upgrade_record(json.loads(line)) for line in f if line.strip()]


def upgrade_record(record: dict[str, Any]) -> dict[str, Any]:
    """A record written by an older schema, read with today's definitions.

    * Before schema 1, throughput came from the *mean* step time (``step_time_s_mean``) while the
      median was reported. What one step processed is their throughput x their mean step time, so
      the median-based throughput of today follows from fields the record already holds.
    * Before schema 2 the model's configuration sat in different places: ``benchmark.gpt`` (the
      benchmark runner), ``config.gpt``, ``config.model_size`` plus overrides, or a name string in
      ``config.model``. Schema 2 keeps it in one top-level ``model`` field (:func:`describe_model`).
    """
    metrics = record.get("metrics") or {}
    mean = metrics.pop("step_time_s_mean", None)
    median = metrics.get("step_time_s_median")
    if mean:
        for kind in ("samples", "tokens"):
            rate = metrics.get(f"{kind}_per_s")
            per_step = rate * mean if rate else 0.0
            metrics[f"{kind}_per_step"] = per_step
            metrics[f"{kind}_per_s"] = per_step / median if per_step and median else None
    if (record.get("schema") or 0) < 2 and "model" not in record:
        record["model"] = _model_of_old_record(record)
    if "metrics" in record or "strategy" in record:
        record["schema"] = max(record.get("schema") or 0, RECORD_SCHEMA)
    return record


def _model_of_old_record(record: dict[str, Any]) -> dict[str, Any] | None:
    config = record.get("config") or {}
    bench = record.get("benchmark") or {}
    if isinstance(bench.get("gpt"), dict):  # the benchmark runner stored the exact config of its cell
        return describe_model(GPTConfig(**bench["gpt"]))
    if isinstance(config.get("gpt"), dict):
        return describe_model(GPTConfig(**config["gpt"]))
    if isinstance(config.get("model"), str):  # e.g. chapter 05's MLP: a name, no GPT
        return {"arch": config["model"]}
    if "model_size" in config:
        fields = GPTConfig.__dataclass_fields__
        overrides = {k: config[k] for k in fields if config.get(k) is not None}
        overrides.update(config.get("gpt_overrides") or {})
        return describe_model(gpt_config(config["model_size"], **overrides))
    return None
