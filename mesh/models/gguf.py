"""GGUF -> Hugging Face folder.  `keep_gguf` (what `model pull` and `model register FILE.gguf` write): config,
tokenizer, chat template and generation config read from the file, and the file itself as model.gguf, whose
blocks the engine multiplies.  `convert_gguf`: a plain float32 folder (de-quantized by transformers + the
`gguf` package, saved as safetensors), the copy a test or bench perturbs.  `load_float32`: transformers'
float32 model of either, the reference the engine's `--dtype float32` equals.

torch and transformers are imported inside the functions, not at the top: `import mesh.models` must
stay standard-library only so the CLI starts fast; only a pull pays for them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mesh.files import write_atomic
from mesh.models.catalog import ModelError
from mesh.models.folder import validate_folder

# A ChatML template, used only if a GGUF that uses ChatML tokens carries no template of its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
# Gemma's turns (its own template, the system message folded into the first user turn as Gemma's does),
# used only if a GGUF with Gemma's turn tokens carries no template: llama.cpp's conversions of Gemma 3
# base models (gemma-3-270m) drop the one Hugging Face ships with them, and every infermesh model needs
# one (the tokenizer service refuses a folder without), even one asked for plain completions only.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\n\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else "
    "message['role']) + '\n' + (prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


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


@contextlib.contextmanager
def _alone(gguf: Path) -> Iterator[Path]:
    """The GGUF in a folder of its own: transformers' `from_pretrained(folder, gguf_file=...)` reads the
    folder's tokenizer_config.json before the file's metadata (a GGUF inside an infermesh folder then gives a
    tokenizer without eos, bos or chat template), so a file beside other files is read through a symlink in
    a temporary folder."""
    if [p for p in gguf.parent.iterdir() if p.name != gguf.name] == []:
        yield gguf
        return
    with tempfile.TemporaryDirectory(prefix="infermesh-gguf-") as alone:
        link = Path(alone) / gguf.name
        link.symlink_to(gguf.resolve())
        yield link


def convert_gguf(gguf: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Dequantize a GGUF into a plain Hugging Face folder (float32 safetensors, config, tokenizer,
    chat template, generation config) at `out_dir`. Returns facts for the marker."""
    with _alone(Path(gguf)) as gguf:
        return _convert(gguf, Path(out_dir))


def _convert(gguf: Path, out_dir: Path) -> dict[str, Any]:
    with _hub_offline():
        if importlib.util.find_spec("gguf") is None:
            raise ModelError("converting a GGUF needs the `gguf` package: pip install gguf")
        import torch
        import transformers
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        model, loader = load_gguf_model(gguf)
        _strip_quantizer(model)
        model = model.to(torch.float32)
        not_float32 = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
        if not_float32:
            raise ModelError(f"conversion left parameters in {', '.join(not_float32)}, not float32")
        model.eval()

        template_source = _settle_tokenizer(gguf, tokenizer, [model.config, model.generation_config])
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


