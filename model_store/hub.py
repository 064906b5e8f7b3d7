"""Hugging Face ids, `ORG/NAME[@REVISION][:QUANT]`, to a model folder or a GGUF file.

Everything goes through huggingface_hub's own functions, so its cache layout and its
variables (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE, HF_ENDPOINT, HF_TOKEN) mean here
what they mean for every other tool. The cache is looked at first, with no network;
only what is not cached is asked of the Hub, with one request that is not retried,
so an unreachable Hub is a quick error naming the id.
"""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# As llama.cpp's `-hf`: a GGUF repository with no `:QUANT` serves this one if it has it.
DEFAULT_QUANT = "Q4_K_M"
_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)"
                 r"(?:@(?P<revision>[\w./-]+))?(?::(?P<quant>[\w.-]+))?")
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


class HubError(ValueError):
    """The id names nothing that can be served from the cache or fetched (says why)."""


@dataclass(frozen=True)
class HubId:
    repo: str
    revision: str = "main"
    quant: str | None = None    # a GGUF file's quantization name, as in `:Q4_K_M`


def parse_hub_id(text: str) -> HubId | None:
    """`ORG/NAME[@REVISION][:QUANT]` as a HubId; None if `text` is not of that form."""
    match = _ID.fullmatch(text)
    if match is None or "--" in match["repo"] or ".." in match["repo"]:
        return None
    return HubId(match["repo"], match["revision"] or "main", match["quant"])


def is_split_gguf(name: str) -> bool:
    return _SPLIT.search(name) is not None


def gguf_files(names) -> list[str]:
    """The GGUF model files among `names` (vision projectors, `mmproj-*`, left out)."""
    return sorted(n for n in names if n.lower().endswith(".gguf")
                  and not Path(n).name.lower().startswith("mmproj"))


def quant_matches(names: list[str], quant: str) -> list[str]:
    """The names holding `quant` as a whole quantization name, case-insensitively:
    `Q4_K` matches `x.Q4_K.gguf`, not `x-Q4_K_M.gguf`; `Q4_XS` not `x-IQ4_XS.gguf`."""
    pattern = re.compile(rf"(?<![a-z0-9]){re.escape(quant.lower())}(?![a-z0-9]|_[a-z0-9])")
    return [n for n in names if pattern.search(Path(n).name.lower())]


def pick_gguf(names: list[str], quant: str | None, what: str) -> str:
    """The one GGUF file of `names` to serve for `quant` (None: DEFAULT_QUANT if there,
    else the only file). Raises HubError naming `what` and the files to choose from."""
    files = gguf_files(names)
    found = quant_matches(files, quant or DEFAULT_QUANT)
    if quant is None and not found and len(files) == 1:
        found = files
    whole = [n for n in found if not is_split_gguf(n)]
    if len(whole) == 1:
        return whole[0]
    if found and not whole:
        raise HubError(f"{what}: {found[0]} is split into several files, which mlxd does "
                       "not serve; merge them into one (llama.cpp's gguf-split --merge)")
    if whole:
        raise HubError(f"{what}: several GGUF files match {quant or DEFAULT_QUANT!r}: "
                       f"{', '.join(whole)}")
    if not files:
        raise HubError(f"{what} holds no GGUF file")
    if quant is None:
        raise HubError(f"{what} holds several GGUF files and none is {DEFAULT_QUANT}; "
                       f"name one with :QUANT ({', '.join(files)})")
    raise HubError(f"{what} has no GGUF file for {quant!r} (its GGUF files: "
                   f"{', '.join(files)})")


def is_model_folder(names) -> bool:
    """A folder mlx_lm loads: config.json and safetensors weights."""
    names = set(names)
    return "config.json" in names and any(n.endswith(".safetensors") for n in names)


def resolve_hub(text: str, cache_dir: str | None = None,
                log: Callable[[str], None] = lambda message: None) -> Path:
    """The snapshot folder (safetensors models) or GGUF file that `text`, a hub id,
    names: from the cache when it is there, else downloaded into it. Raises HubError."""
    hub = parse_hub_id(text)
    if hub is None:
        raise HubError(f"{text!r} is not a Hugging Face id (ORG/NAME[@REVISION][:QUANT])")
    cached = _cached_snapshot(hub, cache_dir)
    if cached is not None:
        found = _from_snapshot(hub, text, *cached)
        if found is not None:
            return found
    return _download(hub, text, cache_dir, log)


def _mlx_lm_patterns() -> list[str]:
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS   # the files mlx_lm.load reads

    return list(DEFAULT_ALLOW_PATTERNS)


