"""Compiling the native CPU kernels (moerun/cpu/native/*.c) into one shared library per ISA variant.

Each variant is the same sources with different flags: `generic` (portable C, no -march: also the
scalar reference), `avx2` and `avx512`. Libraries go to a cache directory keyed by a hash of the
sources, the flags and the compiler's version (`MOERUN_CPU_BUILD_DIR`, else
`~/.cache/moerun/cpu/<hash>/`), written through a temporary name so a half-built file is never
loaded. The compiler is `CC` or `cc`. `python -m moerun.cpu.build` builds every variant and prints
what it built.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from moerun.settings import settings

NATIVE = Path(__file__).resolve().parent / "native"
VARIANTS = ("generic", "avx2", "avx512")
# -ffp-contract=off: exact mode decodes weights with the same float operations as dequant.py (no
# fused multiply-add where the C says multiply, then add).
BASE_FLAGS = ("-std=c11", "-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", "-fno-math-errno")
ISA_FLAGS = {
    "generic": (),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": (
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512vnni",
        "-mavx512dq",
    ),
}


class BuildError(RuntimeError):
    """The native kernels could not be compiled; the message says why, in one line."""


@dataclass(frozen=True)
class BuildPlan:
    compiler: tuple[str, ...]
    directory: Path

    def library(self, variant: str) -> Path:
        return self.directory / f"libmoerun_cpu_{variant}.so"


def _sources() -> list[Path]:
    return sorted(NATIVE.glob("*.c")) + sorted(NATIVE.glob("*.h"))


def _compiler() -> tuple[str, ...]:
    return tuple(shlex.split(os.environ.get("CC", "") or "cc"))


def _compiler_version(compiler: tuple[str, ...]) -> str:
    try:
        done = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(
            f"the C compiler {' '.join(compiler)!r} cannot be run ({exc}); set CC to a C compiler."
        ) from None
    if done.returncode != 0:
        raise BuildError(
            f"the C compiler {' '.join(compiler)!r} failed to report its version (exit {done.returncode}); "
            "set CC to a working C compiler."
        )
    return done.stdout


def build_plan() -> BuildPlan:
    """Where the libraries of the current sources, flags and compiler live (nothing is compiled)."""
    compiler = _compiler()
    digest = hashlib.sha256()
    digest.update(_compiler_version(compiler).encode())
    digest.update(repr((compiler, BASE_FLAGS, ISA_FLAGS)).encode())
    for path in _sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    root = settings().cpu_build_dir or Path.home() / ".cache" / "moerun" / "cpu"
    return BuildPlan(compiler, Path(root) / digest.hexdigest()[:16])


def _compile(plan: BuildPlan, variant: str) -> Path:
    out = plan.library(variant)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{variant}-", suffix=".so", dir=out.parent)
    os.close(fd)
    sources = [str(p) for p in sorted(NATIVE.glob("*.c"))]
    cmd = [
        *plan.compiler,
        *BASE_FLAGS,
        *ISA_FLAGS[variant],
        f'-DMOERUN_VARIANT="{variant}"',
        *sources,
        "-o",
        tmp,
        "-lm",
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        os.unlink(tmp)
        raise BuildError(
            f"compiling the {variant} kernels with {plan.compiler[0]!r} failed ({exc})."
        ) from None
    if done.returncode != 0:
        os.unlink(tmp)
        first = next((line for line in done.stderr.splitlines() if line.strip()), f"exit {done.returncode}")
        raise BuildError(f"compiling the {variant} kernels with {plan.compiler[0]!r} failed: {first.strip()}")
    os.replace(tmp, out)
    return out


def build(variants: tuple[str, ...] = VARIANTS, *, announce: bool = False) -> dict[str, Path]:
    """Compile the variants that are not in the cache yet; returns variant -> library path.

    Raises BuildError (one line) if the compiler is missing or fails."""
    plan = build_plan()
    missing = [v for v in variants if not plan.library(v).exists()]
    if missing and announce:
        print("moerun: building the native CPU kernels (once)", file=sys.stderr, flush=True)
    with ThreadPoolExecutor(max_workers=len(variants)) as pool:
        paths = list(pool.map(lambda v: _compile(plan, v), variants))
    return dict(zip(variants, paths, strict=True))


def main() -> int:
    try:
        built = build(announce=True)
    except BuildError as exc:
        print(f"moerun: the native CPU kernels could not be built: {exc}", file=sys.stderr)
        return 1
    for variant, path in built.items():
        print(f"{variant}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
