"""Upload an export folder to the Hugging Face Hub (create_repo + upload_folder).

The token comes from the environment (HF_TOKEN, else the `hf auth login` token). Any failure
(offline, no token, network, permissions) raises PushError saying why and how to retry; the local
export is never modified, so a failed push loses nothing.
"""
from __future__ import annotations

import os
from pathlib import Path


class PushError(RuntimeError):
    """An upload that did not happen; the local export is intact."""


def push_to_hub(folder, repo_id: str, private: bool = True, token: str | None = None,
                endpoint: str | None = None) -> str:
    """Upload an export folder to the Hub (create_repo + upload_folder). Raises PushError with the
    reason and the way to retry; the local folder is never touched."""
    from huggingface_hub import HfApi, get_token

    folder = Path(folder)
    retry = (f"The export is complete at {folder}; upload it later with "
             f"`hf upload {repo_id} {folder} .` or re-run with push_to_hub={repo_id} when online.")
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        raise PushError(f"cannot push to {repo_id}: HF_HUB_OFFLINE is set (offline). {retry}")
    token = token or os.environ.get("HF_TOKEN") or get_token()
    if not token:
        raise PushError(f"cannot push to {repo_id}: no Hugging Face token (set HF_TOKEN or run "
                        f"`hf auth login`). {retry}")
    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                                 commit_message="Upload drafter exported with specdistill")
    except Exception as e:  # network, auth, permissions: all end the same way for the user
        raise PushError(f"could not push to {repo_id}: {type(e).__name__}: {e}. {retry}") from e
    return str(getattr(info, "commit_url", None) or f"https://huggingface.co/{repo_id}")
