"""A harness record next to its prediction: the model and knobs of the cell a record measured
(:func:`config_of_record`, :func:`knobs_of_record`), the prediction for it (:func:`predict_record`,
from :mod:`distkit.predictors`), and measured vs predicted, collective by collective
(:func:`compare_record`), what ``benchmarks/``, the notebooks and the tests check.
"""
from __future__ import annotations

import math
from typing import Any

from .models import GPTConfig, LlamaModelConfig, config_from_dict
from .predictors import predict
from .record_format import upgrade_record


def config_of_record(record: dict) -> GPTConfig | LlamaModelConfig:
    """The model config a harness record was trained with (its ``model`` field; see
    :func:`distkit.harness.upgrade_record` for records written before that field existed)."""
    model = upgrade_record(record).get("model") or {}
    if model.get("arch") not in ("gpt", "llama", "gpt_moe", "llama_moe"):
        raise ValueError(f"record of {record.get('strategy')!r} is not of a transformer: {record.get('model')}")
    return config_from_dict(model)


def knobs_of_record(record: dict) -> dict[str, Any]:
    """Strategy knobs (mesh shape, micro-batches ...) as :func:`~distkit.predictors.predict` expects them; for expert
    parallelism also the rows each rank routed in the step the harness counted
    (``counted_routing_per_rank``, written by ``05-advanced/expert_parallel.py``): ``routing``,
    per rank, per MoE layer, (rows sent, rows received)."""
    config = record.get("config", {})
    knobs: dict[str, Any] = {}
    mesh = config.get("mesh") or {}
    if "tp" in mesh:
        knobs["tp"] = mesh["tp"]
    if "ep" in mesh:
        knobs["ep"] = mesh["ep"]
    if config.get("cp"):
        knobs["cp"] = config["cp"]
    if record.get("counted_routing_per_rank"):
        knobs["routing"] = [[(sum(layer["sent"]), sum(map(sum, layer["received"]))) for layer in rank]
                            for rank in record["counted_routing_per_rank"]]
    if "shard" in mesh:
        knobs["shard"] = mesh["shard"]
    if config.get("hsdp_shard_size"):
        knobs["shard"] = config["hsdp_shard_size"]
    for key in ("microbatches", "stages_per_rank"):
        if config.get(key):
            knobs[key] = config[key]
    window = (config.get("engine_settings") or {}).get("stage3_max_live_parameters")
    if window is not None:
        knobs["stage3_max_live_parameters"] = window
    return knobs


def predict_record(record: dict) -> dict[str, Any]:
    """:func:`~distkit.predictors.predict` for the cell a harness record measured."""
    config = record.get("config", {})
    return predict(record["strategy"], config_of_record(record), record["world_size"],
                   int(config["global_batch_size"]), knobs_of_record(record))


# DeepSpeed adds one or two all-reduces of a scalar per step (overflow flag, gradient norm): 4-8
# bytes that theory does not model. Differences up to this many bytes per collective are ignored.
BOOKKEEPING_SLACK_BYTES = 16


def relative_error(measured: float, predicted: float, slack: float = 0.0) -> float:
    """|measured - predicted| / predicted, after forgiving ``slack`` bytes of difference
    (0 when they agree within the slack; inf when only the prediction is 0)."""
    diff = max(abs(measured - predicted) - slack, 0.0)
    if diff == 0:
        return 0.0
    return diff / predicted if predicted else math.inf


def compare_record(record: dict) -> dict[str, Any]:
    """Measured vs predicted for one record: total model-state bytes and bytes per collective,
    per rank, with the worst relative error of each."""
    pred = predict_record(record)
    metrics = record["metrics"]
    state_rows, comm_rows = [], []
    for rank, measured in enumerate(metrics["model_state_bytes_per_rank"]):
        want = pred["state_per_rank"][rank]
        state_rows.append({"rank": rank, "measured": sum(measured.values()), "predicted": sum(want.values()),
                           "measured_by_kind": measured, "predicted_by_kind": want})
    for rank, measured in enumerate(metrics.get("comm_per_step_per_rank") or [metrics["comm_per_step"]]):
        want = pred["comm_per_rank"][rank]
        for name in sorted(set(measured) | set(want)):
            if name == "barrier":
                continue
            got = measured.get(name, {}).get("bytes", 0.0)
            exp = want.get(name, {}).get("bytes", 0.0)
            comm_rows.append({"rank": rank, "collective": name, "measured": got, "predicted": exp,
                              "measured_bus": measured.get(name, {}).get("bus_bytes", 0.0),
                              "predicted_bus": want.get(name, {}).get("bus_bytes", 0.0)})
    total = lambda rows, key: sum(r[key] for r in rows if r["rank"] == 0)  # noqa: E731
    return {
        "strategy": record["strategy"], "world_size": record["world_size"],
        "state": state_rows, "comm": comm_rows,
        "state_error": max(relative_error(r["measured"], r["predicted"]) for r in state_rows),
        "comm_error": max([relative_error(r["measured"], r["predicted"], BOOKKEEPING_SLACK_BYTES)
                           for r in comm_rows] or [0.0]),
        "comm_bytes_rank0": {"measured": total(comm_rows, "measured"), "predicted": total(comm_rows, "predicted")},
    }
