"""Builds tempokern's compiled module with the CUDA kernels running on the CPU emulator.

The shipped csrc/**/*.cu files are copied with two mechanical rewrites that plain C++ cannot parse
(`k<<<grid, block, smem, stream>>>(args)` and `extern __shared__ T name[];`) and compiled by g++
against the shim headers in include/; everything else (bindings, CPU kernels) is compiled as is.
The result is a `_C` module with the same functions as the real one, for `load()` to return.

    python tools/cuda_emu/build.py [--out DIR] [--asan]

Output goes to build/cuda_emu/<hash of the sources and flags>[-asan]/, so an unchanged tree is not rebuilt; objects
are cached in build/cuda_emu_obj/ by the hash of their source, every header and the flags, so a change to one .cu
or .cpp file recompiles that file only (a header change recompiles everything).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CSRC = ROOT / "csrc"

# a launch is a statement of its own line: `kernel<T, U><<<cfg>>>(args);` (a trailing `\\` allowed in macros)
_LAUNCH = re.compile(r"^(?P<indent>\s*)(?P<kernel>[A-Za-z_][\w:]*(?:<[^;<>]*(?:<[^;<>]*>[^;<>]*)*>)?)"
                     r"<<<(?P<cfg>.*?)>>>\((?P<args>.*)\);(?P<tail>\s*\\?\s*)$")
_EXTERN_SHARED = re.compile(
    r"extern\s+__shared__\s+(?:__align__\(\s*\d+\s*\)\s+)?(?P<type>[\w:\s]+?)\s+(?P<name>\w+)\s*\[\s*\]\s*;")


def rewrite_cu(text: str, origin: str) -> str:
    """The two rewrites; raises if a launch is written in a form this does not understand."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if "<<<" in line:
            m = _LAUNCH.match(line)
            if not m:
                raise SystemExit(f"{origin}:{n}: cannot rewrite this kernel launch for the emulator: {line.strip()}")
            kernel = m["kernel"].strip()
            name = kernel.replace('"', "'")
            args = m["args"].strip()
            line = (f'{m["indent"]}::emu::Launch({m["cfg"]}).run("{name}", {kernel}'
                    f'{", " + args if args else ""});{m["tail"]}')
        line = _EXTERN_SHARED.sub(
            lambda s: f'{s["type"]}* const {s["name"]} = reinterpret_cast<{s["type"]}*>(::emu::dyn_smem());', line)
        out.append(line)
    return "\n".join(out) + "\n"


def _pybind11_include() -> str:
    try:
        import pybind11
    except ImportError as e:  # the test extra installs it
        raise SystemExit("the CUDA emulator build needs pybind11 (pip install pybind11)") from e
    return pybind11.get_include()


def sources() -> tuple[list[Path], list[Path]]:
    cpp = sorted(CSRC.rglob("*.cpp"))
    cu = sorted(CSRC.rglob("*.cu")) + [HERE / "selftest.cu"]
    return cpp, cu


def flags(asan: bool) -> list[str]:
    f = ["-std=c++17", "-fPIC", "-fopenmp", "-g", "-O2", "-fvisibility=hidden", "-Wno-attributes",
         "-DTK_WITH_CUDA=1", '-DTK_CUDA_ARCHS="emulator"', f"-I{CSRC}",
         f"-I{_pybind11_include()}", f"-I{sysconfig.get_paths()['include']}"]
    if asan:
        f += ["-fsanitize=address", "-fno-omit-frame-pointer"]
    return f


def tree_hash(asan: bool) -> str:
    h = hashlib.sha256()
    cpp, cu = sources()
    files = cpp + cu + sorted(CSRC.rglob("*.h")) + sorted(CSRC.rglob("*.cuh")) + sorted(HERE.rglob("*.h")) + [
        *sorted(HERE.glob("*.cpp")), Path(__file__)]
    for p in files:
        h.update(str(p.relative_to(ROOT)).encode())
        h.update(p.read_bytes())
    h.update(" ".join(flags(asan)).encode())
    h.update(sys.version.encode())
    return h.hexdigest()[:16]


def module_path(out: Path) -> Path:
    return out / ("_C" + importlib.machinery.EXTENSION_SUFFIXES[0])


OBJ_CACHE = ROOT / "build" / "cuda_emu_obj"  # objects by hash of (source, every header, flags), shared by builds


def _headers_hash() -> bytes:
    h = hashlib.sha256()
    for p in sorted(CSRC.rglob("*.h")) + sorted(CSRC.rglob("*.cuh")) + sorted(HERE.rglob("*.h")):
        h.update(str(p.relative_to(ROOT)).encode())
        h.update(p.read_bytes())
    return h.digest()


