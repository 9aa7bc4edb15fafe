"""Models named by a Hugging Face Hub id ("org/name"), fetched into the Hub's own cache.

`snapshot(repo_id, revision)` returns the local directory of the model's snapshot, through
`huggingface_hub.snapshot_download` restricted to the files jaxpage reads (the config, the
safetensors weights and their index, the tokenizer's files, the generation config and chat
template). The Hub's settings are read when it is called: `HF_HUB_CACHE` (or `HF_HOME`/hub)
for the cache, `HF_HUB_OFFLINE=1` for no network (a cached snapshot loads; a missing one is
an error naming the id and the cache), `HF_TOKEN` for gated models. A local path of the same
spelling is never looked up here: the loader takes it first.
"""

from __future__ import annotations

import os
import re

# the files of a model repository jaxpage reads
ALLOW_PATTERNS = [
    "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.json", "chat_template.jinja",
]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")
_TRUE = ("1", "true", "yes", "on")


def is_repo_id(name: str) -> bool:
    """Whether `name` is spelled as a Hub model id ("org/name")."""
    return bool(_REPO_ID.match(name)) and ".." not in name


def cache_dir() -> str:
    """The Hub cache this process uses: HF_HUB_CACHE, else HF_HOME/hub, else the Hub's
    default (read now, not when huggingface_hub was imported)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def snapshot(repo_id: str, revision: str | None = None) -> str:
    """The local directory of `repo_id`'s snapshot at `revision` (default: the main branch),
    downloaded into the Hub cache unless it is there; a FileNotFoundError naming the id, the
    revision and the cache when it cannot be had (offline and not cached, no such repository
    or revision, no network)."""
    # huggingface_hub comes with transformers (jaxpage's tokenizers)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
    )

    where = (f"model {repo_id!r}" + (f" at revision {revision!r}" if revision else "")
             + f" (Hub cache {cache_dir()})")
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache_dir(),
                                 allow_patterns=ALLOW_PATTERNS, local_files_only=offline(),
                                 token=os.environ.get("HF_TOKEN") or None)
    except LocalEntryNotFoundError as e:
        reason = ("is not in the cache and HF_HUB_OFFLINE is set" if offline()
                  else "is not in the cache and the Hub could not be reached")
        raise FileNotFoundError(f"{where} {reason}: {e}") from e
    except (HfHubHTTPError, HFValidationError, OSError, ValueError) as e:
        raise FileNotFoundError(f"{where} could not be fetched: {type(e).__name__}: "
                                f"{e}") from e
