"""Model configuration: `config.json` parsed, mapped onto the reference model and checked, with no torch import.

A checkpoint is either supported or refused.  `architectures` (else `model_type`; a config naming neither is
read as DeepSeek-V3's) picks one of FAMILIES, whose fields are mapped onto the reference model
(`exporters/model.py`, DeepSeek-V3's architecture, with DeepSeek Sparse Attention for DeepSeek-V3.2 and GLM-5)
as transformers' class for that architecture computes them; DeepSeek Sparse Attention fields in another family's
config and anything else end in one MtpTrtError naming the file, the architecture, what is missing and the
supported architectures.

Field names are the Hugging Face / DeepSeek ones.  Both spellings of RoPE scaling are accepted:
the official checkpoints' `rope_theta` + `rope_scaling: {"type": "yarn", ...}` and transformers 5's
`rope_parameters: {"rope_type": "yarn", "rope_theta": ..., ...}`.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from mtp_trt.errors import MtpTrtError
from mtp_trt.fsutil import read_json

SCORING_FUNCS = ("sigmoid", "softmax")
TOPK_METHODS = ("noaux_tc", "group_limited_greedy", "greedy")
ROPE_TYPES = ("default", "yarn")
HIDDEN_ACTS = ("silu",)
MAX_TOKEN_ID = 2**31 - 1  # token ids are int32 in the graphs
MLP_LAYER_TYPES = ("dense", "sparse")
# Counts of things the export builds one by one (graph inputs per layer, modules per expert): bounded before any
# work, well above the largest models of the supported families (DeepSeek-V3: 61 layers, 256 experts, 128 heads).
MAX_NEXTN = 16  # draft tokens per step (MTP modules, step graphs); acceptance compounds: deeper drafts rarely land
LIMITS = {"num_hidden_layers": 1024, "n_routed_experts": 4096, "num_attention_heads": 1024,
          "num_nextn_predict_layers": MAX_NEXTN}


@dataclasses.dataclass(frozen=True)
class Family:
    """A supported architecture (transformers' class name), the model_types that name it, and its models."""

    architecture: str
    model_types: tuple[str, ...]
    models: str


DEEPSEEK_V3 = Family("DeepseekV3ForCausalLM", ("deepseek_v3", "kimi_k2"), "DeepSeek-V3/R1, Kimi-K2")
DEEPSEEK_V2 = Family("DeepseekV2ForCausalLM", ("deepseek_v2",), "DeepSeek-V2")
GLM4_MOE_LITE = Family("Glm4MoeLiteForCausalLM", ("glm4_moe_lite",), "GLM-4.7-Flash")
DEEPSEEK_V32 = Family("DeepseekV32ForCausalLM", ("deepseek_v32",), "DeepSeek-V3.2")
GLM_MOE_DSA = Family("GlmMoeDsaForCausalLM", ("glm_moe_dsa",), "GLM-5")
FAMILIES = (DEEPSEEK_V3, DEEPSEEK_V2, GLM4_MOE_LITE, DEEPSEEK_V32, GLM_MOE_DSA)
DSA_FAMILIES = (DEEPSEEK_V32, GLM_MOE_DSA)  # DeepSeek Sparse Attention: a lightning indexer per layer

DSA_FIELDS = ("index_topk", "index_n_heads", "index_head_dim")
INDEXER_TYPES = ("full", "shared")


def supported_architectures() -> str:
    return ", ".join(f"{f.architecture} ({f.models})" for f in FAMILIES)


def _refusal(source: str, what: str, missing: str) -> MtpTrtError:
    return MtpTrtError(f"{source}: {what} is not supported: {missing}; supported architectures: "
                       f"{supported_architectures()}")


def resolve_family(d: dict[str, Any], source: str = "config") -> Family:
    """The supported family a config.json describes, from `architectures`, else `model_type`, else DeepSeek-V3
    (a config naming neither); anything else, or DeepSeek Sparse Attention fields in a family without them, is
    refused in one line."""
    archs, model_type = d.get("architectures"), d.get("model_type")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise MtpTrtError(f"{source}: field 'architectures' must be a list of class names, got {archs!r}")
    if model_type is not None and not isinstance(model_type, str):
        raise MtpTrtError(f"{source}: field 'model_type' must be a string, got {model_type!r}")
    by_arch = {f.architecture: f for f in FAMILIES}
    by_type = {t: f for f in FAMILIES for t in f.model_types}
    found: list[Family] = []
    for arch in archs or []:
        if arch not in by_arch:
            raise _refusal(source, f"architecture {arch}", "mtp-trt has no mapping of it onto its reference model")
        found.append(by_arch[arch])
    if not found and model_type is not None:
        if model_type not in by_type:
            raise _refusal(source, f"model_type '{model_type}' (and no 'architectures')",
                           "mtp-trt has no mapping of it onto its reference model")
        found.append(by_type[model_type])
    if len(set(found)) > 1:
        raise MtpTrtError(f"{source}: field 'architectures' names {', '.join(archs)}, which are different "
                          f"families; expected one of {supported_architectures()}")
    if found and model_type in by_type and by_type[model_type] is not found[0]:
        raise MtpTrtError(f"{source}: field 'model_type' is '{model_type}', a {by_type[model_type].architecture} "
                          f"type, but 'architectures' names {found[0].architecture}; the two must agree")
    family = found[0] if found else DEEPSEEK_V3
    dsa = [f for f in DSA_FIELDS if d.get(f) is not None]
    if dsa and family not in DSA_FAMILIES:
        raise _refusal(source, f"architecture {family.architecture} with field '{dsa[0]}' (DeepSeek Sparse "
                               f"Attention)", "that family has no lightning indexer; DeepSeek Sparse Attention "
                               f"checkpoints name {' or '.join(f.architecture for f in DSA_FAMILIES)}")
    return family


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Decoupled RoPE on `qk_rope_head_dim` dims, optionally YaRN-scaled (DeepSeek-V2 paper, App. B)."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    @staticmethod
    def yarn_mscale(factor: float, mscale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    @property
    def attention_factor(self) -> float:
        """Scale of cos/sin, as DeepSeek computes it: m(factor, mscale) / m(factor, mscale_all_dim); 1 for V3."""
        if self.type != "yarn":
            return 1.0
        return self.yarn_mscale(self.factor, self.mscale) / self.yarn_mscale(self.factor, self.mscale_all_dim)

    @property
    def softmax_mscale(self) -> float:
        """Extra factor on the softmax scale: mscale(factor, mscale_all_dim)^2 (YaRN), else 1."""
        if self.type != "yarn" or not self.mscale_all_dim:
            return 1.0
        return self.yarn_mscale(self.factor, self.mscale_all_dim) ** 2


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A supported checkpoint's architecture, as the reference model (DeepSeek-V3's) computes it, and its MTP
    modules.  `architecture` names the family it was read as (FAMILIES)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None  # None: q projected directly (DeepSeek-V2-Lite)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    moe_intermediate_size: int = 0
    n_routed_experts: int | None = None  # None or 0: every layer dense
    n_shared_experts: int = 0
    num_experts_per_tok: int = 1
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    mlp_layer_types: tuple[str, ...] | None = None  # per main layer "dense"/"sparse"; None: DeepSeek's rule
    num_nextn_predict_layers: int = 0
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope: RopeConfig = RopeConfig()
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    fp8_block_size: tuple[int, int] | None = None  # set when weights are FP8 block-quantized
    # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): index_topk None means dense MLA
    index_topk: int | None = None
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_rope_interleave: bool = False  # the indexer's RoPE pair layout (V3.2: halves; GLM-5: interleaved pairs)
    indexer_types: tuple[str, ...] | None = None  # per main layer "full" (own indexer) / "shared"; None: all full
    architecture: str = DEEPSEEK_V3.architecture

    # ----------------------------------------------------------------------------------- derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token and layer in the compressed cache: normed c_kv then roped k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def dsa(self) -> bool:
        """DeepSeek Sparse Attention: each query attends to the top `index_topk` rows its lightning indexer picks."""
        return self.index_topk is not None

    @property
    def cache_dim(self) -> int:
        """Values per token and layer in the persistent cache: the MLA latent, then (DSA) the indexer's key."""
        return self.latent_dim + (self.index_head_dim if self.dsa else 0)

    def has_indexer(self, layer_id: int) -> bool:
        """Whether layer `layer_id` runs its own lightning indexer (DSA layers marked "shared" reuse the previous
        layer's selection; MTP layers, at N + k, have their own)."""
        if not self.dsa:
            return False
        return layer_id >= self.num_hidden_layers or self.indexer_types is None or \
            self.indexer_types[layer_id] == "full"

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5 * self.rope.softmax_mscale

    def is_moe_layer(self, layer_id: int) -> bool:
        """`mlp_layer_types` where the family has it (MTP layers, at N + k: MoE), else DeepSeek's rule, MTP layers
        by their index N + k as in the official checkpoints."""
        if not self.n_routed_experts:
            return False
        if self.mlp_layer_types is not None:
            return layer_id >= self.num_hidden_layers or self.mlp_layer_types[layer_id] == "sparse"
        return layer_id >= self.first_k_dense_replace and layer_id % self.moe_layer_freq == 0

    def moe_layers(self, layers: int) -> int:
        """How many of layers 0..layers-1 are MoE (is_moe_layer), counted without visiting each."""
        if not self.n_routed_experts or layers <= 0:
            return 0
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[:layers].count("sparse") + max(0, layers - self.num_hidden_layers)
        k, f = self.first_k_dense_replace, self.moe_layer_freq  # multiples of f in k..layers-1
        return max(0, (layers - 1) // f - (k - 1) // f) if k > 0 else (layers - 1) // f + 1

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return tuple(self.eos_token_id) if isinstance(self.eos_token_id, list) else (self.eos_token_id,)

    # ----------------------------------------------------------------------------------- parsing
    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise MtpTrtError(f"{path}: config file not found")
        return cls.from_dict(read_json(path), source=str(path))

    def approx_parameters(self, nextn: int) -> int:
        """About how many parameters the model has with `nextn` MTP modules (to refuse what cannot fit)."""
        d, h = self.hidden_size, self.num_attention_heads
        q = (d * self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim) if self.q_lora_rank \
            else d * h * self.qk_head_dim
        attn = q + d * self.latent_dim + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim) \
            + h * self.v_head_dim * d
        dense = 3 * d * self.intermediate_size
        moe = 3 * d * self.moe_intermediate_size * ((self.n_routed_experts or 0) + self.n_shared_experts) \
            + d * (self.n_routed_experts or 0)
        n = self.num_hidden_layers + nextn
        n_moe = self.moe_layers(n)
        indexer = (self.q_lora_rank or 0) * self.index_n_heads * self.index_head_dim + d * self.index_head_dim \
            + d * self.index_n_heads
        indexers = sum(self.has_indexer(i) for i in range(n)) * indexer
        return 2 * self.vocab_size * d + n * attn + n_moe * moe + (n - n_moe) * dense + nextn * 2 * d * d + indexers

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> ModelConfig:
        def bad(field: str, msg: str) -> MtpTrtError:
            return MtpTrtError(f"{source}: field '{field}' {msg}")

        if not isinstance(d, dict):
            raise MtpTrtError(f"{source}: expected a JSON object of model fields, got a {type(d).__name__}")

        def get(field: str, kind: type, default: Any = dataclasses.MISSING) -> Any:
            if field not in d or d[field] is None:
                if default is dataclasses.MISSING:
                    raise bad(field, "is missing")
                return default
            v = d[field]
            if kind is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
                raise bad(field, f"must be an integer, got {v!r}")
            if not isinstance(v, kind):
                raise bad(field, f"must be {kind.__name__}, got {v!r}")
            if kind is int and v < 0:
                raise bad(field, f"must be >= 0, got {v}")
            return v

        def choice(field: str, allowed: tuple[str, ...], default: str) -> str:
            v = get(field, str, default)
            if v not in allowed:
                raise bad(field, f"has unknown value {v!r}; expected one of {', '.join(allowed)}")
            return v

        family = resolve_family(d, source)
        arch = family.architecture

        def implied(field: str, value: Any, why: str) -> Any:
            """A field the family's transformers class does not read: absent, or the value the class implies."""
            v = d.get(field)
            if v is not None and v != value:
                raise bad(field, f"is {v!r}, but {arch} {why}; expected {value!r} or no such field")
            return value

        n_routed = get("n_routed_experts", int, 0) or None
        rope = _parse_rope(d, source, get, bad)
        if get("mlp_bias", bool, False):
            raise bad("mlp_bias", "is true; biases on the MLP projections are not supported")
        layer_types = None
        dsa = _dsa_fields(d, get, bad, family)
        if family in DSA_FAMILIES:
            scoring = implied("scoring_func", "sigmoid", "always scores experts with sigmoid")
            topk_method = implied("topk_method", "noaux_tc", "always routes as noaux_tc")
            norm_topk = get("norm_topk_prob", bool, True)
            interleave = implied("rope_interleave", True, "always rotates MLA's interleaved pairs")
            # first_k_dense_replace only makes the default of mlp_layer_types, as in transformers' classes
            layer_types = _mlp_layer_types(d, get, bad, n_routed, default_dense=get("first_k_dense_replace", int, 3),
                                           check_rule=False)
        elif family is DEEPSEEK_V2:
            scoring = implied("scoring_func", "softmax", "always scores experts with softmax")
            topk_method = choice("topk_method", ("greedy", "group_limited_greedy"), "greedy")
            norm_topk = get("norm_topk_prob", bool, False)
            if norm_topk:
                raise bad("norm_topk_prob", f"is true, which {arch} does not support: transformers never "
                                            "normalizes its top-k weights, DeepSeek-V2's code normalizes them "
                                            "instead of scaling by routed_scaling_factor")
            interleave = implied("rope_interleave", True, "always rotates interleaved pairs")
        elif family is GLM4_MOE_LITE:
            scoring = implied("scoring_func", "sigmoid", "always scores experts with sigmoid")
            topk_method = implied("topk_method", "noaux_tc", "always routes as noaux_tc")
            norm_topk = get("norm_topk_prob", bool, True)
            interleave = get("rope_interleave", bool, True)
            layer_types = _mlp_layer_types(d, get, bad, n_routed)
        else:
            scoring = choice("scoring_func", SCORING_FUNCS, "sigmoid")
            topk_method = choice("topk_method", TOPK_METHODS, "noaux_tc")
            norm_topk = get("norm_topk_prob", bool, True)
            interleave = get("rope_interleave", bool, True)
        quant = d.get("quantization_config")
        fp8_block = None
        if quant and not isinstance(quant, dict):
            raise bad("quantization_config", f"must be an object, got {quant!r}")
        if quant:
            method = quant.get("quant_method")
            if method != "fp8":
                raise bad("quantization_config.quant_method", f"has unsupported value {method!r}; expected 'fp8'")
            block = quant.get("weight_block_size", [128, 128])
            if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
                raise bad("quantization_config.weight_block_size", f"must be two positive integers, got {block!r}")
            fp8_block = (block[0], block[1])
        cfg = cls(
            vocab_size=get("vocab_size", int),
            hidden_size=get("hidden_size", int),
            intermediate_size=get("intermediate_size", int),
            num_hidden_layers=get("num_hidden_layers", int),
            num_attention_heads=get("num_attention_heads", int),
            kv_lora_rank=get("kv_lora_rank", int),
            q_lora_rank=get("q_lora_rank", int, None),
            qk_nope_head_dim=get("qk_nope_head_dim", int),
            qk_rope_head_dim=get("qk_rope_head_dim", int),
            v_head_dim=get("v_head_dim", int),
            moe_intermediate_size=get("moe_intermediate_size", int, 0),
            n_routed_experts=n_routed,
            n_shared_experts=get("n_shared_experts", int, 0),
            num_experts_per_tok=get("num_experts_per_tok", int, 1),
            n_group=get("n_group", int, 1),
            topk_group=get("topk_group", int, 1),
            topk_method=topk_method,
            scoring_func=scoring,
            norm_topk_prob=norm_topk,
            routed_scaling_factor=get("routed_scaling_factor", float, 1.0),
            first_k_dense_replace=get("first_k_dense_replace", int, 0),
            moe_layer_freq=get("moe_layer_freq", int, 1),
            mlp_layer_types=layer_types,
            num_nextn_predict_layers=get("num_nextn_predict_layers", int, 0),
            hidden_act=choice("hidden_act", HIDDEN_ACTS, "silu"),
            rms_norm_eps=get("rms_norm_eps", float, 1e-6),
            max_position_embeddings=get("max_position_embeddings", int, 4096),
            rope=rope,
            rope_interleave=interleave,
            attention_bias=get("attention_bias", bool, False),
            tie_word_embeddings=get("tie_word_embeddings", bool, False),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            fp8_block_size=fp8_block,
            **dsa,
            architecture=arch,
        )
        cfg._check(bad)
        return cfg

    def _check(self, bad) -> None:
        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                  "qk_rope_head_dim", "v_head_dim", "max_position_embeddings"):
            if getattr(self, f) <= 0:
                raise bad(f, f"must be positive, got {getattr(self, f)}")
        for f, top in LIMITS.items():
            if (getattr(self, f) or 0) > top:
                raise bad(f, f"is {getattr(self, f)}, more than the {top} mtp-trt reads (each is a graph input, a "
                             f"module or an attention head the export builds one by one)")
        for f in ("vocab_size", "max_position_embeddings"):
            if getattr(self, f) > MAX_TOKEN_ID:
                raise bad(f, f"must be at most {MAX_TOKEN_ID} (token ids and positions are int32), "
                             f"got {getattr(self, f)}")
        for f in ("bos_token_id", "eos_token_id"):
            v = getattr(self, f)
            ids = v if isinstance(v, list) else [] if v is None else [v]
            if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.vocab_size for i in ids):
                raise bad(f, f"must be a token id (or list of ids) in 0..{self.vocab_size - 1}, got {v!r}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise bad("q_lora_rank", f"must be positive, or null for no q LoRA; got {self.q_lora_rank}")
        for f in ("rms_norm_eps", "routed_scaling_factor"):
            v = getattr(self, f)
            if not (math.isfinite(v) and v > 0):
                raise bad(f, f"must be a finite number > 0, got {v}")
        rope = self.rope
        for f in ("theta", "factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            v = getattr(rope, f)
            if not math.isfinite(v) or (v <= 0 and f in ("theta", "factor")):
                name = "rope_theta" if f == "theta" else f"rope_scaling.{f}"
                raise bad(name, f"must be a finite number{' > 0' if f in ('theta', 'factor') else ''}, got {v}")
        if self.qk_rope_head_dim % 2:
            raise bad("qk_rope_head_dim", f"must be even, got {self.qk_rope_head_dim}")
        if self.moe_layer_freq < 1:
            raise bad("moe_layer_freq", f"must be >= 1, got {self.moe_layer_freq}")
        if self.n_routed_experts:
            if self.moe_intermediate_size <= 0:
                raise bad("moe_intermediate_size", "must be positive when n_routed_experts is set")
            if self.n_group < 1 or self.n_routed_experts % self.n_group:
                raise bad("n_group", f"must divide n_routed_experts={self.n_routed_experts}, got {self.n_group}")
            if not 1 <= self.topk_group <= self.n_group:
                raise bad("topk_group", f"must be in 1..n_group={self.n_group}, got {self.topk_group}")
            if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
                raise bad("num_experts_per_tok", f"must be in 1..{self.n_routed_experts}, got {self.num_experts_per_tok}")
            per_group = self.n_routed_experts // self.n_group
            kept = self.topk_group * per_group
            if self.topk_method != "greedy" and self.num_experts_per_tok > kept:
                raise bad("num_experts_per_tok", f"is {self.num_experts_per_tok}, more than the {kept} experts of the "
                                                 f"topk_group={self.topk_group} groups routing keeps")
            if self.topk_method == "noaux_tc" and self.n_group > 1 and per_group < 2:
                raise bad("n_group", "leaves fewer than 2 experts per group; noaux_tc scores groups by their top 2")
            if self.topk_method == "noaux_tc" and self.scoring_func != "sigmoid":
                raise bad("topk_method", "'noaux_tc' needs scoring_func 'sigmoid'")


def _dsa_fields(d: dict[str, Any], get, bad, family: Family) -> dict[str, Any]:
    """A DSA family's indexer fields (ModelConfig's index_*, indexer_types), as its transformers class reads them;
    {} for the other families."""
    if family not in DSA_FAMILIES:
        return {}
    n = get("num_hidden_layers", int)
    fields = {"index_topk": get("index_topk", int, 2048), "index_n_heads": get("index_n_heads", int, 64 if family
                                                                                   is DEEPSEEK_V32 else 32),
              "index_head_dim": get("index_head_dim", int, 128), "index_rope_interleave": family is GLM_MOE_DSA}
    for f in ("index_topk", "index_n_heads", "index_head_dim"):
        if fields[f] <= 0:
            raise bad(f, f"must be positive, got {fields[f]}")
    if fields["index_head_dim"] < get("qk_rope_head_dim", int):
        raise bad("index_head_dim", f"must be at least qk_rope_head_dim={get('qk_rope_head_dim', int)} (the indexer "
                                    f"ropes its first qk_rope_head_dim dims), got {fields['index_head_dim']}")
    if get("q_lora_rank", int, None) is None:
        raise bad("q_lora_rank", f"is missing: the lightning indexer of {family.architecture} reads the query's "
                                 "LoRA latent")
    raw = d.get("indexer_types")
    if family is DEEPSEEK_V32:
        if raw is not None:
            raise bad("indexer_types", f"is set, but {family.architecture} runs an indexer in every layer")
        return fields
    if raw is None:  # transformers' GlmMoeDsaConfig: a pattern, else the freq / offset schedule
        pattern = d.get("index_topk_pattern")
        if pattern is not None:
            if not (isinstance(pattern, str) and set(pattern) <= {"F", "S"}):
                raise bad("index_topk_pattern", f"must be a string of F (full) and S (shared), got {pattern!r}")
            raw = [{"F": "full", "S": "shared"}[c] for c in pattern]
        else:
            freq, offset = max(get("index_topk_freq", int, 1), 1), get("index_skip_topk_offset", int, 2)
            raw = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if not (isinstance(raw, list) and len(raw) == n and all(t in INDEXER_TYPES for t in raw)):
        raise bad("indexer_types", f"must be a list of num_hidden_layers={n} values 'full' or 'shared', got {raw!r}")
    if raw and raw[0] != "full":
        raise bad("indexer_types", "starts with 'shared', but a shared layer reuses the previous full layer's "
                                   "selection")
    return fields | {"indexer_types": None if all(t == "full" for t in raw) else tuple(raw)}


def _mlp_layer_types(d: dict[str, Any], get, bad, n_routed: int | None, default_dense: int = 1,
                     check_rule: bool = True) -> tuple[str, ...]:
    """`mlp_layer_types` ("dense"/"sparse" per layer; transformers' default: the first `default_dense` layers dense
    (GLM-4.7-Flash: 1; DeepSeek-V3.2 and GLM-5: first_k_dense_replace), the others sparse), checked against
    `first_k_dense_replace` where the config has both (check_rule)."""
    n = get("num_hidden_layers", int)
    raw = d.get("mlp_layer_types")
    if raw is None:
        k = min(default_dense, n)
        types = ("dense",) * k + ("sparse",) * (n - k)
    elif not (isinstance(raw, list) and len(raw) == n and all(t in MLP_LAYER_TYPES for t in raw)):
        raise bad("mlp_layer_types", f"must be a list of num_hidden_layers={n} values 'dense' or 'sparse', got {raw!r}")
    else:
        types = tuple(raw)
    if "sparse" in types and not n_routed:
        first = "first" if default_dense == 1 else f"first {default_dense}"
        default = f" (by default: all but the {first})" if raw is None else ""
        raise bad("mlp_layer_types", f"names sparse (MoE) layers{default}, but n_routed_experts is 0")
    if check_rule and d.get("first_k_dense_replace") is not None:
        k, freq = get("first_k_dense_replace", int), get("moe_layer_freq", int, 1) or 1
        rule = tuple("sparse" if i >= k and i % freq == 0 else "dense" for i in range(n))
        if rule != types:
            dense = [i for i, t in enumerate(types) if t == "dense"]
            raise bad("first_k_dense_replace", f"is {k}, but mlp_layer_types{' (by default)' if raw is None else ''} "
                                               f"makes layers {dense} dense; the two must agree")
    return types


def _parse_rope(d: dict[str, Any], source: str, get, bad) -> RopeConfig:
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    field = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    if not isinstance(params, dict):
        raise bad(field, f"must be an object, got {params!r}")
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        raise bad("partial_rotary_factor", f"must be 1 (RoPE on all qk_rope_head_dim dims), got {partial!r}")
    if params.get("truncate", True) is not True:
        raise bad(f"{field}.truncate", f"must be true (YaRN's correction range rounded to whole dims), "
                                       f"got {params['truncate']!r}")
    if params.get("attention_factor") is not None:
        raise bad(f"{field}.attention_factor", "is not supported (YaRN's factor comes from mscale and mscale_all_dim)")
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
        raise bad("rope_theta", f"must be a finite number > 0, got {theta!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise bad(f"{field}.type", f"has unknown value {kind!r}; expected one of {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return RopeConfig(theta=float(theta))

    def num(key: str, default: float | None) -> float:
        v = params.get(key, default)
        if v is None:
            raise bad(f"{field}.{key}", "is missing (needed for YaRN)")
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise bad(f"{field}.{key}", f"must be a number, got {v!r}")
        return float(v)

    omax = params.get("original_max_position_embeddings", d.get("max_position_embeddings", 4096))
    if isinstance(omax, bool) or not isinstance(omax, int) or not 1 <= omax <= MAX_TOKEN_ID:
        raise bad(f"{field}.original_max_position_embeddings", f"must be an integer in 1..{MAX_TOKEN_ID}, got {omax!r}")
    return RopeConfig(
        theta=float(theta), type="yarn", factor=num("factor", None),
        original_max_position_embeddings=omax,
        beta_fast=num("beta_fast", 32.0) or 32.0, beta_slow=num("beta_slow", 1.0) or 1.0,
        mscale=num("mscale", 1.0), mscale_all_dim=num("mscale_all_dim", 0.0),
    )
