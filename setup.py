"""Packaging glue that pyproject.toml cannot say on its own: the benchmark suite in
benchmarks/ ships inside the distribution as the package ``qkv_benchmarks``, so that the
``qkv bench`` command works from an installed qkv (plain or editable)."""
from setuptools import find_packages, setup

setup(
    packages=find_packages("src") + ["qkv_benchmarks"],
    package_dir={"": "src", "qkv_benchmarks": "benchmarks"},
)
