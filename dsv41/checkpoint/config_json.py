"""``config.json`` <-> ``ModelConfig`` and the deployment's ``Capacity``.

The file follows the released checkpoint: model fields under ``text_config`` with the Hugging Face
names (``rope_scaling`` holds YaRN, ``engram_pad_id`` the Engram pad, ``compress_ratios`` may carry
trailing 0s for the draft layers, ``num_nextn_predict_layers`` counts DSpark's stages and the
``dspark_*`` keys describe them), plus ``quantization_config``. Engine constants (paged-cache block
size, score budgets, and the capacity: batch and step rows per DP group) are not model math and are
absent from released files; test checkpoints written here keep theirs under a ``dsv41`` section so
they run as their preset does. A file without them runs with FLASH's.
"""
from __future__ import annotations

import math
from dataclasses import fields, replace

from dsv41.checkpoint.errors import CheckpointError
from dsv41.config import FLASH, ConfigError, ModelConfig
from dsv41.capacity import Capacity, capacity_of
from dsv41.ops.engram import engram_table_rows

FILE = "config.json"
# ModelConfig field -> text_config key, where the names differ
RENAMED = {"engram_pad_token_id": "engram_pad_id", "n_mtp_layers": "num_nextn_predict_layers",
           "dspark_n_activated_experts": "dspark_num_experts_per_tok"}
# DSpark's fields: present together when num_nextn_predict_layers > 0 and dspark_block_size is set; a
# file without them (or with draft layers of another kind) has no DSpark
DSPARK = ("n_mtp_layers", "dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids",
          "dspark_markov_rank", "dspark_n_routed_experts", "dspark_n_activated_experts")
# the official inference code's name for dspark_num_experts_per_tok, read when that one is absent
ACTIVATED_ALIAS = "dspark_n_activated_experts"
ROPE_SCALING = ("rope_factor", "beta_fast", "beta_slow", "original_max_position_embeddings")
# the dsv41 section, in the order written: ModelConfig's cache layout, and the Capacity's fields
ENGINE = ("block_size", "state_capacity", "max_batch_per_dp", "decode_rows_per_request", "prefill_max_tokens",
          "index_score_budget_bytes", "index_score_leaf")
CAPACITY = tuple(f.name for f in fields(Capacity))
LAYOUT = tuple(k for k in ENGINE if k not in CAPACITY)
# released keys this project does not read but whose value the math here assumes
ASSUMED = {"scoring_func": "sqrtsoftplus", "hidden_act": "silu", "num_key_value_heads": 1, "norm_topk_prob": True,
           "gate_temp": 1.0, "tie_word_embeddings": False, "n_shared_experts": 1}
QUANTIZATION = {"quant_method": "fp8", "weight_block_size": [32, 32]}


def _model_fields() -> list[str]:
    skip = set(ROPE_SCALING) | set(LAYOUT) | set(DSPARK) | {"name", "mx_group", "extra"}
    return [f.name for f in fields(ModelConfig) if f.name not in skip]


def to_json(cfg: ModelConfig, capacity: Capacity | None = None) -> dict:
    """The file of cfg run with capacity (default: its preset's, ``capacity_of``)."""
    capacity = capacity or capacity_of(cfg)
    engine = {k: getattr(capacity if k in CAPACITY else cfg, k) for k in ENGINE}
    text = {RENAMED.get(k, k): getattr(cfg, k) for k in _model_fields()}
    text = {k: list(v) if isinstance(v, tuple) else v for k, v in text.items()}
    text["rope_scaling"] = {"rope_type": "yarn", "factor": cfg.rope_factor, "beta_fast": cfg.beta_fast,
                            "beta_slow": cfg.beta_slow,
                            "original_max_position_embeddings": cfg.original_max_position_embeddings}
    text["engram_num_embeddings"] = [engram_table_rows(cfg, layer) for layer in cfg.engram_layer_ids]
    text["num_nextn_predict_layers"] = cfg.n_mtp_layers
    if cfg.dspark:
        # the released file lists a ratio per draft layer too: 0, window-only attention
        text["compress_ratios"] = text["compress_ratios"] + [0] * cfg.n_mtp_layers
        text.update({RENAMED.get(k, k): list(v) if isinstance(v, tuple) else v
                     for k, v in ((k, getattr(cfg, k)) for k in DSPARK[1:])})
    text.update(ASSUMED)
    return {"model_type": "deepseek_v41", "text_config": text, "quantization_config": dict(QUANTIZATION),
            "dsv41": {"name": cfg.name, **engine}}


def _key(field: str) -> str:
    """Where a ModelConfig or Capacity field is written in config.json."""
    if field in ENGINE:
        return f"dsv41.{field}"
    if field in ROPE_SCALING:
        return "text_config.rope_scaling." + ("factor" if field == "rope_factor" else field)
    return f"text_config.{RENAMED.get(field, field)}"


def _fail(key: str, expected, found):
    raise CheckpointError(f"{FILE}: {key}: expected {expected}, found {found!r}")


def _typed(key: str, value, kind):
    """value checked against the field's declared type (bool is not an int here)."""
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(key, "an integer", value)
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(key, "a number", value)
        value = float(value)
        if not math.isfinite(value):    # Python's JSON reader takes NaN and Infinity
            _fail(key, "a finite number", value)
    else:  # tuple[int, ...]
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            _fail(key, "a list of integers", value)
        value = tuple(value)
    return value


