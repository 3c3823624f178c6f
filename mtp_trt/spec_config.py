"""Speculative-decoding configs users already have: TensorRT-LLM's `speculative_config` and vLLM's.

TensorRT-LLM:  {"decoding_type": "MTP", "num_nextn_predict_layers": 3, "use_relaxed_acceptance_for_thinking":
                true, "relaxed_topk": 10, "relaxed_delta": 0.6, "use_mtp_vanilla": false}
vLLM:          {"method": "deepseek_mtp", "num_speculative_tokens": 3}
Either may sit under a top-level "speculative_config" key; JSON, or YAML when PyYAML is installed.  The same names
serve every supported family: both engines run the MTP layers of DeepSeek-V3.2 and GLM-5 as they run DeepSeek-V3's
(vLLM's generic "mtp" or "deepseek_mtp", TensorRT-LLM's "MTP").
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from mtp_trt.config import MAX_NEXTN, MAX_TOKEN_ID
from mtp_trt.errors import MtpTrtError
from mtp_trt.fsutil import check_json_limits, parse_json, too_deep

TRTLLM_KEYS = {"decoding_type", "num_nextn_predict_layers", "use_relaxed_acceptance_for_thinking", "relaxed_topk",
               "relaxed_delta", "use_mtp_vanilla", "max_draft_len"}
VLLM_KEYS = {"method", "num_speculative_tokens", "model", "draft_tensor_parallel_size"}
VLLM_METHODS = ("deepseek_mtp", "mtp")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    nextn: int
    mtp_mode: str | None = None  # None: whatever the export has
    relaxed_topk: int = 0  # 0: strict acceptance
    relaxed_delta: float = 0.0


def load_spec_config(path: str | Path) -> SpecConfig:
    path = Path(path)
    if path.is_dir():
        raise MtpTrtError(f"{path}: --config must be a file, but this is a directory")
    if not path.is_file():
        raise MtpTrtError(f"{path}: config file not found")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise MtpTrtError(f"{path}: not UTF-8 text (byte at offset {e.start})") from None
    try:
        json.loads(text, parse_int=str, parse_float=str)  # JSON syntax? (its limits: parse_json, below)
    except RecursionError:
        pass
    except json.JSONDecodeError as json_error:
        json_msg = f"{json_error.msg} at line {json_error.lineno} column {json_error.colno}"
        try:
            import yaml
        except ImportError:
            raise MtpTrtError(f"{path}: not valid JSON ({json_msg}; install PyYAML to read YAML)") from None
        try:
            data = check_json_limits(yaml.safe_load(text), str(path))
        except RecursionError:
            raise too_deep(str(path)) from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or (str(e).strip().splitlines() or ["invalid"])[0]
            raise MtpTrtError(f"{path}: neither JSON ({json_msg}) nor YAML ({problem}{where})") from None
        return parse_spec_config(data, str(path))
    data = parse_json(text, str(path))
    return parse_spec_config(data, str(path))


def parse_spec_config(data: Any, source: str = "config") -> SpecConfig:
    if isinstance(data, dict) and "speculative_config" in data:
        data = data["speculative_config"]
    if not isinstance(data, dict):
        raise MtpTrtError(f"{source}: expected an object with a speculative config, got {type(data).__name__}")
    if "decoding_type" in data:
        return _trtllm(data, source)
    if "method" in data:
        return _vllm(data, source)
    raise MtpTrtError(f"{source}: not a speculative config: expected TensorRT-LLM's 'decoding_type' or vLLM's "
                      f"'method' key")


def _check_keys(data: dict, valid: set[str], source: str, flavour: str) -> None:
    unknown = sorted(set(data) - valid)
    if unknown:
        raise MtpTrtError(f"{source}: unknown {flavour} key(s) {', '.join(map(repr, unknown))}; valid keys: "
                          f"{', '.join(sorted(valid))}")


def _int(data: dict, key: str, source: str, default: int | None = None, most: int = MAX_NEXTN) -> int:
    v = data.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= most:
        raise MtpTrtError(f"{source}: '{key}' must be an integer in 0..{most}, got {v!r}")
    return v


def _trtllm(data: dict, source: str) -> SpecConfig:
    _check_keys(data, TRTLLM_KEYS, source, "TensorRT-LLM speculative_config")
    if data["decoding_type"] != "MTP":
        raise MtpTrtError(f"{source}: decoding_type {data['decoding_type']!r} is not supported; valid: 'MTP'")
    nextn = _int(data, "num_nextn_predict_layers", source, data.get("max_draft_len", 1))
    relaxed = data.get("use_relaxed_acceptance_for_thinking", False)
    if not isinstance(relaxed, bool):
        raise MtpTrtError(f"{source}: 'use_relaxed_acceptance_for_thinking' must be true or false, got {relaxed!r}")
    delta = data.get("relaxed_delta", 0.6)
    if not isinstance(delta, (int, float)) or isinstance(delta, bool) or not 0 <= delta < math.inf:
        raise MtpTrtError(f"{source}: 'relaxed_delta' must be a non-negative number, got {delta!r}")
    vanilla = data.get("use_mtp_vanilla")
    return SpecConfig(nextn=nextn, mtp_mode=None if vanilla is None else "vanilla" if vanilla else "eagle",
                      relaxed_topk=_int(data, "relaxed_topk", source, 1, MAX_TOKEN_ID) if relaxed else 0,
                      relaxed_delta=float(delta) if relaxed else 0.0)


def _vllm(data: dict, source: str) -> SpecConfig:
    _check_keys(data, VLLM_KEYS, source, "vLLM speculative_config")
    if data["method"] not in VLLM_METHODS:
        raise MtpTrtError(f"{source}: method {data['method']!r} is not supported; valid methods: "
                          f"{', '.join(VLLM_METHODS)}")
    return SpecConfig(nextn=_int(data, "num_speculative_tokens", source))
