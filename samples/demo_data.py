"""Corpus, tokenizer and batches for the demo checkpoint (shared by train_demo.py and eval_demo.py).

Corpus: the running Python's own standard library (`sysconfig.get_paths()["stdlib"]`, *.py), without
site-packages, test directories, and two generated-data trees (`encodings/` codec tables and
`pydoc_data/`).  Whole files are held out for evaluation by a hash of their relative path, so the
split is the same on every machine with the same Python version.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<think>", "</think>"]
PAD, BOS, EOS, THINK, END_THINK = range(5)
HELDOUT_PERCENT = 5  # files whose sha1(relpath) % 100 < this are held out


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _skip_dir(rel: str) -> bool:
    parts = rel.split("/")
    return (
        "site-packages" in parts or "dist-packages" in parts or "__pycache__" in parts
        or parts[0] in ("test", "encodings", "pydoc_data")
        or any(p in ("tests", "idle_test") for p in parts)
    )


def _fraction(key: str, salt: str) -> float:
    """Deterministic number in [0, 1) from a string."""
    return int(hashlib.sha1(f"{salt}:{key}".encode()).hexdigest()[:8], 16) / 2**32


def is_heldout(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def list_files(root: Path | None = None) -> list[str]:
    """Relative paths (posix) of the corpus files, sorted."""
    root = root or stdlib_root()
    out = []
    for d, dirs, files in os.walk(root):
        rel_d = Path(d).relative_to(root).as_posix()
        if rel_d != "." and _skip_dir(rel_d):
            dirs[:] = []
            continue
        dirs.sort()
        for f in files:
            if f.endswith(".py"):
                out.append(f if rel_d == "." else f"{rel_d}/{f}")
    return sorted(out)


def read_source(rel: str, root: Path | None = None) -> str | None:
    try:
        return ((root or stdlib_root()) / rel).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def split_files(files: list[str]) -> tuple[list[str], list[str]]:
    train = [f for f in files if not is_heldout(f)]
    held = [f for f in files if is_heldout(f)]
    return train, held


# ------------------------------------------------------------------------------------- thinking
def docstrings_as_think(src: str) -> str:
    """Move each function's docstring in front of its `def` as one line `<think>...</think>`.

    Teaches the model to open and close think blocks ("think, then write the code").  Functions
    whose docstring shares the def's line are left alone; on any parse problem the source is
    returned unchanged."""
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError):
        return src
    lines = src.splitlines(keepends=True)
    edits = []  # (first_line_0based, last_line_0based_inclusive, replacement_lines)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        first = node.body[0]
        if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)):
            continue
        if len(node.body) < 2 or first.lineno == node.lineno or first.end_lineno is None:
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        # the docstring must sit on lines of its own, before the next statement
        if node.body[1].lineno <= first.end_lineno:
            continue
        indent = lines[start - 1][: len(lines[start - 1]) - len(lines[start - 1].lstrip())]
        text = " ".join(ast.get_docstring(node, clean=True).split())
        edits.append((first.lineno - 1, first.end_lineno - 1, []))
        edits.append((start - 1, start - 2, [f"{indent}<think>{text}</think>\n"]))  # pure insertion
    for a, b, repl in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        lines[a:b + 1] = repl
    return "".join(lines)


def render(rel: str, src: str, think_fraction: float) -> str:
    if think_fraction > 0 and _fraction(rel, "think") < think_fraction:
        return docstrings_as_think(src)
    return src


# ------------------------------------------------------------------------------------ tokenizer
def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def encode_files(tok, texts: list[str]) -> np.ndarray:
    """One stream: <bos> file <eos> <bos> file <eos> ..., as int32."""
    encs = tok.encode_batch(texts, add_special_tokens=False)
    parts = []
    for e in encs:
        parts.append(np.array([BOS] + e.ids + [EOS], dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def eval_windows(stream: np.ndarray, length: int, max_windows: int) -> np.ndarray:
    """Non-overlapping windows [n, length] from the start of the held-out stream (deterministic)."""
    n = min(len(stream) // length, max_windows)
    return stream[: n * length].reshape(n, length)
