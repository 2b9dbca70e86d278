"""Build the C++ extension of torch_groupcomm against the installed torch.

Metadata lives in pyproject.toml; this file adds what depends on the torch in
the environment: the extension, the torch version it was built against
(``torch_groupcomm/_build_info.py``), the entry point torch uses to find the
backend, and the version: the release in ``torch_groupcomm/_version.py`` with
the torch as a local label (``0.1.0+torch2.14.1.cu130``), since a build loads
only under the torch it was compiled against. Install with ``pip install --no-build-isolation .``: an isolated build
would compile against a different, freshly downloaded torch.
"""

import glob
import os
import re

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError as exc:  # pragma: no cover - the message is the point
    raise SystemExit(
        "torch_groupcomm builds against the torch already installed, and none was found "
        f"({exc}). Install torch 2.11-2.15 first, then "
        "`pip install --no-build-isolation .`"
    ) from exc

LIBRARY_NAME = "torch_groupcomm"
# The torch releases this package is built and tested against (README: compatibility).
SUPPORTED_TORCH = ((2, 11), (2, 15))
# torch 2.14 looks up unknown backend names in this entry-point group when a
# group is made; older torch imports every "torch.backends" entry point at
# `import torch` (device backend autoload).
LAZY_ENTRY_POINT_SINCE = (2, 14)


def torch_release() -> tuple:
    match = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if match is None:
        raise SystemExit(f"torch_groupcomm: cannot read the version of torch {torch.__version__!r}")
    return int(match.group(1)), int(match.group(2))


def check_torch(release: tuple) -> None:
    low, high = SUPPORTED_TORCH
    if not low <= release <= high:
        raise SystemExit(
            f"torch_groupcomm supports torch {low[0]}.{low[1]} to {high[0]}.{high[1]}; this environment "
            f"has torch {torch.__version__}. Install a supported torch, then rebuild with "
            "`pip install --no-build-isolation .`"
        )


def release_version() -> str:
    """The release number, kept in one place: ``torch_groupcomm/_version.py``."""
    with open(os.path.join(LIBRARY_NAME, "_version.py")) as source:
        match = re.search(r'^RELEASE = "([^"]+)"$', source.read(), re.MULTILINE)
    if match is None:
        raise SystemExit(f'torch_groupcomm: no RELEASE = "..." line in {LIBRARY_NAME}/_version.py')
    return match.group(1)


def build_version() -> str:
    """The release plus the torch it is built against as a PEP 440 local label:
    ``0.1.0+torch2.13.0.cpu`` (the torch's own ``+cpu`` becomes ``.cpu``)."""
    return f"{release_version()}+torch{torch.__version__.replace('+', '.')}"


def write_build_info(version: str) -> None:
    """Record the torch this build compiles against (import checks it, _native.py)
    and the version the package reports."""
    path = os.path.join(LIBRARY_NAME, "_build_info.py")
    text = (
        '"""Written by setup.py at build time: the torch the extension was compiled against."""\n\n'
        f"TORCH_VERSION = {torch.__version__!r}\n"
        f"VERSION = {version!r}\n"
    )
    old = open(path).read() if os.path.exists(path) else None
    if old != text:
        with open(path, "w") as out:
            out.write(text)


class BuildForThisTorch(BuildExtension):
    """Rebuild every object when the torch in the environment changed since the
    last build: setuptools compares source timestamps only, and objects compiled
    against one torch crash or fail to load under another."""

    def run(self) -> None:
        stamp = os.path.join(self.build_temp, "torch-version")
        if not os.path.exists(stamp) or open(stamp).read() != torch.__version__:
            self.force = True
        super().run()
        os.makedirs(self.build_temp, exist_ok=True)
        with open(stamp, "w") as out:
            out.write(torch.__version__)


release = torch_release()
check_torch(release)
version = build_version()
write_build_info(version)

debug = os.environ.get("DEBUG", "0") == "1"
# No -std flag: cpp_extension picks the standard the installed torch needs
# (C++17 for torch 2.11, C++20 for 2.13 and later: 2.14 headers refuse anything older).
# -g0: Python's own CFLAGS ask for debug info, which for torch's headers makes
# every object ~40% slower to compile (and the library several times larger).
extra_compile_args = (["-O0", "-g"] if debug else ["-O3", "-g0"]) + ["-fvisibility=hidden", "-ffp-contract=off"]

if release >= LAZY_ENTRY_POINT_SINCE:
    entry_points = {"torch.distributed.backends": ["groupcomm = torch_groupcomm._autoload:register"]}
else:
    entry_points = {"torch.backends": [f"{LIBRARY_NAME} = {LIBRARY_NAME}._autoload:register"]}

setup(
    version=version,
    ext_modules=[
        CppExtension(
            f"{LIBRARY_NAME}._C",
            sources=sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True)),
            include_dirs=[os.path.abspath("csrc")],
            extra_compile_args=extra_compile_args,
        )
    ],
    cmdclass={"build_ext": BuildForThisTorch},
    entry_points=entry_points,
)
