from setuptools import find_packages, setup

setup(
    name="megatron-mesh",
    version="0.1.0",
    description="Exact 2D (mesh) context-parallel attention for Megatron-Core",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_mesh", "megatron_mesh.*"]),
    package_data={"megatron_mesh.planner": ["profiles/*.json", "profiles/*.jsonl"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.5", "numpy", "packaging"],
    extras_require={
        "megatron": ["megatron-core>=0.16.1,<0.20", "pyyaml", "psutil"],
        "tensorboard": ["tensorboard"],
        "wandb": ["wandb"],
        "te": ["transformer-engine[pytorch]>=2.8"],
        "plot": ["matplotlib"],
        "dev": ["pytest>=8", "pytest-xdist>=3.6", "ruff>=0.6", "megatron-core>=0.16.1,<0.20",
                "pyyaml", "psutil", "wandb", "matplotlib", "tensorboard", "sentencepiece",
                "transformers",
                # the Triton merge in Triton's CPU interpreter; with the rest, what Megatron-LM's
                # megatron.training imports (tests/system/test_megatron_lm.py)
                "triton", "einops", "six", "regex"],
    },
    entry_points={"console_scripts": ["megatron-mesh = megatron_mesh.cli:main"]},
)
