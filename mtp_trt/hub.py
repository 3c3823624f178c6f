"""Models by Hugging Face repo id: `ORG/NAME` or `ORG/NAME@REVISION`, where no local path of that name exists,
is downloaded with huggingface_hub's `snapshot_download` into its own cache (HF_HOME, HF_TOKEN, HF_ENDPOINT and
HF_HUB_OFFLINE as the user sets them): only the files a model needs.  A download finished once is reused
without the network.  Every failure (an unknown repo, a gated one without a token, no network, a download cut
short) is one MtpTrtError naming the repo."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from mtp_trt.errors import MtpTrtError

REPO_ID = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)(?:@(?P<revision>[^@\s]+))?")
# what a checkpoint needs: its config, weights (and their index), tokenizer files and generation config
FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "generation_config.json"]


def repo_id(path: Path) -> tuple[str, str | None] | None:
    """(repo, revision) where `path` names no local file and reads as a repo id; else None."""
    text = str(path)
    if path.exists() or text.startswith((".", "/", "~")):
        return None
    m = REPO_ID.fullmatch(text)
    if m is None or ".." in m.group("repo") or m.group("repo").endswith("."):
        return None
    return m.group("repo"), m.group("revision")


def download(repo: str, revision: str | None) -> Path:
    """The local snapshot of `repo` at `revision` (default: main), downloaded where the Hugging Face cache does
    not hold it yet."""
    named = f"{repo}@{revision}" if revision else repo
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub import errors as hf
        from huggingface_hub.utils import disable_progress_bars, logging as hf_logging
    except ImportError:
        raise MtpTrtError(f"{named}: no such directory; as a Hugging Face repo id it needs huggingface_hub "
                          f"(pip install huggingface_hub)") from None
    if not sys.stderr.isatty():  # progress bars on a terminal only
        disable_progress_bars()
    hf_logging.set_verbosity_error()  # its retries are not errors; a failure is one line, below
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=FILES))
    except hf.GatedRepoError:
        raise MtpTrtError(f"{named}: a gated repository on the Hugging Face Hub; accept its terms there and set "
                          f"HF_TOKEN") from None
    except hf.RevisionNotFoundError:
        raise MtpTrtError(f"{named}: the Hugging Face repository has no revision {revision!r}") from None
    except hf.RepositoryNotFoundError:
        raise MtpTrtError(f"{named}: no such directory, nor a repository on the Hugging Face Hub (a private one "
                          f"needs HF_TOKEN)") from None
    except hf.LocalEntryNotFoundError:
        raise MtpTrtError(f"{named}: no such directory; as a Hugging Face repository it is not in the local cache "
                          f"and the Hub cannot be reached (no network, or HF_HUB_OFFLINE set)") from None
    except (hf.HfHubHTTPError, OSError, hf.HTTPError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise MtpTrtError(f"{named}: cannot download it from the Hugging Face Hub ({first})") from None


def snapshot_name(path: Path) -> str | None:
    """`NAME-COMMIT12` for a Hugging Face cache snapshot (…/models--ORG--NAME/snapshots/COMMIT); else None."""
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return f"{path.parent.parent.name.split('--')[-1]}-{path.name[:12]}"
    return None