def _cached_snapshot(hub: HubId, cache_dir: str | None) -> tuple[Path, bool] | None:
    """(the cached snapshot folder of the id's revision, whether it holds every file
    mlx_lm loads that the cached listing names), or None if the revision is not cached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(hub.repo, revision=hub.revision, cache_dir=cache_dir,
                                      allow_patterns=_mlx_lm_patterns(),
                                      local_files_only=True)), True
    except IncompleteSnapshotError as exc:   # some files missing: a GGUF may still be there
        return (Path(exc.snapshot_path), False) if exc.snapshot_path else None
    except LocalEntryNotFoundError:
        return None


def _from_snapshot(hub: HubId, text: str, folder: Path, complete: bool) -> Path | None:
    """What a cached snapshot serves for the id; None if it must be downloaded."""
    names = [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()]
    ggufs = gguf_files(names)
    if hub.quant is not None:
        if not quant_matches(ggufs, hub.quant):
            return None   # maybe the repository has it
        return folder / pick_gguf(ggufs, hub.quant, text)
    if is_model_folder(names):
        return folder if complete else None
    if quant_matches(ggufs, DEFAULT_QUANT) or len(ggufs) == 1:
        return folder / pick_gguf(ggufs, None, text)
    return None   # no GGUF file, or several but not the default: the Hub's list decides


def _download(hub: HubId, text: str, cache_dir: str | None, log) -> Path:
    """Fetch what the id serves into the cache (huggingface_hub's progress bars)."""
    from huggingface_hub import hf_hub_download, snapshot_download

    names = _repo_files(hub, text, cache_dir)
    gguf = hub.quant is not None or (not is_model_folder(names) and gguf_files(names))
    if not gguf and not is_model_folder(names):
        raise HubError(f"{text} holds neither a model (config.json and .safetensors "
                       "weights) nor GGUF files")
    name = pick_gguf(names, hub.quant, text) if gguf else None
    log(f"downloading {name + ' from ' if name else ''}{hub.repo} into the Hugging Face cache")
    try:
        if name is not None:
            return Path(hf_hub_download(hub.repo, name, revision=hub.revision,
                                        cache_dir=cache_dir))
        return Path(snapshot_download(hub.repo, revision=hub.revision, cache_dir=cache_dir,
                                      allow_patterns=_mlx_lm_patterns()))
    except Exception as exc:   # the Hub's answers and the transport's, mid-download
        raise HubError(f"{text}: the download failed: {type(exc).__name__}: {exc}") from None


def _repo_files(hub: HubId, text: str, cache_dir: str | None) -> list[str]:
    """The repository's file names at the revision: one request, not retried."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import (GatedRepoError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    where = cache_dir or constants.HF_HUB_CACHE
    if constants.is_offline_mode():
        raise HubError(f"{text} is not in the Hugging Face cache ({where}) and HF_HUB_OFFLINE "
                       "is set, so it is not downloaded")
    try:
        info = HfApi().model_info(hub.repo, revision=hub.revision,
                                  timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except GatedRepoError:
        raise HubError(f"{text} is gated on the Hugging Face Hub: accept its terms on the "
                       "Hub, then set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise HubError(f"{hub.repo} has no revision {hub.revision!r} on the Hub") from None
    except RepositoryNotFoundError:
        raise HubError(f"{text} is not in the Hugging Face cache ({where}), and the Hub "
                       "has no such model (or it is private: set HF_TOKEN)") from None
    except Exception as exc:   # the transport's errors: httpx's or requests', by version
        raise HubError(f"{text} is not in the Hugging Face cache ({where}), and the Hub "
                       f"({constants.ENDPOINT}) could not be reached: "
                       f"{type(exc).__name__}: {exc}") from None
    return [s.rfilename for s in info.siblings or []]


# --- what is in the cache (`mlxd models`) ---

def snapshot_format(files: list[Path]) -> str:
    """mlx, safetensors or gguf: what a snapshot's (or a folder's) files hold."""
    names = [f.name for f in files]
    if is_model_folder(names):
        weights = [f for f in files if f.name.endswith(".safetensors")]
        return "mlx" if _saved_by_mlx(weights[0]) else "safetensors"
    return "gguf" if gguf_files(names) else "other"


def _saved_by_mlx(path: Path) -> bool:
    """Whether a safetensors file's header says MLX wrote it ({"format": "mlx"})."""
    import json
    import struct

    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(min(length, 1 << 24)))
    except (OSError, ValueError, struct.error):
        return False
    return (header.get("__metadata__") or {}).get("format") == "mlx"


def cached_models(cache_dir: str | None = None) -> list[tuple[str, str, int]]:
    """(id, format, bytes on disk) of each model repository in the Hugging Face cache,
    its format that of its newest cached revision."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        repos = scan_cache_dir(cache_dir).repos
    except CacheNotFound:
        return []
    rows = []
    for repo in sorted(repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        newest = max(repo.revisions, key=lambda r: r.last_modified)
        files = [f.file_path for f in newest.files]
        rows.append((repo.repo_id, snapshot_format(files), repo.size_on_disk))
    return rows