def _kind(name: str):
    hint = {f.name: f.type for f in fields(ModelConfig)}[name]
    return {"int": int, "float": float}.get(hint, tuple)


def _dspark_values(text: dict, draft: int) -> dict:
    """DSpark's fields from text_config: all of them when it has draft layers and a DSpark block, else
    none (n_mtp_layers 0: no DSpark)."""
    if draft <= 0 or "dspark_block_size" not in text:
        return {"n_mtp_layers": 0}
    values = {"n_mtp_layers": draft}
    for field in DSPARK[1:]:
        key = RENAMED.get(field, field)
        if key not in text and field == "dspark_n_activated_experts" and ACTIVATED_ALIAS in text:
            key = ACTIVATED_ALIAS
        if key not in text:
            _fail(f"text_config.{key}", "present (the file declares DSpark: dspark_block_size)", "missing")
        values[field] = _typed(f"text_config.{key}", text[key], _kind(field))
    return values


def from_json(doc, name: str) -> ModelConfig:
    """A validated ModelConfig; the first missing, mistyped or inconsistent field raises
    CheckpointError naming it."""
    if not isinstance(doc, dict):
        _fail("top level", "a JSON object", type(doc).__name__)
    text = doc.get("text_config", doc)   # a flat text config is accepted too
    if not isinstance(text, dict):
        _fail("text_config", "a JSON object", type(text).__name__)
    values = {}
    if "candidate_source_layer_id" not in text and isinstance(text.get("kv_source_layer_ids"), list):
        # the Hugging Face config's rule when it is left out: the last KV source
        text = {**text, "candidate_source_layer_id": max(text["kv_source_layer_ids"], default=-1)}
    for field in _model_fields():
        key = RENAMED.get(field, field)
        if key not in text:
            _fail(f"text_config.{key}", "present", "missing")
        values[field] = _typed(f"text_config.{key}", text[key], _kind(field))
    scaling = text.get("rope_scaling")
    if not isinstance(scaling, dict):
        _fail("text_config.rope_scaling", "a JSON object with factor, beta_fast, beta_slow, "
              "original_max_position_embeddings", scaling)
    if scaling.get("rope_type", "yarn") != "yarn":
        _fail("text_config.rope_scaling.rope_type", "'yarn'", scaling["rope_type"])
    for field in ROPE_SCALING:
        key = "factor" if field == "rope_factor" else field
        if key not in scaling:
            _fail(f"text_config.rope_scaling.{key}", "present", "missing")
        values[field] = _typed(f"text_config.rope_scaling.{key}", scaling[key], _kind(field))
    n = values["num_hidden_layers"]
    draft = _typed("text_config.num_nextn_predict_layers", text.get("num_nextn_predict_layers", 0), int)
    values.update(_dspark_values(text, draft))
    ratios = values["compress_ratios"]
    if len(ratios) > n and (len(ratios) > n + draft or any(ratios[n:])):
        _fail("text_config.compress_ratios", f"{n} ratios plus at most num_nextn_predict_layers={draft} "
              "trailing 0s", list(ratios))
    values["compress_ratios"] = ratios[:n]
    for key, want in ASSUMED.items():
        if key in text and text[key] != want:
            _fail(f"text_config.{key}", repr(want), text[key])
    quant = doc.get("quantization_config")
    if quant is not None:
        for key, want in QUANTIZATION.items():
            if quant.get(key) != want:
                _fail(f"quantization_config.{key}", repr(want), quant.get(key))
    engine = _engine_section(doc)
    for key in LAYOUT:
        if key in engine:
            values[key] = _typed(f"dsv41.{key}", engine[key], int)
    try:
        cfg = replace(FLASH, name=engine.get("name", name), **values).validate()
    except ConfigError as e:
        rule = str(e).split(": ", 1)[1]
        raise CheckpointError(f"{FILE}: {_key(e.field)}: {rule}") from None
    except ValueError as e:
        raise CheckpointError(f"{FILE}: {e}") from None
    rows = text.get("engram_num_embeddings")
    want = [engram_table_rows(cfg, layer) for layer in cfg.engram_layer_ids]
    if rows is not None and list(rows) != want:
        _fail("text_config.engram_num_embeddings", f"{want} (primes from engram_vocab_size)", rows)
    return cfg


def _engine_section(doc) -> dict:
    engine = doc.get("dsv41", {}) if isinstance(doc, dict) else {}
    if not isinstance(engine, dict):
        _fail("dsv41", "a JSON object", type(engine).__name__)
    return engine


def capacity_from_json(doc) -> Capacity:
    """The validated capacity of the dsv41 section (FLASH's for a key it leaves out); a mistyped or
    out-of-range key raises CheckpointError naming it."""
    engine = _engine_section(doc)
    values = {k: _typed(f"dsv41.{k}", engine[k], int) for k in CAPACITY if k in engine}
    try:
        return Capacity(**values).validate()
    except ConfigError as e:
        rule = str(e).split(": ", 1)[1]
        raise CheckpointError(f"{FILE}: {_key(e.field)}: {rule}") from None
