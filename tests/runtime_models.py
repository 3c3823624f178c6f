"""Test models for the decode loop: random ones, and a "self-drafting" one whose MTP modules copy the
main model so that drafts are often (not always) right — real partial acceptance with real graphs."""

from __future__ import annotations

from pathlib import Path

import torch

from hf_models import BASE
from mtp_trt.config import ModelConfig
from mtp_trt.decode import admit, open_batch, prefill_chunk, step
from mtp_trt.exporters.export import export
from mtp_trt.exporters.loader import save_checkpoint
from mtp_trt.exporters.model import DeepseekV3

THINK = (90, 91)
EOS = 95


def self_drafting_config(nextn: int, **overrides) -> dict:
    return {**BASE, "num_hidden_layers": 1, "first_k_dense_replace": 0, "num_nextn_predict_layers": nextn,
            "max_position_embeddings": 256, "eos_token_id": EOS, **overrides}


def make_self_drafting(path: Path, nextn: int = 3, seed: int = 0, **overrides) -> Path:
    """One MoE layer; unit-RMS embeddings; each MTP module = a copy of that layer with eh_proj = [I | 0]
    (it reads only the embedding of t_{i+1}) and shared_head.norm = the final norm, so it predicts
    t_{i+2} much as the main model does from t_{i+1} -- but over its own cache, whose first row saw a
    zeroed embedding, so it is sometimes wrong.  `overrides`: config entries."""
    torch.manual_seed(seed)
    d = self_drafting_config(nextn, **overrides)
    model = DeepseekV3(ModelConfig.from_dict(d)).init_weights(std=0.3)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.copy_(emb / emb.pow(2).mean(-1, keepdim=True).sqrt())
        layer = model.model.layers[0].state_dict()
        hidden = d["hidden_size"]
        for mtp in model.mtp:
            mtp.load_state_dict(layer, strict=False)
            mtp.eh_proj.weight.copy_(torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1))
            mtp.enorm.weight.fill_(1.0)
            mtp.shared_head.norm.weight.copy_(model.model.norm.weight)
    save_checkpoint(model, path, d)
    write_char_tokenizer(path / "tokenizer.json")
    return path


CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;()[]=+-*/_'\"\n#<>!?{}"


def write_char_tokenizer(path: Path) -> None:
    """A character-level tokenizer over the first 90 ids, with <think>, </think> and <eos> specials."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<think>", "</think>", "<unk>", "<pad>", "<bos>", "<eos>"]  # ids 90..95
    vocab = {c: i for i, c in enumerate(CHARS)} | {s: 90 + i for i, s in enumerate(specials)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    assert tok.token_to_id("<think>") == THINK[0] and tok.token_to_id("<eos>") == EOS
    tok.save(str(path))


def make_random(path: Path, nextn: int = 2, seed: int = 0, **overrides) -> Path:
    """Random weights (config moe_qlora_yarn + overrides), `nextn` MTP modules, and the character tokenizer
    (<think> / </think> are ids 90 / 91)."""
    from hf_models import CONFIGS

    torch.manual_seed(seed)
    d = {**BASE, **CONFIGS["moe_qlora_yarn"], "num_nextn_predict_layers": nextn, **overrides}
    save_checkpoint(DeepseekV3(ModelConfig.from_dict(d)).init_weights(0.15), path, d)
    write_char_tokenizer(path / "tokenizer.json")
    return path


def export_both(ckpt: Path, root: Path, nextn: int) -> dict[str, Path]:
    return {mode: export(ckpt, root / mode, nextn=nextn, mtp_mode=mode, max_seq_len=256, trees="none")
            for mode in ("eagle", "vanilla")}


def drive(backend, opts, seqs: list, schedule: dict, capacity: int, chunk: int | None, rows: int = 512,
          mixed: bool = False):
    """Decode `seqs` with continuous batching: schedule[t] = ("admit", [i...]) or ("cancel", [i...]) before
    step t (admissions wait for free slots and for the previous join).  Returns the number of steps."""
    batch = open_batch(backend, opts, capacity, rows, mixed)
    pending, t = [], 0
    while True:
        kind, which = schedule.get(t, (None, []))
        if kind == "admit":
            pending += which
        elif kind == "cancel":
            for i in which:
                seqs[i].finish_reason = "cancelled"
        if pending and batch.free:
            take, pending = pending[:batch.free], pending[batch.free:]
            admit(batch, {i: seqs[i] for i in take})
        if batch.joining:
            prefill_chunk(backend, batch, chunk)
        step(backend, batch)
        t += 1
        if not (pending or batch.joining or batch.st.n or any(k > t for k in schedule)):
            return t