def build(out: Path | None = None, asan: bool = False, jobs: int | None = None, quiet: bool = False,
          patches: dict | None = None) -> Path:
    """Builds (if needed) and returns the path of the emulated `_C` module. patches: {path relative to the repository
    root: text} of .cu files to compile in place of theirs (a separate module under build/cuda_emu_patched/, for
    tests that check what the emulator reports about a modified kernel); the other files' objects come from the
    object cache."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise SystemExit(f"the CUDA emulator build needs a C++ compiler ({cxx} not found)")
    patches = {str(k): v for k, v in (patches or {}).items()}
    if patches and out is None:
        ph = hashlib.sha256((tree_hash(asan) + repr(sorted(patches.items()))).encode()).hexdigest()[:16]
        out = ROOT / "build" / "cuda_emu_patched" / (ph + ("-asan" if asan else ""))
    out = out or ROOT / "build" / "cuda_emu" / (tree_hash(asan) + ("-asan" if asan else ""))
    target = module_path(out)
    if target.exists():
        return target
    # several processes (pytest-xdist workers) may ask for the same build at once: one builds, the others wait
    # on the lock and then find the module
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / (out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if target.exists():
                return target
            return _build_unlocked(out, target, asan, jobs, quiet, patches, cxx)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build_unlocked(out: Path, target: Path, asan: bool, jobs, quiet: bool, patches: dict, cxx: str) -> Path:
    gen = out / "gen"
    obj = out / "obj"
    gen.mkdir(parents=True, exist_ok=True)
    obj.mkdir(parents=True, exist_ok=True)
    cpp, cu = sources()
    shim = f"-I{HERE / 'include'}"  # module.cpp and the bindings include <cuda_runtime.h> under TK_WITH_CUDA
    jobs_list = []
    for p in cpp:
        jobs_list.append((p, obj / (str(p.relative_to(CSRC)).replace("/", "__") + ".o"), [shim]))

    def emit(p: Path, g: Path) -> None:  # the rewritten (or patched) copy of p at g
        rel = str(p.relative_to(ROOT))
        g.parent.mkdir(parents=True, exist_ok=True)
        g.write_text(rewrite_cu(patches.pop(rel) if rel in patches else p.read_text(), rel))

    # CUDA headers (kernels and launch templates shared by several .cu files) get the same rewrites, under
    # gen/include/ with their csrc-relative paths; -iquote puts them before csrc/ for quoted includes
    gen_inc = gen / "include"
    for p in sorted(CSRC.rglob("*.cuh")):
        emit(p, gen_inc / p.relative_to(CSRC))
    for p in cu:
        g = gen / (str(p.relative_to(ROOT)).replace("/", "__") + ".cpp")
        emit(p, g)
        # the rewritten file is compiled as if it sat beside the original, so its quoted includes resolve
        jobs_list.append((g, obj / (g.name + ".o"), [f"-iquote{gen_inc}", f"-I{p.parent}", shim,
                                                     "-include", "emu_core.h"]))
    if patches:
        raise SystemExit(f"patches name files that are not CUDA sources of the tree: {sorted(patches)}")
    fl = flags(asan)
    for extra in ("emu_runtime.cpp", "emu_bind.cpp"):
        jobs_list.append((HERE / extra, obj / (extra + ".o"), [shim]))
    heads = _headers_hash()
    for g in sorted(gen_inc.rglob("*.cuh")):  # the rewritten (maybe patched) headers, by content, not by path
        heads += hashlib.sha256(str(g.relative_to(gen_inc)).encode() + g.read_bytes()).digest()
    OBJ_CACHE.mkdir(parents=True, exist_ok=True)

    def compile_one(job):
        src, o, inc = job
        cmd = [cxx, *fl, *inc, "-c", str(src), "-o", str(o)]
        stable = [a.replace(str(gen_inc), "<gen-include>") for a in inc]  # the build directory's path is not content
        key = hashlib.sha256(heads + src.read_bytes() + " ".join([cxx, src.name, *fl, *stable]).encode()).hexdigest()[:24]
        cached = OBJ_CACHE / (key + ".o")
        if cached.exists():
            shutil.copyfile(cached, o)
            os.utime(cached)
            return o
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"compiling {src} for the CUDA emulator failed:\n{r.stderr[-6000:]}")
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(o, tmp)
        os.replace(tmp, cached)
        return o

    n = jobs or max(1, min(len(jobs_list), os.cpu_count() or 1))
    with cf.ThreadPoolExecutor(n) as ex:
        objs = list(ex.map(compile_one, jobs_list))
    tmp = target.with_suffix(".tmp")
    link = [cxx, "-shared", "-fopenmp", *(["-fsanitize=address"] if asan else []), *map(str, objs), "-o", str(tmp)]
    r = subprocess.run(link, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"linking the CUDA emulator module failed:\n{r.stderr[-6000:]}")
    os.replace(tmp, target)  # atomic: a half-built module is never picked up
    if out.parent == ROOT / "build" / "cuda_emu":  # drop builds of older trees (of the same kind)
        for old in out.parent.iterdir():
            if old != out and old.is_dir() and old.name.endswith("-asan") == asan:
                shutil.rmtree(old, ignore_errors=True)
            elif old.suffix == ".lock" and old.stem != out.name and old.stem.endswith("-asan") == asan:
                old.unlink(missing_ok=True)
        for old in OBJ_CACHE.glob("*.o"):  # and cached objects no build has used for a day, and patched modules
            if time.time() - old.stat().st_mtime > 86400:
                old.unlink(missing_ok=True)
        for old in (ROOT / "build" / "cuda_emu_patched").glob("*"):
            if time.time() - old.stat().st_mtime > 86400:
                shutil.rmtree(old, ignore_errors=True)
    if not quiet:
        print(f"built {target}")
    return target


def load(path: Path | None = None):
    """Imports the emulated `_C` (built if needed) without touching sys.modules['tempokern._C'].
    TEMPOKERN_EMU_ASAN=1 loads the AddressSanitizer build (the process must run with LD_PRELOAD=libasan)."""
    path = Path(path) if path else build(asan=os.environ.get("TEMPOKERN_EMU_ASAN") == "1", quiet=True)
    # a package name per build directory: CPython reuses an extension already loaded under the same name, so a
    # patched module (build(patches=...)) loaded beside the default one needs its own
    spec = importlib.util.spec_from_file_location(f"tempokern_cuda_emu_{path.parent.name.replace('-', '_')}._C", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--asan", action="store_true", help="AddressSanitizer build (run with LD_PRELOAD=libasan)")
    ap.add_argument("--jobs", type=int, default=None)
    a = ap.parse_args()
    print(build(a.out, a.asan, a.jobs))


if __name__ == "__main__":
    main()
