"""Runtime compiler for the CUDA kernels: NVRTC through ``cuda.core``, cached on disk.

Kernel sources are ``.cu`` files shipped beside this module (package data, read with
``importlib.resources``). A source may include local headers with ``#include "name.cuh"``; they
are inlined here, so the cache key covers every byte NVRTC sees from this package. System headers
(``<cuda_bf16.h>`` and friends) come from the ``nvidia-cuda-runtime`` wheel, whose version is part
of the key as well.

Compilation targets the compute capability of the device in hand (``sm_90``, ``sm_100``,
``sm_120``, ... from one source); :func:`compile_cubin` compiles for an explicit architecture and
needs no GPU (CI uses it). Results are cached:

* in-process, per (source, options, architecture, device) by :func:`get_kernel`;
* on disk, as raw cubin files named by the SHA-256 cache key (:func:`cache_key`), in
  ``DDTREE_CACHE_DIR`` or else ``$XDG_CACHE_HOME/ddtree/kernels`` (``~/.cache/ddtree/kernels``).
  Writes are atomic (temporary file, then ``os.replace``); concurrent processes serialise a miss
  with an ``fcntl`` lock per key and re-check the cache after taking it; a corrupt entry is logged
  and rebuilt. With ``DDTREE_DISABLE_JIT=1`` a miss raises :class:`CompileError` instead of
  compiling, which is how pre-built caches are verified.

Nothing compiles or touches CUDA at import time. Launches go to torch's current stream.

Environment variables (read at call time, so a process may set them before its first op):

``DDTREE_CACHE_DIR``
    Directory of the disk cache.
``DDTREE_DISABLE_JIT``
    ``1`` turns a cache miss into an error.
``DDTREE_DEPENDENT_LAUNCH``
    ``0`` launches every kernel plainly, none by programmatic dependent launch
    (:attr:`LaunchParams.dependent`).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.resources
import logging
import os
import re
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "SCHEMA_VERSION",
    "SUPPORTED_ARCHS",
    "CompileError",
    "CudaError",
    "KernelCache",
    "LaunchParams",
    "cache_dir",
    "cache_key",
    "compile_cubin",
    "device_arch",
    "get_kernel",
    "is_available",
    "kernel_sources",
    "launch",
    "load_source",
    "require_available",
    "set_max_dynamic_smem",
]

_log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
"""Bumped whenever the layout of a cache entry or the key derivation changes."""

SUPPORTED_ARCHS = ("sm_90", "sm_100", "sm_120")
"""Architectures every kernel source must compile for (checked in CI)."""

_BASE_OPTIONS = ("--std=c++17", "-default-device")
"""NVRTC options every kernel gets; part of the cache key through :func:`_canonical_options`."""

_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.MULTILINE)
_CUBIN_MAGIC = b"\x7fELF"
_INSTALL_HINT = "pip install 'ddtree[cuda]' (cuda-core, cuda-bindings, nvidia-cuda-nvrtc)"


class CompileError(RuntimeError):
    """NVRTC rejected a kernel source, or a cache miss happened with ``DDTREE_DISABLE_JIT=1``.

    Attributes
    ----------
    log : str
        The full NVRTC log (empty when nothing was compiled).
    cache_key : str
        The SHA-256 cache key of the compilation.
    """

    def __init__(self, message: str, *, log: str, cache_key: str) -> None:
        super().__init__(f"{message}\ncache key: {cache_key}\n{log}".rstrip())
        self.log = log
        self.cache_key = cache_key


class CudaError(RuntimeError):
    """A CUDA driver call failed (module load, attribute, launch).

    Attributes
    ----------
    result_name : str
        The ``CUresult`` name, e.g. ``"CUDA_ERROR_INVALID_VALUE"``, or ``"UNKNOWN"``.
    """

    def __init__(self, message: str, *, result_name: str) -> None:
        super().__init__(f"{message} ({result_name})")
        self.result_name = result_name


@dataclass(frozen=True)
class LaunchParams:
    """Grid, block and dynamic shared memory of one kernel launch.

    Each op computes these in a pure function (no GPU needed), so they can be unit-tested.
    """

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem_bytes: int = 0
    dependent: bool = False
    """Programmatic dependent launch: the kernel may get its blocks resident while the previous
    kernel of the stream still runs, and every thread waits for that kernel in the kernel
    (``ddtree_wait_for_previous_grid`` in common.cuh) before touching global memory. Off
    everywhere with ``DDTREE_DEPENDENT_LAUNCH=0``."""

    def __post_init__(self) -> None:
        if any(g < 1 for g in self.grid) or any(b < 1 for b in self.block):
            raise ValueError(f"launch params: grid {self.grid} and block {self.block} must be >= 1")
        if self.block[0] * self.block[1] * self.block[2] > 1024:
            raise ValueError(f"launch params: block {self.block} has more than 1024 threads")
        if self.grid[1] > 65535 or self.grid[2] > 65535:
            raise ValueError(f"launch params: grid {self.grid} exceeds 65535 in y or z")
        if self.shared_mem_bytes < 0:
            raise ValueError(f"launch params: shared_mem_bytes {self.shared_mem_bytes} < 0")


# --------------------------------------------------------------------------- availability


@functools.cache
def _availability_problem() -> str | None:
    """Why the runtime compiler cannot be used here, or ``None`` when it can (NVRTC loads)."""
    try:
        import cuda.core  # noqa: F401
        from cuda.bindings import nvrtc
    except ImportError as err:
        return f"cuda-python is not installed ({err})"
    try:
        result, _, _ = nvrtc.nvrtcVersion()
    except Exception as err:  # the library loader raises several types when libnvrtc is absent
        return f"NVRTC cannot be loaded ({type(err).__name__}: {err})"
    if int(result) != 0:
        return f"NVRTC cannot be loaded (nvrtcVersion returned {result})"
    return None


def is_available() -> bool:
    """Whether the runtime compiler (cuda-python with NVRTC) is importable and loads.

    Returns
    -------
    bool
        ``True`` when kernels can be compiled here; no GPU is needed for that.
    """
    return _availability_problem() is None


def require_available() -> None:
    """Raise unless the runtime compiler is usable.

    Raises
    ------
    RuntimeError
        cuda-python or NVRTC is missing; the message says what to install.
    """
    problem = _availability_problem()
    if problem is not None:
        raise RuntimeError(
            f"the ddtree CUDA kernels need NVRTC: {problem}; install {_INSTALL_HINT}"
        )


# --------------------------------------------------------------------------- sources


def kernel_sources() -> list[str]:
    """Names of every ``.cu`` kernel source shipped in ``ddtree.kernels``, sorted."""
    root = importlib.resources.files("ddtree.kernels")
    return sorted(p.name for p in root.iterdir() if p.name.endswith(".cu"))


def _read_resource(name: str) -> str:
    path = importlib.resources.files("ddtree.kernels").joinpath(name)
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {name!r} is not in the ddtree.kernels package")
    return path.read_text(encoding="utf-8")


@functools.cache
def load_source(name: str) -> str:
    """Return kernel source ``name`` with its local ``#include "..."`` headers inlined.

    Each header is inlined once (``#pragma once`` semantics), with ``#line`` markers so NVRTC's
    messages name the original file and line. Angle-bracket includes are left to NVRTC.

    Parameters
    ----------
    name : str
        File name of a ``.cu`` source in the ``ddtree.kernels`` package.

    Returns
    -------
    str
        The expanded source.

    Raises
    ------
    FileNotFoundError
        The source or one of its local headers is missing from the package.
    """
    seen: set[str] = set()

    def expand(file: str) -> str:
        seen.add(file)
        text = _read_resource(file)
        out: list[str] = [f'#line 1 "{file}"\n']
        pos = 0
        for match in _INCLUDE_RE.finditer(text):
            out.append(text[pos : match.start()])
            header = match.group(1)
            if header not in seen:
                out.append(expand(header))
            line = text.count("\n", 0, match.end()) + 2
            out.append(f'#line {line} "{file}"')
            pos = match.end()
        out.append(text[pos:])
        return "".join(out)

    return expand(name)


# --------------------------------------------------------------------------- keys and options


def _canonical_options(defines: Mapping[str, int | str]) -> tuple[str, ...]:
    """Sorted NVRTC options for ``defines`` plus the fixed base options."""
    for key in defines:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"defines: {key!r} is not a C identifier")
    macros = [f"-D{k}={v}" for k, v in defines.items()]
    return tuple(sorted([*_BASE_OPTIONS, *macros]))


@functools.cache
def _nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}"


@functools.cache
def _runtime_headers_version() -> str:
    for dist in ("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime-cu13"):
        try:
            return f"{dist}=={importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "none"


@functools.cache
def _driver_version() -> str:
    """The CUDA driver version, or ``"none"`` where no driver is loaded (CPU-only machines)."""
    if not torch.cuda.is_available():
        return "none"
    from cuda.bindings import driver

    err, version = driver.cuDriverGetVersion()
    return str(version) if int(err) == 0 else "none"


def cache_key(
    source: str,
    options: Sequence[str],
    arch: str,
    *,
    nvrtc_version: str,
    driver_version: str,
    headers_version: str = "",
) -> str:
    """SHA-256 hex digest identifying one compilation.

    Parameters
    ----------
    source : str
        The expanded source (local headers inlined, see :func:`load_source`).
    options : sequence of str
        NVRTC options; their order does not matter.
    arch : str
        Target architecture, e.g. ``"sm_90"``.
    nvrtc_version, driver_version, headers_version : str
        Compiler, driver (``"none"`` without a GPU) and system-header versions.

    Returns
    -------
    str
        64 lowercase hex digits.
    """
    digest = hashlib.sha256()
    for part in (
        f"schema={SCHEMA_VERSION}",
        f"arch={arch}",
        f"nvrtc={nvrtc_version}",
        f"driver={driver_version}",
        f"headers={headers_version}",
        *(f"opt={o}" for o in sorted(options)),
    ):
        digest.update(part.encode())
        digest.update(b"\0")
    digest.update(source.encode("utf-8"))
    return digest.hexdigest()


# --------------------------------------------------------------------------- disk cache


def cache_dir() -> Path:
    """Directory of the disk cache: ``DDTREE_CACHE_DIR``, else the user cache directory."""
    explicit = os.environ.get("DDTREE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ddtree" / "kernels"


def _jit_disabled() -> bool:
    return os.environ.get("DDTREE_DISABLE_JIT", "").strip() not in ("", "0")


class KernelCache:
    """Directory of raw cubin files named ``<cache key>.cubin``, safe under concurrent processes.

    Parameters
    ----------
    directory : pathlib.Path
        Created on first write.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.cubin"

    def get(self, key: str) -> bytes | None:
        """Return the cubin stored under ``key``, or ``None`` when absent or corrupt.

        A corrupt entry (not an ELF image) is logged, removed and reported as a miss.
        """
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if not data.startswith(_CUBIN_MAGIC):
            _log.warning("ddtree kernel cache: corrupt entry %s removed; rebuilding", path)
            self.discard(key)
            return None
        return data

    def put(self, key: str, cubin: bytes) -> None:
        """Store ``cubin`` under ``key`` atomically (temporary file in the same directory)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(cubin)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path(key))
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def discard(self, key: str) -> None:
        """Remove the entry under ``key`` if present."""
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[None]:
        """Hold an exclusive inter-process lock for ``key`` (``fcntl.flock`` on a lock file)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / f".{key}.lock", "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


# --------------------------------------------------------------------------- compilation


@functools.cache
def _include_dirs() -> tuple[str, ...]:
    """Include directories holding the CUDA runtime headers (``cuda_bf16.h`` etc.)."""
    found: list[str] = []
    try:
        import cuda.pathfinder as pathfinder

        located = pathfinder.find_nvidia_header_directory("cudart")
        if located:
            found.append(str(located))
    except (ImportError, AttributeError, RuntimeError):
        pass
    if not found:
        for root in ("CUDA_PATH", "CUDA_HOME"):
            value = os.environ.get(root)
            if value and os.path.isfile(os.path.join(value, "include", "cuda_runtime.h")):
                found.append(os.path.join(value, "include"))
    return tuple(found)


def _compile(source: str, options: tuple[str, ...], arch: str, name: str, key: str) -> bytes:
    from cuda.core import Program, ProgramOptions

    defines = [o[2:] for o in options if o.startswith("-D")]
    macro_pairs: list[str | tuple[str, str]] = [
        (d.split("=", 1)[0], d.split("=", 1)[1]) if "=" in d else d for d in defines
    ]
    program_options = ProgramOptions(
        name=name,
        arch=arch,
        std="c++17",
        include_path=list(_include_dirs()) or None,
        define_macro=macro_pairs or None,
        device_as_default_execution_space=True,
    )
    try:
        program = Program(source, "c++", options=program_options)
        try:
            cubin = program.compile("cubin").code
        finally:
            program.close()
    except Exception as err:  # cuda.core raises its nvrtcError wrapper with the log inside
        raise CompileError(
            f"NVRTC failed to compile {name} for {arch}", log=str(err), cache_key=key
        ) from err
    if not isinstance(cubin, bytes) or not cubin.startswith(_CUBIN_MAGIC):
        raise CompileError(f"NVRTC returned no cubin for {name}", log="", cache_key=key)
    return cubin


def compile_cubin(
    name: str,
    arch: str,
    defines: Mapping[str, int | str] | None = None,
    *,
    cache: KernelCache | None = None,
    driver_version: str | None = None,
) -> tuple[bytes, str]:
    """Compile kernel source ``name`` for ``arch``, through the disk cache; no GPU needed.

    Parameters
    ----------
    name : str
        A ``.cu`` file of the ``ddtree.kernels`` package, e.g. ``"build_tree.cu"``.
    arch : str
        Target architecture, ``"sm_<major><minor>"`` (``"sm_90"``, ``"sm_90a"``, ``"sm_120"``).
    defines : mapping of str to int or str, optional
        Preprocessor macros (``-DNAME=value``) selecting a variant.
    cache : KernelCache, optional
        Disk cache; defaults to :func:`cache_dir`.
    driver_version : str, optional
        Driver version for the key; defaults to the loaded driver's (``"none"`` without a GPU).

    Returns
    -------
    tuple of (bytes, str)
        The cubin and its cache key.

    Raises
    ------
    RuntimeError
        The runtime compiler is unavailable (see :func:`require_available`).
    CompileError
        NVRTC rejected the source (full log attached), or ``DDTREE_DISABLE_JIT=1`` and the entry
        is not cached.
    """
    require_available()
    if not re.fullmatch(r"sm_\d+[af]?", arch):
        raise ValueError(f"arch: expected 'sm_<major><minor>' such as 'sm_90', got {arch!r}")
    source = load_source(name)
    options = _canonical_options(defines or {})
    key = cache_key(
        source,
        options,
        arch,
        nvrtc_version=_nvrtc_version(),
        driver_version=_driver_version() if driver_version is None else driver_version,
        headers_version=_runtime_headers_version(),
    )
    store = cache if cache is not None else KernelCache(cache_dir())
    cubin = store.get(key)
    if cubin is not None:
        return cubin, key
    if _jit_disabled():
        raise CompileError(
            f"{name} for {arch} is not in the kernel cache {store.directory} and "
            "DDTREE_DISABLE_JIT=1 forbids compiling it",
            log="",
            cache_key=key,
        )
    with store.lock(key):
        cubin = store.get(key)
        if cubin is None:
            cubin = _compile(source, options, arch, name, key)
            store.put(key, cubin)
    return cubin, key


# --------------------------------------------------------------------------- device side


def _result_name(err: BaseException) -> str:
    match = re.search(r"CUDA_ERROR_[A-Z_]+", str(err))
    return match.group(0) if match else "UNKNOWN"


def _device_index(device: torch.device | int | None) -> int:
    """Ordinal of a CUDA device given as an index, a ``torch.device`` or ``None`` (current)."""
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    return device.index if device.index is not None else torch.cuda.current_device()


def device_arch(device: torch.device | int | None = None) -> str:
    """Target architecture of a CUDA device, e.g. ``"sm_90"`` for an H100/H200.

    Parameters
    ----------
    device : torch.device or int, optional
        Defaults to torch's current device.

    Returns
    -------
    str
        ``"sm_<major><minor>"``.
    """
    index = _device_index(device)
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


_thread_state = threading.local()


def _make_current(index: int) -> None:
    """Make the primary context of device ``index`` current in this thread (torch's context)."""
    if getattr(_thread_state, "device", None) == index:
        return
    from cuda.core import Device

    torch.cuda.init()
    Device(index).set_current()
    _thread_state.device = index


@functools.cache
def _load_kernel(
    name: str, entry: str, options_key: tuple[tuple[str, str], ...], index: int
) -> Any:
    from cuda.core import ObjectCode

    _make_current(index)
    arch = device_arch(index)
    defines = dict(options_key)
    cubin, key = compile_cubin(name, arch, defines)
    try:
        return ObjectCode.from_cubin(cubin, name=name).get_kernel(entry)
    except Exception as err:
        # An entry that compiled but does not load is treated as corrupt: drop and rebuild once.
        _log.warning("ddtree kernel cache: entry %s failed to load (%s); rebuilding", key, err)
        KernelCache(cache_dir()).discard(key)
        cubin, key = compile_cubin(name, arch, defines)
        try:
            return ObjectCode.from_cubin(cubin, name=name).get_kernel(entry)
        except Exception as err2:
            raise CudaError(
                f"cannot load kernel {entry} from {name} ({arch}, key {key})",
                result_name=_result_name(err2),
            ) from err2


def get_kernel(
    name: str,
    entry: str,
    defines: Mapping[str, int | str] | None = None,
    device: torch.device | int | None = None,
) -> Any:
    """Return the loaded kernel ``entry`` of source ``name`` for a CUDA device (cached).

    Parameters
    ----------
    name : str
        A ``.cu`` file of the ``ddtree.kernels`` package.
    entry : str
        An ``extern "C" __global__`` function of that source.
    defines : mapping of str to int or str, optional
        Preprocessor macros selecting a variant.
    device : torch.device or int, optional
        Defaults to torch's current device.

    Returns
    -------
    cuda.core.Kernel
        Ready for :func:`launch` on that device.

    Raises
    ------
    RuntimeError
        The runtime compiler is unavailable.
    CompileError
        Compilation failed, or a cache miss with ``DDTREE_DISABLE_JIT=1``.
    CudaError
        The compiled module does not load.
    """
    index = _device_index(device)
    key = tuple(sorted((k, str(v)) for k, v in (defines or {}).items()))
    return _load_kernel(name, entry, key, index)


def set_max_dynamic_smem(kernel: Any, shared_mem_bytes: int, device: torch.device | int) -> None:
    """Allow ``kernel`` to use ``shared_mem_bytes`` of dynamic shared memory (needed above 48 KiB).

    Raises
    ------
    CudaError
        The driver refused (for example more than the device's per-block maximum).
    """
    from cuda.bindings import driver

    index = _device_index(device)
    (err,) = driver.cuKernelSetAttribute(
        driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        int(shared_mem_bytes),
        kernel.handle,
        index,
    )
    if int(err) != 0:
        raise CudaError(
            f"cannot allow {shared_mem_bytes} bytes of dynamic shared memory", result_name=err.name
        )


def _dependent_launch_allowed() -> bool:
    return os.environ.get("DDTREE_DEPENDENT_LAUNCH", "").strip() != "0"


@functools.lru_cache(maxsize=256)
def _launch_config(params: LaunchParams, dependent: bool) -> Any:
    from cuda.core import LaunchConfig

    shape = {"grid": params.grid, "block": params.block, "shmem_size": params.shared_mem_bytes}
    if dependent:
        with contextlib.suppress(TypeError):  # a cuda.core without the option: a plain launch
            return LaunchConfig(**shape, programmatic_stream_serialization=True)
    return LaunchConfig(**shape)


@functools.lru_cache(maxsize=64)
def _core_stream(handle: int) -> Any:
    """``cuda.core.Stream`` view of a raw ``cudaStream_t`` owned by torch (not owned here)."""
    from cuda.core import Stream

    return Stream.from_handle(handle)


def launch(
    kernel: Any, params: LaunchParams, *args: Any, device: torch.device | int | None = None
) -> None:
    """Launch ``kernel`` on torch's current stream of ``device``; asynchronous.

    Parameters
    ----------
    kernel : cuda.core.Kernel
        From :func:`get_kernel` for the same device.
    params : LaunchParams
        Grid, block and dynamic shared memory.
    *args
        Kernel arguments in order: Python ``int`` for pointers (``tensor.data_ptr()``), and
        ``ctypes`` scalars (``ctypes.c_int32``, ``ctypes.c_float``, ...) for values.
    device : torch.device or int, optional
        Defaults to torch's current device.

    Raises
    ------
    CudaError
        The driver rejected the launch.
    """
    from cuda.core import launch as core_launch

    index = _device_index(device)
    _make_current(index)
    stream = _core_stream(torch.cuda.current_stream(index).cuda_stream)
    config = _launch_config(params, params.dependent and _dependent_launch_allowed())
    try:
        core_launch(stream, config, kernel, *args)
    except Exception as err:
        raise CudaError(
            f"kernel launch failed with {params}", result_name=_result_name(err)
        ) from err
