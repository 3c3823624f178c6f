"""The checkpoint's tokenizer: loaded with one clear error, and the BOS convention a prompt follows.

BOS, as Hugging Face tokenizers decide it, in this order:
  1. `--bos` / `--no-bos` (the user);
  2. `add_bos_token` in tokenizer_config.json (transformers' Llama-style tokenizers honour it);
  3. tokenizer.json's post-processor, when it has one that places special tokens (TemplateProcessing,
     BertProcessing, RobertaProcessing): whatever it adds is kept, nothing more;
  4. otherwise (neither says) the config's `bos_token_id` is prepended, as mtp-trt always did.
In every case a BOS is never doubled, and without one the post-processor's specials are left out.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mtp_trt.errors import MtpTrtError
from mtp_trt.fsutil import Either, read_json

SPECIAL_PROCESSORS = ("TemplateProcessing", "BertProcessing", "RobertaProcessing")
TOKENIZER_CONFIG = "tokenizer_config.json"
# The fields of tokenizer_config.json that mtp-trt reads (the BOS rule, serve's chat template and its special
# tokens), typed as transformers writes them; the file's other fields are not read.
SPECIAL_TOKEN = Either(str, {"content": str})
TOKENIZER_CONFIG_SCHEMA = {"add_bos_token?": bool, "chat_template?": Either(str, [{"name": str, "template": str}]),
                           "bos_token?": SPECIAL_TOKEN, "eos_token?": SPECIAL_TOKEN, "pad_token?": SPECIAL_TOKEN,
                           "unk_token?": SPECIAL_TOKEN}


def read_tokenizer_config(root: Path) -> dict | None:
    """`root`'s tokenizer_config.json, its fields typed (TOKENIZER_CONFIG_SCHEMA); None where there is none."""
    path = root / TOKENIZER_CONFIG
    return read_json(path, TOKENIZER_CONFIG_SCHEMA) if path.is_file() else None


def load_tokenizer(path: Path):
    """A tokenizers.Tokenizer from tokenizer.json, or an MtpTrtError naming the file."""
    from tokenizers import Tokenizer

    if not path.is_file():
        raise MtpTrtError(f"{path}: tokenizer file not found")
    try:
        tok = Tokenizer.from_file(str(path))
        tok.encode("a")
    except Exception as e:  # tokenizers raises plain Exception subclasses with multi-line serde messages
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise MtpTrtError(f"{path}: not a valid tokenizers file ({first[:200]})") from None
    return tok


def check_vocab(tokenizer, vocab_size: int, path: Path) -> None:
    """Every id the tokenizer can produce is a row of the model's embedding (ids >= vocab_size would be read out
    of range), else an MtpTrtError naming the file."""
    top = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= vocab_size:
        raise MtpTrtError(f"{path}: holds token ids up to {top}, but the model's vocab_size is {vocab_size}; the "
                          f"tokenizer belongs to another model")


def _processor_places_specials(node) -> bool:
    if not isinstance(node, dict):
        return False
    if node.get("type") in SPECIAL_PROCESSORS:
        return True
    return any(_processor_places_specials(p) for p in node.get("processors", []) or [])


@dataclasses.dataclass(frozen=True)
class BosPolicy:
    add: bool  # the prompt starts with BOS
    token_id: int | None  # the BOS id prepended when the tokenizer does not add it (None: it adds its own)
    source: str  # what decided, for `mtp-trt inspect` and messages
    use_post_processor: bool  # encode with the tokenizer's post-processor (add_special_tokens)

    def describe(self) -> str:
        if not self.add:
            return f"none ({self.source})"
        return f"id {self.token_id} ({self.source})" if self.token_id is not None else f"added by {self.source}"


def bos_policy(root: Path, bos_token_id: int | None, tokenizer=None, flag: bool | None = None) -> BosPolicy:
    """The BOS convention of the checkpoint or export in `root` (see the module docstring).  `tokenizer`: the
    loaded tokenizer.json, if any; `flag`: --bos (True) / --no-bos (False) / neither (None)."""
    post = None
    if tokenizer is not None:
        plain = tokenizer.encode("a", add_special_tokens=False).ids
        full = tokenizer.encode("a").ids
        post = full[0] if len(full) > len(plain) and full[: len(plain)] != plain else -1  # -1: adds no leading token
    if flag is not None:
        if not flag:
            return BosPolicy(False, None, "--no-bos", False)
        bos = bos_token_id if bos_token_id is not None else (post if post is not None and post >= 0 else None)
        if bos is None:
            raise MtpTrtError(f"--bos: {root} names no BOS token (config bos_token_id); give --no-bos or neither")
        return BosPolicy(True, bos, "--bos", False)
    cfg_path = root / TOKENIZER_CONFIG
    if (tokenizer_config := read_tokenizer_config(root)) is not None:
        add = tokenizer_config.get("add_bos_token")
        if add is not None:
            source = f"{cfg_path.name} add_bos_token {str(add).lower()}"
            if not add:
                return BosPolicy(False, None, source, False)
            bos = bos_token_id if bos_token_id is not None else (post if post is not None and post >= 0 else None)
            if bos is None:
                raise MtpTrtError(f"{cfg_path}: add_bos_token is true but no BOS id is known (config bos_token_id)")
            return BosPolicy(True, bos, source, False)
    tok_path = root / "tokenizer.json"
    if tokenizer is not None and tok_path.is_file():
        processor = read_json(tok_path, dict).get("post_processor")
        if _processor_places_specials(processor):
            if post is not None and post >= 0:
                return BosPolicy(True, None, "the tokenizer's post-processor", True)
            return BosPolicy(False, None, "the tokenizer's post-processor adds none", True)
    if bos_token_id is None:
        return BosPolicy(False, None, "neither the tokenizer nor the config's bos_token_id names one", False)
    return BosPolicy(True, bos_token_id, "config bos_token_id", True)


def encode(tokenizer, text: str, policy: BosPolicy) -> list[int]:
    """Prompt ids under `policy`: BOS first exactly when the policy says so, never twice.  (Through encode_batch,
    which releases the GIL while it works: a long prompt tokenized in one thread holds up no other.)"""
    ids = tokenizer.encode_batch([text], add_special_tokens=policy.use_post_processor)[0].ids
    if policy.add and policy.token_id is not None and (not ids or ids[0] != policy.token_id):
        ids = [policy.token_id, *ids]
    return ids


def chat_renderer(root: Path):
    """messages -> the prompt text under the chat template of `root`'s tokenizer_config.json (`chat_template`, the
    default one of a list; compiled once, in jinja2's sandbox, as transformers renders it), ending with the
    assistant's turn; None where there is no template.  A template that does not compile is an MtpTrtError naming
    the file; one that refuses the messages, an MtpTrtError when called."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    cfg = read_tokenizer_config(root) or {}
    source = cfg.get("chat_template")
    if isinstance(source, list):
        source = next((t["template"] for t in source if t["name"] == "default"), None)
    if source is None:
        return None
    specials = {name: (v["content"] if isinstance(v, dict) else v or "") for name in
                ("bos_token", "eos_token", "pad_token", "unk_token") for v in [cfg.get(name)]}

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        compiled = env.from_string(source)
    except TemplateError as e:
        raise MtpTrtError(f"{root / TOKENIZER_CONFIG}: field 'chat_template' does not compile ({e})") from None

    def render(messages: list[dict]) -> str:
        try:
            return compiled.render(messages=messages, add_generation_prompt=True, **specials)
        except TemplateError as e:
            raise MtpTrtError(f"the chat template refuses these messages: {e}") from None

    return render