def keep_gguf(gguf: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """A folder that keeps the GGUF's own blocks: config, generation config, tokenizer and chat template read
    from the file (no weight de-quantized), and the file itself as `model.gguf` (a hard link where the
    filesystem allows, else a copy).  The engine reads the weights from it (services/engine/runtime/models/
    gguf_weights.py); `AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf")` does too."""
    with _alone(Path(gguf)) as alone:
        return _keep(alone, Path(gguf), Path(out_dir))


def _keep(alone: Path, gguf: Path, out_dir: Path) -> dict[str, Any]:
    with _hub_offline():
        if importlib.util.find_spec("gguf") is None:
            raise ModelError("reading a GGUF needs the `gguf` package: pip install gguf")
        import transformers
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        tokenizer = AutoTokenizer.from_pretrained(str(alone.parent), gguf_file=alone.name, local_files_only=True)
        config = AutoConfig.from_pretrained(str(alone.parent), gguf_file=alone.name, local_files_only=True)
        for attr in ("quantization_config", "_pre_quantization_dtype"):
            if hasattr(config, attr):
                delattr(config, attr)
        config.dtype = "float32"                       # what the blocks compute in (activations, norms)
        causal = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if causal:
            config.architectures = [causal]
        generation = GenerationConfig.from_model_config(config)
        template_source = _settle_tokenizer(gguf, tokenizer, [config, generation])
        out_dir.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(str(out_dir))
        generation.save_pretrained(str(out_dir))
        tokenizer.save_pretrained(str(out_dir))
        target = out_dir / "model.gguf"
        try:
            os.link(gguf, target)
        except OSError:
            shutil.copyfile(gguf, target)
        _tidy_saved(out_dir)
        _check_saved(out_dir, tokenizer)
        return {
            "model_type": config.model_type,
            "dtype": "gguf",
            "weights": "model.gguf",
            "eos_token": tokenizer.eos_token,
            "chat_template": template_source,
            "loader": "gguf-blocks",
            "transformers_version": transformers.__version__,
        }


def _settle_tokenizer(gguf: Path, tokenizer: Any, configs: list[Any]) -> str:
    """A chat template (ChatML's or Gemma's where the file has none but uses their tokens) and eos, bos and
    pad ids that the configs ([model config, generation config]) agree on; returns where the template
    came from."""
    template_source = "gguf"
    if not tokenizer.chat_template:
        vocab = tokenizer.get_vocab()
        if "<|im_start|>" in vocab:
            tokenizer.chat_template, template_source = CHATML_TEMPLATE, "chatml-default"
        elif "<start_of_turn>" in vocab and "<end_of_turn>" in vocab:
            tokenizer.chat_template, template_source = GEMMA_TEMPLATE, "gemma-default"
        else:
            raise ModelError(f"{gguf.name} carries no chat template")
    if tokenizer.eos_token_id is None:
        raise ModelError(f"{gguf.name} names no eos token")
    # The GGUF's tokenizer metadata names eos (for SmolLM2-Instruct: <|im_end|>); make the model's
    # config and generation config agree with it so generation stops at the end of the turn.
    for cfg in configs:
        cfg.eos_token_id = tokenizer.eos_token_id
        if tokenizer.bos_token_id is not None:
            cfg.bos_token_id = tokenizer.bos_token_id
        cfg.pad_token_id = (tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                            else tokenizer.eos_token_id)
    # A default template ends each turn with its own token: generation stops there too (the last config,
    # the generation config's, lists both, as Gemma's own generation_config.json does).
    turn_end = {"chatml-default": "<|im_end|>", "gemma-default": "<end_of_turn>"}.get(template_source)
    turn_id = tokenizer.get_vocab().get(turn_end) if turn_end else None
    if turn_id is not None and turn_id != tokenizer.eos_token_id:
        configs[-1].eos_token_id = [tokenizer.eos_token_id, turn_id]
    max_positions = getattr(configs[0], "max_position_embeddings", None)
    if max_positions and (tokenizer.model_max_length or 0) > max_positions:
        tokenizer.model_max_length = max_positions
    return template_source


def load_gguf_model(gguf: Path) -> tuple[Any, str]:
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


def load_float32(folder: str | Path) -> Any:
    """transformers' float32 model (eval mode) of an infermesh folder: its safetensors, or its model.gguf
    de-quantized as transformers reads `gguf_file=`."""
    folder = Path(folder)
    if (folder / "model.gguf").is_file():
        with _hub_offline():
            model, _ = load_gguf_model(folder / "model.gguf")
        return model.eval()
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


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
        write_atomic(tok_file, json.dumps(tok, indent=2, ensure_ascii=False) + "\n")
    config_file = out_dir / "config.json"
    config = json.loads(config_file.read_text())
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and rope.get("rope_type") == "default" and "rope_theta" in rope \
            and "rope_theta" not in config:
        config["rope_theta"] = rope["rope_theta"]
        write_atomic(config_file, json.dumps(config, indent=2, sort_keys=True) + "\n")


def _check_saved(out_dir: Path, tokenizer: Any) -> None:
    """The saved folder must be a plain Hugging Face folder that reloads without any GGUF."""
    from transformers import AutoTokenizer

    config = json.loads((out_dir / "config.json").read_text())
    if "quantization_config" in config:
        raise ModelError("the saved config.json still has a quantization_config")
    if not list(out_dir.glob("*.safetensors")) and not (out_dir / "model.gguf").is_file():
        raise ModelError(f"no weights (safetensors or model.gguf) were written to {out_dir}")
    if not (out_dir / "generation_config.json").is_file():
        raise ModelError(f"no generation_config.json was written to {out_dir}")
    validate_folder(out_dir)
    reloaded = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    if reloaded.chat_template != tokenizer.chat_template:
        raise ModelError("the chat template did not survive saving the tokenizer")
    if reloaded.eos_token != tokenizer.eos_token:
        raise ModelError(f"eos changed from {tokenizer.eos_token!r} to {reloaded.eos_token!r} on saving")
