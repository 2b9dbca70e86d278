"""Build torch_groupcomm and its C++ extension against the installed torch.

Install with ``pip install --no-build-isolation .`` so the extension is compiled
against the torch already in the environment (an isolated build would fetch a
different torch and produce an extension that does not load).
"""

import os

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

LIBRARY_NAME = "torch_groupcomm"

debug = os.environ.get("DEBUG", "0") == "1"
extra_compile_args = ["-O0", "-g"] if debug else ["-O3"]
extra_compile_args += ["-std=c++17", "-fvisibility=hidden"]

setup(
    name=LIBRARY_NAME,
    version="0.1.0",
    description="groupcomm: a torch.distributed backend routed through group coordinators",
    packages=find_packages(include=[LIBRARY_NAME, f"{LIBRARY_NAME}.*"]),
    ext_modules=[
        CppExtension(
            f"{LIBRARY_NAME}._C",
            sources=sorted(
                os.path.join("csrc", f)
                for f in os.listdir("csrc")
                if f.endswith(".cpp")
            ),
            extra_compile_args=extra_compile_args,
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    entry_points={"torch.backends": [f"{LIBRARY_NAME} = {LIBRARY_NAME}._autoload:register"]},
    python_requires=">=3.9",
    # NCCL for CUDA tensors, loaded at run time (torch_groupcomm/communicators/nccl.py)
    install_requires=[
        "torch>=2.6",
        'nvidia-nccl-cu12; platform_system == "Linux" and (platform_machine == "x86_64" or platform_machine == "aarch64")',
    ],
    license="BSD-3-Clause",
)
