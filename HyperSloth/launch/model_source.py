"""Where a model (or tokenizer) comes from, checked before any worker starts: a local folder or the Hub.

Without this, a Hub id that cannot be reached costs ~50 s of library retries in the launcher and
then a ~270-line traceback from every worker. Here it costs one short request (or a cache look-up
when HF_HUB_OFFLINE=1) and one line.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# "org/name" as on the Hugging Face Hub; anything else with a path separator is a local folder.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
HUB_TIMEOUT_S = 8.0


def looks_like_local_path(model_name: str) -> bool:
    """True when `model_name` names a local folder rather than a Hub id.

    Absolute, ./ ../ ~/ paths and paths with a separator that are not "org/name" are local; an
    "org/name" whose `org` is an existing local folder (e.g. build/tiny-qwen3) is local too.
    """
    if os.path.isabs(model_name) or model_name.startswith(("./", "../", "~", f".{os.sep}", f"..{os.sep}")):
        return True
    if _HUB_ID.match(model_name):
        return Path(model_name.split("/")[0]).is_dir()
    return os.sep in model_name or "/" in model_name


def _cached(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json")
    found = found or try_to_load_from_cache(repo_id, "tokenizer_config.json")
    return isinstance(found, str)


def _local_hint(name: str) -> str:
    """For an "org/name" that is no folder here: it may be a relative path meant from another folder."""
    if not _HUB_ID.match(name):
        return ""
    return (f"; or, if '{name}' is a local folder: {Path(name).expanduser().resolve()} does not exist (a relative "
            "path counts from the folder you run in: run from the folder that holds it, or give an absolute path)")


def hub_problem(name: str, what: str = "model", *, timeout_s: float = HUB_TIMEOUT_S) -> str | None:
    """None when `name` is a local folder, a cached Hub repo in offline mode, or a Hub repo that answers
    within `timeout_s`; otherwise one line saying what is wrong and what to change."""
    if looks_like_local_path(name):
        if Path(name).expanduser().exists():
            return None
        return (f"{what} '{name}' looks like a local folder but {Path(name).expanduser()} does not exist: "
                "fix the path, or use a Hub id such as 'unsloth/Qwen3-0.6B'")
    if Path(name).is_dir():  # a bare folder name in the working directory
        return None
    from huggingface_hub import constants, model_info
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if constants.HF_HUB_OFFLINE:
        return None if _cached(name) else (
            f"{what} '{name}' is not in the local Hugging Face cache and HF_HUB_OFFLINE=1: download it "
            f"first (`hf download {name}` with network), or set {what} to a local folder{_local_hint(name)}")
    try:
        model_info(name, timeout=timeout_s)
    except GatedRepoError:
        return (f"{what} '{name}' is gated on the Hugging Face Hub: accept its licence on huggingface.co "
                "and log in (`hf auth login`), or use a local copy")
    except RepositoryNotFoundError:
        return (f"{what} '{name}' is not on the Hugging Face Hub (or is private): check the spelling, "
                f"log in for a private repo, or use a local folder{_local_hint(name)}")
    except Exception as err:  # noqa: BLE001 - network errors come in many types; all mean "not reachable"
        if _cached(name):
            return None  # transformers will use the cached copy
        return (f"cannot reach the Hugging Face Hub at {constants.ENDPOINT} for {what} '{name}' "
                f"({type(err).__name__}) and it is not cached: check the network or HF_ENDPOINT, "
                f"download it first (`hf download {name}`), or set {what} to a local folder{_local_hint(name)}")
    return None
