"""A GGUF model is converted once to a jaxpage checkpoint in the cache directory, and later
loads read that checkpoint instead of dequantizing the file again (SmolLM2-135M: ~8 s from
the GGUF, ~1-2 s from the checkpoint).

Layout, under `jaxpage.cache_dir.cache_root()` (`$JAXPAGE_CACHE_DIR`, else
`~/.cache/jaxpage`):

    gguf/<file stem>-<hash of its resolved path>/<dtype>-<hash of the identity>/
        jaxpage_checkpoint.json, params/, tokenizer/   a jaxpage checkpoint
        gguf_source.json                               the identity and every file's size

The identity is what changes the converted arrays or tokenizer: the GGUF file's resolved
path, size and mtime, the dtype, this converter's version, the checkpoint format and the
versions of `gguf` (dequantizing) and `transformers` (the tokenizer). Any change is a new
entry; the stale entries of the same file and dtype are deleted once the new one is in place.

An entry is written into a temporary directory beside it and renamed into place when
complete, so a killed run leaves no half entry (only a `.tmp-*` directory, removed by a
later conversion once its process is gone). An entry that fails any check on load (identity
record, file sizes, the checkpoint itself) is deleted and converted again, with a warning.
A cache that cannot be written (read-only, disk full) costs only the speed-up.
`EngineConfig(cache_gguf=False)` / `--no-cache-gguf` turns all of this off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import warnings
from importlib import metadata
from typing import Any

from jaxpage.cache_dir import cache_root

logger = logging.getLogger("jaxpage.loading")

CACHE_SUBDIR = "gguf"
SOURCE_FILE = "gguf_source.json"
_TMP_PREFIX = ".tmp-"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def source_identity(path: str, dtype: Any) -> dict[str, Any]:
    """Everything the converted checkpoint depends on (JSON-ready)."""
    from jaxpage.loading.checkpoint import FORMAT_VERSION
    from jaxpage.loading.gguf import CONVERSION_VERSION

    real = os.path.realpath(path)
    st = os.stat(real)
    return {
        "gguf_path": real,
        "gguf_size": st.st_size,
        "gguf_mtime_ns": st.st_mtime_ns,
        "dtype": _dtype_name(dtype),
        "conversion_version": CONVERSION_VERSION,
        "checkpoint_format_version": FORMAT_VERSION,
        "gguf_version": _version("gguf"),
        "transformers_version": _version("transformers"),
    }


def _dtype_name(dtype: Any) -> str:
    import jax.numpy as jnp  # knows bfloat16 (numpy alone does not by name)

    return str(jnp.dtype(dtype))


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def entry_path(identity: dict[str, Any], root: str | None = None) -> str:
    """The cache entry directory for an identity (it may not exist)."""
    real = identity["gguf_path"]
    stem = os.path.splitext(os.path.basename(real))[0]
    source_dir = f"{stem}-{_digest(real)[:12]}"
    return os.path.join(root or cache_root(), CACHE_SUBDIR, source_dir,
                        f"{identity['dtype']}-{_digest(identity)[:16]}")


def _file_sizes(directory: str) -> dict[str, int]:
    sizes = {}
    for parent, _, files in os.walk(directory):
        for name in files:
            full = os.path.join(parent, name)
            rel = os.path.relpath(full, directory)
            if rel != SOURCE_FILE:
                sizes[rel] = os.path.getsize(full)
    return sizes


def check_entry(entry: str, identity: dict[str, Any]) -> None:
    """Raise ValueError saying what is wrong unless `entry` is a complete entry for
    `identity` (its record matches and every file it lists has its recorded size)."""
    try:
        with open(os.path.join(entry, SOURCE_FILE)) as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"unreadable {SOURCE_FILE}: {e}") from e
    if not isinstance(record, dict) or record.get("identity") != identity:
        raise ValueError(f"{SOURCE_FILE} describes another source")
    files = record.get("files")
    if not isinstance(files, dict) or not files:
        raise ValueError(f"{SOURCE_FILE} lists no files")
    for rel, size in files.items():
        full = os.path.join(entry, rel)
        try:
            actual = os.path.getsize(full)
        except OSError:
            raise ValueError(f"{rel} is missing") from None
        if actual != size:
            raise ValueError(f"{rel} has {actual} bytes, {size} were written")


def load_gguf_cached(path: str, dtype: Any = "float32", root: str | None = None
                     ) -> tuple[Any, dict, Any]:
    """(config, numpy params, tokenizer) of a GGUF file, as `load_gguf` + `gguf_tokenizer`
    give them (bit for bit), read from the cached checkpoint when there is a good one,
    else converted and cached."""
    from jaxpage.loading.checkpoint import load_checkpoint

    identity = source_identity(path, dtype)
    entry = entry_path(identity, root)
    if os.path.isdir(entry):
        try:
            check_entry(entry, identity)
            return load_checkpoint(entry, identity["dtype"])
        except Exception as e:  # a damaged entry of any kind is rebuilt, never fatal
            warnings.warn(f"jaxpage: ignoring the damaged cached conversion {entry} ({e}); "
                          "converting the GGUF file again", stacklevel=2)
            shutil.rmtree(entry, ignore_errors=True)
    from jaxpage.loading.gguf import gguf_tokenizer, load_gguf

    config, params = load_gguf(path, identity["dtype"])
    tokenizer = gguf_tokenizer(path)
    _write_entry(entry, identity, config, params, tokenizer)
    return config, params, tokenizer


def _write_entry(entry: str, identity: dict[str, Any], config, params, tokenizer) -> None:
    """Save the checkpoint into a temporary directory next to `entry`, then rename it into
    place; on any failure warn and leave the cache as it was."""
    from jaxpage.loading.checkpoint import save_checkpoint

    parent = os.path.dirname(entry)
    tmp = None
    try:
        os.makedirs(parent, exist_ok=True)
        _remove_abandoned_tmp_dirs(parent)
        tmp = tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{socket.gethostname()}-{os.getpid()}-",
                               dir=parent)
        logger.info("converting %s once to a jaxpage checkpoint at %s",
                    identity["gguf_path"], entry)
        save_checkpoint(tmp, config, params, tokenizer)
        record = {"identity": identity, "files": _file_sizes(tmp)}
        with open(os.path.join(tmp, SOURCE_FILE), "w") as f:
            json.dump(record, f, indent=2)
        try:
            os.rename(tmp, entry)
        except OSError:
            if not os.path.isdir(entry):  # else another process cached it first: keep theirs
                raise
        else:
            tmp = None
            _remove_stale_entries(parent, entry, identity["dtype"])
    except Exception as e:
        warnings.warn(f"jaxpage: could not cache the converted GGUF file in {parent} ({e}); "
                      "the next run converts it again", stacklevel=3)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale_entries(parent: str, keep: str, dtype: str) -> None:
    """Entries of the same file and dtype under other identities (an older mtime, another
    gguf or transformers version) are never read again."""
    for name in os.listdir(parent):
        full = os.path.join(parent, name)
        if name.startswith(f"{dtype}-") and full != keep:
            shutil.rmtree(full, ignore_errors=True)


def _remove_abandoned_tmp_dirs(parent: str) -> None:
    """Temporary directories left by killed conversions on this host (their process is
    gone); those of live processes and other hosts are left alone."""
    host = socket.gethostname()
    for name in os.listdir(parent):
        if not name.startswith(f"{_TMP_PREFIX}{host}-"):
            continue
        pid = name[len(_TMP_PREFIX) + len(host) + 1:].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True
